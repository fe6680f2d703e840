"""POSIX primitives for the file backends (``local.py``, ``drive.py``): reserved names, the version
token, safe opens, fsync of files and folders (put off to one per folder in a block), flock with a
bounded wait, folder walks and pruning.

Functions of paths and descriptors only: no keys, no URLs, no error translation (that is
``LocalBackend``'s), and nothing about checkpoints.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

logger = logging.getLogger(__name__)

# Every name this backend puts on disk for itself starts with RESERVED_PREFIX; list() skips them
# and keys may not use them, so bookkeeping can never be mistaken for (or clobber) an object.
RESERVED_PREFIX = ".ckptsdk-"
TMP_PREFIX = ".ckptsdk-tmp."
LOCK_NAME = ".ckptsdk-lock"

# The store itself is gone or sick rather than one object missing: a dropped FUSE mount reports
# ENOTCONN (Drive's "Transport endpoint is not connected"), a failing disk or an over-full Drive
# folder EIO, a vanished NFS export ESTALE.
UNAVAILABLE_ERRNOS = frozenset({errno.ENOTCONN, errno.EIO, errno.ESTALE, errno.ENODEV, errno.ENXIO})
# Filesystems that cannot fsync a directory say so with one of these; the rename is then as
# durable as that filesystem makes it, which is all we can ask.
NO_DIR_FSYNC_ERRNOS = frozenset({errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF})
NOT_THERE = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
# A key that is a symlink loop (or a too-long chain of links) is no object either.
NOT_AN_OBJECT_ERRNOS = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR})
# A filesystem without flock (possible behind FUSE) answers with one of these.
NO_FLOCK_ERRNOS = frozenset({errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOLCK})
LOCK_TIMEOUT_S = 120.0

_clock_lock = threading.Lock()
_last_stamp_ns = 0
_thread_locks: dict[str, threading.Lock] = {}


# A flock belongs to an open file description, which fork() shares with the child: a fork (a
# DataLoader starting its workers) while one of our threads holds a root's lock leaves the child
# holding it after the parent closes its descriptor, and every later write here waits the whole
# LOCK_TIMEOUT_S, then fails. So this process never forks inside a locked section.
_fork_guard = threading.RLock()
os.register_at_fork(before=_fork_guard.acquire, after_in_parent=_fork_guard.release, after_in_child=_fork_guard.release)


@contextmanager
def no_fork() -> Iterator[None]:
    """Hold off ``os.fork`` in this process (other threads' forks wait) while the block runs."""
    with _fork_guard:
        yield


def thread_lock(root: str) -> threading.Lock:
    """One process-wide lock per root: the fallback where the filesystem has no flock."""
    with _clock_lock:
        return _thread_locks.setdefault(root, threading.Lock())


def unique_ns() -> int:
    """A wall-clock timestamp in ns, strictly increasing within this process."""
    global _last_stamp_ns
    with _clock_lock:
        now = time.time_ns()
        _last_stamp_ns = now if now > _last_stamp_ns else _last_stamp_ns + 1
        return _last_stamp_ns


def version_of(st: os.stat_result) -> str:
    """The version token of a published file: its inode, size and mtime (ns), in hex."""
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def published_key(temp_key: str) -> str:
    """The key a temp file (``folder/.ckptsdk-tmp.NAME.PID.HEX``) was going to publish."""
    folder, _, name = temp_key.rpartition("/")
    target = name[len(TMP_PREFIX) :].rsplit(".", 2)[0]
    return f"{folder}/{target}" if folder else target


def open_regular(path: str) -> BinaryIO:
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


def open_temp(path: str) -> tuple[int, str]:
    """Create a new temp file next to ``path`` (its folder made as needed): ``(fd, temp_path)``.

    The name is ``.ckptsdk-tmp.<name>.<pid>.<hex>`` (``published_key`` reads it back).
    """
    folder, name = os.path.split(path)
    # A concurrent delete may prune the folder between makedirs and open: retry a little.
    for attempt in range(5):
        tmp = os.path.join(folder, f"{TMP_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            make_folders(folder)
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileNotFoundError:
            if attempt == 4:
                raise
    raise AssertionError("unreachable: the last attempt re-raises")


def make_folders(folder: str) -> None:
    """``os.makedirs(folder, exist_ok=True)``, and fsync the parent of each folder it created.

    A file published into a new folder is durable only once the folder's own name is: its
    parent's fsync records it. Inside a ``deferred_dir_sync`` block that fsync joins the block's
    (a save's new step folder rides on the fsync of the root that the lease renewal needs anyway).
    """
    created = []
    probe = folder
    while not os.path.isdir(probe):
        created.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    os.makedirs(folder, exist_ok=True)
    for made in created:
        fsync_dir(os.path.dirname(made))


def write_temp(path: str, chunks: Iterable[memoryview], translate: Callable[[OSError], BaseException]) -> str:
    """Write ``chunks`` to a new temp file next to ``path``, flushed, fsynced, stamped; return its path.

    Our own ``OSError`` is raised as ``translate(exc)``; an exception of ``chunks`` (the caller's
    producer) propagates unchanged. Either way nothing is left behind.
    """
    try:
        fd, tmp = open_temp(path)
    except OSError as exc:
        raise translate(exc) from exc
    f = open(fd, "wb")
    try:
        for chunk in chunks:
            try:
                f.write(chunk)
            except OSError as exc:
                raise translate(exc) from exc
        try:
            f.flush()
            os.fsync(f.fileno())
            stamp(f.fileno())
            f.close()
        except OSError as exc:
            raise translate(exc) from exc
    except BaseException:
        # After a failed write (a full disk) the buffer still holds bytes: close() retries
        # the flush and raises ENOSPC again, raw. The descriptor is closed either way.
        try:
            f.close()
        except OSError:
            pass
        discard(tmp)
        raise
    return tmp


# The folders whose fsync a ``deferred_dir_sync`` block on this thread has put off (None: no block).
_deferred = threading.local()


@contextmanager
def deferred_dir_sync(*, sync: bool = True) -> Iterator[None]:
    """Put off this thread's folder fsyncs (``fsync_dir``) to the end of the block: one per folder.

    A folder fsync makes durable every name change in that folder made before it, so publishing
    two files into one folder needs one fsync of it after both renames, not one after each; and a
    new sub-folder's name is durable once its parent is fsynced after its creation. File contents
    are still fsynced before each rename (that ordering is what makes a rename atomic across a
    power cut). On leaving the block normally each folder is fsynced once (a folder since removed:
    its nearest existing parent, which holds the removal); with ``sync=False`` the caller declares
    that the block's name changes need no durability of their own (see the caller's reason), and
    they become durable with the next fsync of their folder, whoever makes it.

    Nested blocks belong to the outermost. Other threads are not affected. Only a power cut (or a
    kernel crash) can lose what a block put off: a killed process loses nothing, as the kernel's
    view of the folders is updated at once.
    """
    if getattr(_deferred, "folders", None) is not None:
        yield
        return
    folders: dict[str, None] = {}
    _deferred.folders = folders
    try:
        yield
    except BaseException:
        _deferred.folders = None
        if sync:
            try:
                _sync_all(folders)
            except OSError as exc:  # the block's own failure is what the caller must see
                logger.debug("folder fsync after a failed block: %s", exc)
        raise
    _deferred.folders = None
    if sync:
        _sync_all(folders)


def _sync_all(folders: Iterable[str]) -> None:
    for folder in sorted(folders, key=lambda f: (-f.count(os.sep), f)):  # deepest first
        while True:
            try:
                _fsync_dir_now(folder)
                break
            except FileNotFoundError:  # pruned since: its parent holds the removal
                parent = os.path.dirname(folder)
                if parent == folder:
                    break
                folder = parent


def fsync_dir(folder: str) -> None:
    """fsync a folder: makes a rename in it durable (without it a power cut can forget the name).

    Inside a ``deferred_dir_sync`` block of this thread the fsync happens at the block's end.
    """
    pending = getattr(_deferred, "folders", None)
    if pending is not None:
        pending[folder] = None
        return
    _fsync_dir_now(folder)


def _fsync_dir_now(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in NO_DIR_FSYNC_ERRNOS:
            raise
    finally:
        os.close(fd)


def stamp(fd: int) -> None:
    """Give the open file a process-unique mtime, so its version token is new.

    The version token is (inode, size, mtime). A freed inode can be reused by the next write of
    the same size within one coarse kernel tick (ext4 stamps mtime per jiffy), which would repeat
    a token; a process-unique ns timestamp makes every publish's token new.
    """
    t = unique_ns()
    try:
        os.utime(fd, ns=(t, t))
    except OSError as exc:  # a filesystem that refuses utime still publishes correctly
        logger.debug("could not stamp mtime of fd %d: %s", fd, exc)


def flock(fd: int, timeout: float) -> bool:
    """Take an exclusive flock on ``fd``, waiting at most ``timeout`` seconds.

    Returns True once held, False when the wait timed out (a stuck holder: never hangs). Any
    other ``OSError`` (no flock on this filesystem: ``NO_FLOCK_ERRNOS``) propagates.
    """
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def scan(root: str, folder: str, descend: Callable[[str], bool]) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Yield ``(key, entry)`` for every non-folder under ``folder`` (a key, "" for ``root``).

    Symlinked folders are not followed (no cycles); ``descend(folder_key)`` prunes the walk. A
    missing sub-folder yields nothing; a missing ``root`` raises (the caller decides what it means).
    """
    path = os.path.join(root, *folder.split("/")) if folder else root
    try:
        entries = list(os.scandir(path))
    except NOT_THERE:
        if not folder:
            raise
        return
    # Depth first, in scandir order, with a stack rather than a generator per folder: a root of
    # 1,000 checkpoints is 1,000 folders, and resuming nested generators was a tenth of its listing.
    stack = [(folder, iter(entries))]
    while stack:
        parent, rest = stack[-1]
        for entry in rest:
            key = f"{parent}/{entry.name}" if parent else entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not is_dir:
                yield key, entry
            elif descend(key):
                try:
                    inner = list(os.scandir(entry.path))
                except NOT_THERE:  # removed while we walked
                    continue
                stack.append((key, iter(inner)))
                break
        else:
            stack.pop()


def regular_stat(entry: os.DirEntry[str]) -> os.stat_result | None:
    """The stat of a listed entry that is a regular file (links followed), else None."""
    try:
        st = entry.stat()
    except OSError as exc:
        # Deleted while we listed, or a link that leads nowhere (dangling, a loop): not an
        # object, like a FIFO or a folder. One bad entry must not fail the listing of a root.
        if exc.errno not in NOT_AN_OBJECT_ERRNOS:
            raise
        logger.debug("not listing %s: %s", entry.path, exc)
        return None
    return st if stat_mod.S_ISREG(st.st_mode) else None


def top_folders(root: str, prefix: str) -> list[str]:
    """The folders directly in ``root`` whose names start with ``prefix``, sorted; one read of
    ``root``. Not named: symlinked folders (``scan`` does not follow them) and reserved names. A
    missing ``root`` raises (the caller decides what it means)."""
    names: list[str] = []
    with os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(prefix) or entry.name.startswith(RESERVED_PREFIX):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    names.append(entry.name)
            except FileNotFoundError:  # removed while we read
                continue
    return sorted(names)


def prune(root: str, folder: str) -> None:
    """Remove ``folder`` and its parents while they are empty, never ``root`` itself."""
    while folder != root and folder.startswith(root + os.sep):
        try:
            os.rmdir(folder)
        except OSError:  # not empty (or a writer just put a temp file in it): stop here
            return
        folder = os.path.dirname(folder)


def discard(tmp: str) -> None:
    """Remove a temp file if it is there; a failure is logged (the original error matters more)."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as exc:  # sweep() will get this one
        logger.warning("could not remove temp file %s: %s (sweep() will)", tmp, exc)
