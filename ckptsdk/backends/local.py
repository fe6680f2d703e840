"""Local-disk backend: atomic publish by temp file + rename, conditional writes by link and flock.

Everything here is plain POSIX on one machine; the primitives (fsync, flock, the version token,
reserved names) are in ``posix.py``, and this class maps keys to paths and ``OSError`` to the
error tree. The Drive backend (``drive.py``) reuses it and changes only what the mount cannot do.
Nothing about checkpoints belongs here; the contract each method meets is in ``base.py``.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import stat as stat_mod
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import BinaryIO

from ckptsdk.backends.base import (
    Capabilities,
    Data,
    ObjectInfo,
    check_folder_prefix,
    check_key,
    check_prefix,
    iter_chunks,
)
from ckptsdk.backends.deadline import current
from ckptsdk.backends.posix import (
    LOCK_NAME,
    LOCK_TIMEOUT_S,
    NO_FLOCK_ERRNOS,
    NOT_THERE,
    RESERVED_PREFIX,
    TMP_PREFIX,
    UNAVAILABLE_ERRNOS,
    deferred_dir_sync,
    discard,
    flock,
    fsync_dir,
    make_folders,
    no_fork,
    open_regular,
    prune,
    published_key,
    regular_stat,
    scan,
    thread_lock,
    top_folders,
    version_of,
    write_temp,
)
from ckptsdk.errors import BackendError, InvalidKey, ObjectNotFound, PreconditionFailed, StorageUnavailable

logger = logging.getLogger(__name__)

# Importable from here as before (tests, drive.py): the names a file backend puts on disk.
__all__ = ["LocalBackend", "LOCK_NAME", "RESERVED_PREFIX", "TMP_PREFIX", "version_of"]


class LocalBackend:
    """Objects as files under a folder on this machine.

    ``write`` publishes through a temp file in the target folder (``.ckptsdk-tmp.<name>.<pid>.<hex>``)
    that is fsynced and renamed over the key, then the folder is fsynced (at the end of the
    caller's ``durability()`` block, once per folder, where there is one; a folder a
    write creates has its parent fsynced too). ``create`` links the
    finished temp file to the key (the link fails if the key exists, and is never half-visible).
    ``replace`` and versioned ``delete`` compare versions under an exclusive ``flock`` on
    ``ROOT/.ckptsdk-lock``, which every publish of this class also takes, so a compare-and-swap
    excludes every ckptsdk writer of this root on this machine (not other programs, and not a
    second backend rooted in a sub-folder). Folders are created as needed and pruned when a
    delete empties them.

    Args:
        root: the folder that holds the objects; created on first write, listed as empty if missing.
        url: the URL it was opened with (for messages); defaults to ``root``.

    Raises:
        StorageUnavailable: ``root`` exists but is not a folder, or the filesystem is gone.

    Example:
        >>> b = LocalBackend("/tmp/ckpt-demo")
        >>> info = b.write("runs/a.bin", [b"he", b"llo"])
        >>> b.read("runs/a.bin")
        b'hello'
    """

    capabilities = Capabilities(exclusive_create=True, compare_and_swap=True, cheap_copy=True)
    # Local disks have flock; without it compare_and_swap would be a lie, so its absence is an error.
    _flock_optional = False
    # Appended to StorageUnavailable messages: what the user should do about a sick store.
    _unavailable_hint = "check that the disk holding it is mounted, readable and writable"

    def __init__(self, root: str, *, url: str | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = url or self.root
        self._told_no_flock = False
        self._check_root()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def durability(self, *, sync: bool = True) -> AbstractContextManager[None]:
        """This thread's folder fsyncs put off to the block's end, one per folder (see
        :class:`~ckptsdk.backends.base.Batching` and ``posix.deferred_dir_sync``)."""
        return deferred_dir_sync(sync=sync)

    # -- reads -------------------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        """Return the whole object at ``key`` (see :meth:`Backend.read`)."""
        path = self._path(key)
        with self._errors("read", key, missing=True):
            with open_regular(path) as f:
                return f.read()

    def open(self, key: str) -> BinaryIO:
        """Open ``key`` for streaming reads; supports ``read``, ``readinto`` and ``seek``.

        Errors while reading the returned stream are the filesystem's own ``OSError``.
        """
        path = self._path(key)
        with self._errors("open", key, missing=True):
            return open_regular(path)

    def stat(self, key: str) -> ObjectInfo:
        """Return the size and version of ``key``, or raise ``ObjectNotFound``."""
        path = self._path(key)
        with self._errors("stat", key, missing=True):
            st = os.stat(path)
            if not stat_mod.S_ISREG(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "a folder, not an object", path)
            return ObjectInfo(key, st.st_size, version_of(st), st.st_mtime_ns / 1e9)

    def exists(self, key: str) -> bool:
        """Whether ``key`` is an object now, as this machine sees it."""
        try:
            self.stat(key)
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, recursively, sorted by key.

        A prefix is a string match (``"a/b"`` matches ``a/b``, ``a/bc`` and ``a/b/c``); only the
        folders that can hold a match are read. Temp files and the lock file are never listed.
        """
        check_prefix(prefix, url=self.url)
        out: list[ObjectInfo] = []
        start = prefix.rpartition("/")[0]

        def wanted(folder_key: str) -> bool:
            folder_key += "/"
            return folder_key.startswith(prefix) or prefix.startswith(folder_key)

        with self._errors("list", prefix or None):
            for key, entry in self._scan(start, wanted):
                listed = key.startswith(prefix) and not entry.name.startswith(RESERVED_PREFIX)
                if listed and (st := regular_stat(entry)) is not None:
                    out.append(ObjectInfo(key, st.st_size, version_of(st), st.st_mtime_ns / 1e9))
        out.sort(key=lambda info: info.key)
        return out

    def list_folders(self, prefix: str) -> builtins.list[str]:
        """The top-level folders whose names start with ``prefix``, sorted: one read of the root
        (``list`` reads every folder it descends into); symlinked ones are not followed there either."""
        check_folder_prefix(prefix, url=self.url)
        with self._errors("list", prefix or None):
            try:
                return top_folders(self.root, prefix)
            except NOT_THERE:  # a missing root has none; one that is a file is an error
                self._check_root()
                return []

    # -- writes ------------------------------------------------------------------------------

    def write(self, key: str, data: Data) -> ObjectInfo:
        """Atomically publish ``data`` at ``key``, replacing any previous object."""
        return self._publish("write", key, data, self._commit_replace)

    def create(self, key: str, data: Data) -> ObjectInfo:
        """Publish ``data`` only if ``key`` does not exist, else raise ``PreconditionFailed``."""
        path = self._path(key)
        if os.path.lexists(path):  # fail before writing a large temp file; rechecked at commit
            raise self._exists_error(key, path)
        return self._publish("create", key, data, self._commit_create)

    def replace(self, key: str, data: Data, version: str) -> ObjectInfo:
        """Publish ``data`` only if ``key``'s current version is ``version``.

        Raises:
            PreconditionFailed: the object is gone or its version moved on (``expected``/``actual``).
        """
        path = self._path(key)
        with self._errors("replace", key):
            self._check_version("replace", key, path, version)  # cheap early failure

        def commit(path: str, tmp: str) -> None:
            self._check_version("replace", key, path, version)
            os.replace(tmp, path)

        return self._publish("replace", key, data, commit)

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Publish ``src``'s object at ``dst`` as a hard link: no byte is copied.

        Safe because this backend never rewrites a published file in place (every write is a new
        file renamed over the key), so the two keys can only part ways, never corrupt each other.

        Raises:
            ObjectNotFound: ``src`` does not exist.
            PreconditionFailed: ``dst`` exists already.
        """
        src_path, path = self._path(src), self._path(dst)
        self.stat(src)
        with self._locked("copy", dst):
            with self._errors("copy", dst):
                make_folders(os.path.dirname(path))
                try:
                    os.link(src_path, path)
                except FileExistsError:
                    raise self._exists_error(dst, path) from None
                except FileNotFoundError:
                    raise ObjectNotFound(f"no object {src!r} under {self.url}", url=self.url, key=src) from None
                fsync_dir(os.path.dirname(path))
                st = os.stat(path)
        return ObjectInfo(dst, st.st_size, version_of(st), st.st_mtime_ns / 1e9)

    def delete(self, key: str, *, version: str | None = None) -> None:
        """Delete ``key``; with ``version``, only if that is still its version.

        Raises:
            ObjectNotFound: ``key`` does not exist.
            PreconditionFailed: ``version`` was given and the object moved on.
        """
        path = self._path(key)
        self.stat(key)  # ObjectNotFound early, without creating the root for the lock
        with self._locked("delete", key):
            with self._errors("delete", key, missing=True):
                if version is not None:
                    self._check_version("delete", key, path, version, missing_is_precondition=False)
                else:
                    self.stat(key)
                os.unlink(path)
                folder = os.path.dirname(path)
                fsync_dir(folder)
                prune(self.root, folder)

    def sweep(
        self, older_than: float, *, only: Callable[[str], bool] | None = None
    ) -> builtins.list[str]:  # `list`: the method above
        """Remove temp files of crashed writes last modified more than ``older_than`` seconds ago.

        ``only(key)``: sweep only temp files that were to publish ``key`` (see ``Backend.sweep``).

        Returns:
            The removed temp files, as keys relative to the root, sorted.
        """
        cutoff = time.time() - older_than
        removed: list[str] = []
        with self._errors("sweep", None):
            for key, entry in self._scan("", lambda _folder: True):
                if not entry.name.startswith(TMP_PREFIX):
                    continue
                if only is not None and not only(published_key(key)):
                    continue
                try:
                    if entry.stat(follow_symlinks=False).st_mtime > cutoff:
                        continue
                    os.unlink(entry.path)
                except FileNotFoundError:  # its writer published or removed it meanwhile
                    continue
                logger.info("swept leftover temp file %s under %s", key, self.url)
                removed.append(key)
                prune(self.root, os.path.dirname(entry.path))
        return sorted(removed)

    # -- the publish protocol ----------------------------------------------------------------

    def _publish(self, op: str, key: str, data: Data, commit: Callable[[str, str], None]) -> ObjectInfo:
        """Write a finished temp file, then ``commit(path, tmp)`` it under the root lock."""
        path = self._path(key)
        tmp = self._write_temp(op, key, path, data)
        try:
            with self._locked(op, key):
                with self._errors(op, key):
                    commit(path, tmp)
                    fsync_dir(os.path.dirname(path))
                    # Stat the key while still holding the lock, so the version returned is the
                    # one this call published, whatever another writer does next.
                    st = os.stat(path)
        except BaseException:
            discard(tmp)
            raise
        return ObjectInfo(key, st.st_size, version_of(st), st.st_mtime_ns / 1e9)

    def _commit_replace(self, path: str, tmp: str) -> None:
        os.replace(tmp, path)

    def _commit_create(self, path: str, tmp: str) -> None:
        # link() refuses an existing target atomically, and the target appears only complete.
        # A crash between link and unlink leaves the temp name as a second link: sweep's job.
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise self._exists_error(self._key_of(path), path) from None
        os.unlink(tmp)

    def _write_temp(self, op: str, key: str, path: str, data: Data) -> str:
        """Write ``data`` to a new temp file next to ``path``, fsynced; return its path."""
        return write_temp(path, iter_chunks(data), lambda exc: self._translate(exc, op, key, missing=False))

    def _check_version(
        self, op: str, key: str, path: str, version: str, *, missing_is_precondition: bool = True
    ) -> None:
        try:
            st = os.stat(path)
        except NOT_THERE:
            if not missing_is_precondition:
                raise
            st = None
        actual = version_of(st) if st is not None and stat_mod.S_ISREG(st.st_mode) else None
        if actual != version:
            state = "is gone" if actual is None else f"is now at version {actual}"
            raise PreconditionFailed(
                f"{op} of {key!r} under {self.url} expected version {version}, but the object "
                f"{state}: another writer changed it; re-read it and decide again",
                url=self.url,
                key=key,
                expected=version,
                actual=actual,
            )

    def _exists_error(self, key: str, path: str) -> PreconditionFailed:
        try:
            actual: str | None = version_of(os.stat(path))
        except OSError:
            actual = None
        return PreconditionFailed(
            f"create of {key!r} under {self.url} failed: it already exists (version {actual}); "
            "another writer created it first",
            url=self.url,
            key=key,
            expected=None,
            actual=actual,
        )

    @contextmanager
    def _locked(self, op: str, key: str | None) -> Iterator[None]:
        """Hold the root's exclusive flock (bounded wait: a stuck holder raises, never hangs).

        No fork happens while the descriptor is open (``no_fork``): a child would inherit the lock.
        """
        with no_fork():
            with self._errors(op, key):
                os.makedirs(self.root, exist_ok=True)
                fd = os.open(os.path.join(self.root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                if self._flock(fd, op, key):
                    yield
                else:  # no flock here (allowed on Drive only): at least exclude this process's threads
                    with thread_lock(self.root):
                        yield
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def _flock(self, fd: int, op: str, key: str | None) -> bool:
        """Take the flock on ``fd``; False if this filesystem has none and ``_flock_optional``."""
        pending = current()  # the save's deadline (deadline.py) ends the wait too
        try:
            if flock(fd, LOCK_TIMEOUT_S if pending is None else max(0.0, min(LOCK_TIMEOUT_S, pending.remaining()))):
                return True
        except OSError as exc:
            if self._flock_optional and exc.errno in NO_FLOCK_ERRNOS:
                if not self._told_no_flock:
                    self._told_no_flock = True
                    logger.warning(
                        "no flock on %s (%s): create/replace exclude only this process's threads",
                        self.root,
                        exc.strerror,
                    )
                return False
            raise self._translate(exc, op, key) from exc
        if pending is not None and pending.remaining() <= 0:
            held = f"the lock {LOCK_NAME} in {self.root}, held by another process ({op} of {key!r})"
            raise pending.exceeded(url=self.url, key=key, waited_for=held)
        raise BackendError(
            f"{op} of {key!r} under {self.url}: the lock {LOCK_NAME} stayed held for "
            f"{LOCK_TIMEOUT_S:.0f} s; another process is stuck in a write here. "
            "Find and stop it, then retry",
            url=self.url,
            key=key,
        )

    # -- helpers -----------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        check_key(key, url=self.url)
        parts = key.split("/")
        if any(part.startswith(RESERVED_PREFIX) for part in parts):
            raise InvalidKey(
                f"invalid key {key!r} under {self.url}: names starting with {RESERVED_PREFIX!r} "
                "are reserved for ckptsdk's temp and lock files",
                url=self.url,
                key=key,
            )
        return os.path.join(self.root, *parts)

    def _key_of(self, path: str) -> str:
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def _scan(self, folder: str, descend: Callable[[str], bool]) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """``posix.scan`` under the root; a missing root is empty, a root that is a file is not."""
        try:
            yield from scan(self.root, folder, descend)
        except NOT_THERE:
            self._check_root()

    def _check_root(self) -> None:
        """Raise ``StorageUnavailable`` if the root exists but cannot be a folder of objects."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return
        except NotADirectoryError as exc:
            raise StorageUnavailable(
                f"storage root {self.root} (for {self.url}) is inside a file, not a folder: choose another path",
                url=self.url,
            ) from exc
        except OSError as exc:
            raise self._unavailable(exc, "stat", None) from exc
        if not stat_mod.S_ISDIR(st.st_mode):
            raise StorageUnavailable(
                f"storage root {self.root} (for {self.url}) is a file, not a folder: "
                "choose another path or move the file away",
                url=self.url,
            )

    def _unavailable(self, exc: OSError, op: str, key: str | None) -> StorageUnavailable:
        where = f"{op} of {key!r}" if key else op
        return StorageUnavailable(
            f"{where} under {self.url} failed: the storage at {self.root} is unavailable "
            f"({exc.strerror or exc}); {self._unavailable_hint}",
            url=self.url,
            key=key,
        )

    def _translate(self, exc: OSError, op: str, key: str | None, *, missing: bool = False) -> BackendError:
        """Map an ``OSError`` to the error tree. ``missing``: "not there" means ObjectNotFound."""
        if isinstance(exc, BackendError):
            return exc
        if exc.errno in UNAVAILABLE_ERRNOS:
            return self._unavailable(exc, op, key)
        if op in ("write", "create", "replace") and not os.path.isdir(self.root):
            # The root itself cannot be made (/proc/x, a read-only mount): say so, rather than
            # "No such file or directory" for whatever object we were writing.
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as root_exc:
                return StorageUnavailable(
                    f"{op} under {self.url} failed: the storage root {self.root} does not exist and "
                    f"cannot be created ({root_exc.strerror or root_exc}); choose a path in a "
                    "folder this user can write to",
                    url=self.url,
                    key=key,
                )
        if isinstance(exc, (*NOT_THERE, FileExistsError)):
            try:
                self._check_root()
            except StorageUnavailable as root_exc:
                return root_exc
        if missing and (isinstance(exc, NOT_THERE) or exc.errno == errno.ELOOP):
            return ObjectNotFound(f"no object {key!r} under {self.url}", url=self.url, key=key)
        if isinstance(exc, PermissionError) and not os.access(
            self.root if os.path.exists(self.root) else os.path.dirname(self.root),
            os.R_OK | os.W_OK | os.X_OK,
        ):
            return StorageUnavailable(
                f"{op} under {self.url} failed: permission denied on {self.root}; "
                "give this user read and write access to it or choose another path",
                url=self.url,
                key=key,
            )
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return BackendError(
                f"{op} of {key!r} under {self.url} failed: no space left ({exc.strerror}); free "
                "space (or delete old checkpoints) and retry",
                url=self.url,
                key=key,
            )
        what = f"{op} of {key!r}" if key else op
        return BackendError(f"{what} under {self.url} failed: {exc}", url=self.url, key=key)

    @contextmanager
    def _errors(self, op: str, key: str | None, *, missing: bool = False) -> Iterator[None]:
        try:
            yield
        except BackendError:
            raise
        except OSError as exc:
            raise self._translate(exc, op, key, missing=missing) from exc
