"""Local-disk backend: atomic publish by temp file + rename, conditional writes by link and flock.

Everything here is plain POSIX on one machine. The Drive backend (``drive.py``) reuses it and
changes only what the mount cannot do. Nothing about checkpoints belongs here; the contract each
method meets is documented in ``base.py``.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import logging
import os
import secrets
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from ..errors import (
    BackendError,
    InvalidKey,
    ObjectNotFound,
    PreconditionFailed,
    StorageUnavailable,
)
from .base import Capabilities, Data, ObjectInfo, check_key, check_prefix, iter_chunks

logger = logging.getLogger(__name__)

# Every name this backend puts on disk for itself starts with RESERVED_PREFIX; list() skips them
# and keys may not use them, so bookkeeping can never be mistaken for (or clobber) an object.
RESERVED_PREFIX = ".ckptsdk-"
TMP_PREFIX = ".ckptsdk-tmp."
LOCK_NAME = ".ckptsdk-lock"

# The store itself is gone or sick rather than one object missing: a dropped FUSE mount reports
# ENOTCONN (Drive's "Transport endpoint is not connected"), a failing disk or an over-full Drive
# folder EIO, a vanished NFS export ESTALE.
_UNAVAILABLE_ERRNOS = frozenset({errno.ENOTCONN, errno.EIO, errno.ESTALE, errno.ENODEV, errno.ENXIO})
# Filesystems that cannot fsync a directory say so with one of these; the rename is then as
# durable as that filesystem makes it, which is all we can ask.
_NO_DIR_FSYNC_ERRNOS = frozenset({errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF})
_NOT_THERE = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
# A key that is a symlink loop (or a too-long chain of links) is no object either.
_NOT_AN_OBJECT_ERRNOS = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR})
# A filesystem without flock (possible behind FUSE) answers with one of these.
_NO_FLOCK_ERRNOS = frozenset({errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOLCK})
LOCK_TIMEOUT_S = 120.0

_clock_lock = threading.Lock()
_last_stamp_ns = 0
_thread_locks: dict[str, threading.Lock] = {}


def _thread_lock(root: str) -> threading.Lock:
    """One process-wide lock per root: the fallback where the filesystem has no flock."""
    with _clock_lock:
        return _thread_locks.setdefault(root, threading.Lock())


def _unique_ns() -> int:
    """A wall-clock timestamp in ns, strictly increasing within this process."""
    global _last_stamp_ns
    with _clock_lock:
        now = time.time_ns()
        _last_stamp_ns = now if now > _last_stamp_ns else _last_stamp_ns + 1
        return _last_stamp_ns


def version_of(st: os.stat_result) -> str:
    """The version token of a published file: its inode, size and mtime (ns), in hex."""
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def _published_key(temp_key: str) -> str:
    """The key a temp file (``folder/.ckptsdk-tmp.NAME.PID.HEX``) was going to publish."""
    folder, _, name = temp_key.rpartition("/")
    target = name[len(TMP_PREFIX):].rsplit(".", 2)[0]
    return f"{folder}/{target}" if folder else target


class LocalBackend:
    """Objects as files under a folder on this machine.

    ``write`` publishes through a temp file in the target folder (``.ckptsdk-tmp.<name>.<pid>.<hex>``)
    that is fsynced and renamed over the key, then the folder is fsynced. ``create`` links the
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

    # -- reads -------------------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        """Return the whole object at ``key`` (see :meth:`Backend.read`)."""
        path = self._path(key)
        with self._errors("read", key, missing=True):
            with self._open_regular(path) as f:
                return f.read()

    def open(self, key: str) -> BinaryIO:
        """Open ``key`` for streaming reads; supports ``read``, ``readinto`` and ``seek``.

        Errors while reading the returned stream are the filesystem's own ``OSError``.
        """
        path = self._path(key)
        with self._errors("open", key, missing=True):
            return self._open_regular(path)

    @staticmethod
    def _open_regular(path: str) -> BinaryIO:
        """Open ``path`` for reading if it is a regular file; else "not there" (never blocks).

        O_NONBLOCK: opening a FIFO for reading blocks until a writer appears (forever); with
        it the open returns at once, and fstat tells what it is. Regular files ignore the flag.
        """
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                raise IsADirectoryError(errno.EISDIR, "not a regular file (a folder, FIFO, socket or device)", path)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            return open(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

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

    def list(self, prefix: str = "") -> list[ObjectInfo]:
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
                if entry.name.startswith(RESERVED_PREFIX) or not key.startswith(prefix):
                    continue
                try:
                    st = entry.stat()
                except OSError as exc:
                    # Deleted while we listed, or a link that leads nowhere (dangling, a loop):
                    # not an object, like a FIFO or a folder. One bad entry must not fail the
                    # listing of a whole root.
                    if exc.errno not in _NOT_AN_OBJECT_ERRNOS:
                        raise
                    logger.debug("not listing %s under %s: %s", key, self.url, exc)
                    continue
                if stat_mod.S_ISREG(st.st_mode):
                    out.append(ObjectInfo(key, st.st_size, version_of(st), st.st_mtime_ns / 1e9))
        out.sort(key=lambda info: info.key)
        return out

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
                os.makedirs(os.path.dirname(path), exist_ok=True)
                try:
                    os.link(src_path, path)
                except FileExistsError:
                    raise self._exists_error(dst, path) from None
                except FileNotFoundError:
                    raise ObjectNotFound(f"no object {src!r} under {self.url}", url=self.url, key=src) from None
                self._fsync_dir(os.path.dirname(path))
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
                self._fsync_dir(folder)
                self._prune(folder)

    def sweep(self, older_than: float, *,
              only: Callable[[str], bool] | None = None) -> builtins.list[str]:  # `list`: the method above
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
                if only is not None and not only(_published_key(key)):
                    continue
                try:
                    if entry.stat(follow_symlinks=False).st_mtime > cutoff:
                        continue
                    os.unlink(entry.path)
                except FileNotFoundError:  # its writer published or removed it meanwhile
                    continue
                logger.info("swept leftover temp file %s under %s", key, self.url)
                removed.append(key)
                self._prune(os.path.dirname(entry.path))
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
                    self._fsync_dir(os.path.dirname(path))
                    # Stat the key while still holding the lock, so the version returned is the
                    # one this call published, whatever another writer does next.
                    st = os.stat(path)
        except BaseException:
            self._discard(tmp)
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
        folder, name = os.path.split(path)
        fd = -1
        # A concurrent delete may prune the folder between makedirs and open: retry a little.
        for attempt in range(5):
            tmp = os.path.join(folder, f"{TMP_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}")
            try:
                os.makedirs(folder, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                break
            except FileNotFoundError as exc:
                if attempt == 4:
                    raise self._translate(exc, op, key, missing=False) from exc
            except OSError as exc:
                raise self._translate(exc, op, key, missing=False) from exc
        f = open(fd, "wb")
        try:
            # The caller's iterable may raise: that propagates unchanged (nothing published).
            for chunk in iter_chunks(data):
                try:
                    f.write(chunk)
                except OSError as exc:
                    raise self._translate(exc, op, key, missing=False) from exc
            try:
                f.flush()
                os.fsync(f.fileno())
                self._stamp(f.fileno())
                f.close()
            except OSError as exc:
                raise self._translate(exc, op, key, missing=False) from exc
        except BaseException:
            # After a failed write (a full disk) the buffer still holds bytes: close() retries
            # the flush and raises ENOSPC again, raw. The descriptor is closed either way.
            try:
                f.close()
            except OSError:
                pass
            self._discard(tmp)
            raise
        return tmp

    def _stamp(self, fd: int) -> None:
        # The version token is (inode, size, mtime). A freed inode can be reused by the next write
        # of the same size within one coarse kernel tick (ext4 stamps mtime per jiffy), which would
        # repeat a token; a process-unique ns timestamp makes every publish's token new.
        t = _unique_ns()
        try:
            os.utime(fd, ns=(t, t))
        except OSError as exc:  # a filesystem that refuses utime still publishes correctly
            logger.debug("could not stamp mtime under %s: %s", self.url, exc)

    def _check_version(
        self, op: str, key: str, path: str, version: str, *, missing_is_precondition: bool = True
    ) -> None:
        try:
            st = os.stat(path)
        except _NOT_THERE:
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
        """Hold the root's exclusive flock (bounded wait: a stuck holder raises, never hangs)."""
        with self._errors(op, key):
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(os.path.join(self.root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            if self._flock(fd, op, key):
                yield
            else:  # no flock here (allowed on Drive only): at least exclude this process's threads
                with _thread_lock(self.root):
                    yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def _flock(self, fd: int, op: str, key: str | None) -> bool:
        """Take the flock on ``fd``; False if this filesystem has none and ``_flock_optional``."""
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        delay = 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BackendError(
                        f"{op} of {key!r} under {self.url}: the lock {LOCK_NAME} stayed held for "
                        f"{LOCK_TIMEOUT_S:.0f} s; another process is stuck in a write here. "
                        "Find and stop it, then retry",
                        url=self.url,
                        key=key,
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            except OSError as exc:
                if self._flock_optional and exc.errno in _NO_FLOCK_ERRNOS:
                    if not self._told_no_flock:
                        self._told_no_flock = True
                        logger.warning(
                            "no flock on %s (%s): create/replace exclude only this process's threads",
                            self.root, exc.strerror,
                        )
                    return False
                raise self._translate(exc, op, key) from exc

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

    def _scan(self, folder: str, descend: Callable[[str], bool]) -> Iterator[tuple[str, os.DirEntry]]:
        """Yield ``(key, entry)`` for every non-folder under ``folder`` (a key, "" for the root).

        Symlinked folders are not followed (no cycles); ``descend(folder_key)`` prunes the walk.
        """
        path = os.path.join(self.root, *folder.split("/")) if folder else self.root
        try:
            entries = list(os.scandir(path))
        except _NOT_THERE:
            if not folder:
                self._check_root()
            return
        for entry in entries:
            key = f"{folder}/{entry.name}" if folder else entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if is_dir:
                if descend(key):
                    yield from self._scan(key, descend)
            else:
                yield key, entry

    def _prune(self, folder: str) -> None:
        """Remove ``folder`` and its parents while they are empty, never the root itself."""
        while folder != self.root and folder.startswith(self.root + os.sep):
            try:
                os.rmdir(folder)
            except OSError:  # not empty (or a writer just put a temp file in it): stop here
                return
            folder = os.path.dirname(folder)

    def _discard(self, tmp: str) -> None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:  # the original error matters more; sweep() will get this one
            logger.warning("could not remove temp file %s: %s (sweep() will)", tmp, exc)

    def _fsync_dir(self, folder: str) -> None:
        # Makes the rename itself durable: without it a power cut can forget the new name.
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in _NO_DIR_FSYNC_ERRNOS:
                raise
        finally:
            os.close(fd)

    def _check_root(self) -> None:
        """Raise ``StorageUnavailable`` if the root exists but cannot be a folder of objects."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return
        except NotADirectoryError as exc:
            raise StorageUnavailable(
                f"storage root {self.root} (for {self.url}) is inside a file, not a folder: "
                "choose another path",
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
        if exc.errno in _UNAVAILABLE_ERRNOS:
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
        if isinstance(exc, (*_NOT_THERE, FileExistsError)):
            try:
                self._check_root()
            except StorageUnavailable as root_exc:
                return root_exc
        if missing and (isinstance(exc, _NOT_THERE) or exc.errno == errno.ELOOP):
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
