"""The storage contract every backend meets, and the small records it returns.

Object-store shaped (GCS is the strictest store we target): flat ``/``-separated keys under a
root, whole-object atomic publish, optional conditional writes. Nothing here knows about
checkpoints, leases or manifests; implementations live in sibling modules.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol, TypeAlias, runtime_checkable

from ckptsdk.errors import InvalidKey

# What ``write``/``create``/``replace`` accept: one bytes-like object, or an iterable of them
# streamed in order (lets a checkpoint go from tensor memory to storage without a joined copy).
Data: TypeAlias = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


@dataclass(frozen=True)
class Capabilities:
    """Which guarantees a backend really has; upper layers pick their strategy from these.

    Attributes:
        exclusive_create: ``create`` excludes every other writer, on every host.
        compare_and_swap: ``replace(key, data, version)`` is atomic against every other writer.
        atomic_publish: a reader sees the old object or the new one, never a part (all backends).
        durable_on_return: once ``write`` returns, the bytes survive a crash of this machine.
            A statement for callers and tests: no ckptsdk code branches on it (on Drive, where it
            is False, the upper layers adapt to ``immediately_consistent`` instead; see
            docs/DRIVE.md).
        immediately_consistent: another host sees a write (and a delete) as soon as it returns.
            False on the Drive mount, where other VMs see changes minutes late and out of order.
        trash_on_delete: deletes keep costing quota for a while (Drive's 30-day trash).
        rewrite_in_place: the backend has ``move(src, dst)`` and ``overwrite(key, data)``, which
            keep a stored file (and its identity in the store) instead of making a new one: how
            a retention ring reuses space without sending anything to a trash (Drive only).
        cheap_copy: the backend has ``copy(src, dst)``, which duplicates an object inside the
            store without sending its bytes through this machine (a hard link on local disk, a
            server-side rewrite on GCS). False on the Drive mount: neither exists there.
        remote_conditions: the conditional writes are evaluated by a server this code does not
            control (GCS, S3 and S3-compatibles), so a writer proves them at open
            (``ckptsdk/backends/probe.py``) instead of trusting them: an emulator or an
            S3-compatible store may answer 200 and overwrite.
    """

    exclusive_create: bool
    compare_and_swap: bool
    atomic_publish: bool = True
    durable_on_return: bool = True
    immediately_consistent: bool = True
    trash_on_delete: bool = False
    cheap_copy: bool = False
    rewrite_in_place: bool = False
    remote_conditions: bool = False


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key (relative to the root), size in bytes, and version token.

    ``version`` is opaque: equal tokens mean the same write. GCS: the generation. Local disk: the
    inode, size and mtime of the published file (a new file is published at every write).

    ``mtime`` is the time the *store* reports for the object's last write, in POSIX seconds
    (local disk and the Drive mount: the file's mtime; GCS: the object's ``updated``; memory: the
    process clock at the write), or None where the store reports none. It is what the age of a
    crashed writer's leftovers is judged by: compare it with another object's ``mtime`` from the
    same store, not with this machine's clock (another VM's clock may drift). Not part of
    equality: the version alone identifies a write.
    """

    key: str
    size: int
    version: str
    mtime: float | None = field(default=None, compare=False)


@runtime_checkable
class Backend(Protocol):
    """A flat key-value store under one root URL. Keys are relative, ``/``-separated.

    Every method raises :class:`~ckptsdk.errors.InvalidKey` for a key that could escape the root,
    :class:`~ckptsdk.errors.ObjectNotFound` (also a ``FileNotFoundError``) for a missing key where
    the object is required, and :class:`~ckptsdk.errors.StorageUnavailable` when the store itself
    is gone (bucket missing, mount dropped). Any other storage failure is a ``BackendError``
    chained (``from``) to the original exception.
    """

    url: str
    capabilities: Capabilities

    def read(self, key: str) -> bytes:
        """Return the whole object.

        Hint: local ``open(path, 'rb').read()``; GCS ``fs.cat_file``. Map "not found" to
        ``ObjectNotFound``; never return partial content.
        """
        ...

    def open(self, key: str) -> BinaryIO:
        """Open the object for streaming reads (``read``, ``readinto``, ``seek``); caller closes.

        Hint: large objects (checkpoints, datasets) are read in 8 MiB chunks through this; GCS
        should use a large block size so each chunk is one ranged GET.
        """
        ...

    def write(self, key: str, data: Data) -> ObjectInfo:
        """Atomically publish ``data`` at ``key``, replacing any previous object.

        Hint: local/Drive write a temp file *in the same folder* (so the rename cannot cross a
        filesystem), flush + fsync it, ``os.replace`` it over the key, fsync the folder. GCS: one
        upload, which GCS itself makes atomic. A crash at any moment leaves the old object or the
        new one, plus at worst a temp file that ``list`` ignores and ``sweep`` removes.

        An iterable ``data`` is consumed completely, in order, *before* the bytes are made
        durable (fsync, upload finalisation): the tensor-file writer relies on this to compute
        its digest while the fsync runs, from code placed after its last ``yield``.
        """
        ...

    def create(self, key: str, data: Data) -> ObjectInfo:
        """Publish ``data`` only if ``key`` does not exist; else raise ``PreconditionFailed``.

        Hint: GCS ``ifGenerationMatch=0``. Local: write a temp file, then ``os.link`` it to the
        key (link fails if the key exists, and the key is never seen half-written). Backends
        without cross-host exclusion (Drive) still do this, but say so in ``capabilities``.
        """
        ...

    def replace(self, key: str, data: Data, version: str) -> ObjectInfo:
        """Publish ``data`` only if the current object's version is ``version``.

        Raises ``PreconditionFailed`` (with ``expected``/``actual``) when it moved on or vanished.
        Hint: GCS ``ifGenerationMatch=<generation>``. Local: under an exclusive lock, compare the
        version, then ``os.replace``.
        """
        ...

    def stat(self, key: str) -> ObjectInfo:
        """Return the object's size, version and store time, or raise ``ObjectNotFound``.

        Hint: local ``os.stat`` (``st_mtime``); GCS the object resource's ``updated``.
        """
        ...

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists now (as this host sees it)."""
        ...

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:  # `list`: this method, in the class
        """Every object whose key starts with ``prefix`` (recursively), sorted by key.

        Hint: temp files of in-flight or crashed writes are never listed; a missing root lists
        as empty.
        """
        ...

    def delete(self, key: str, *, version: str | None = None) -> None:
        """Delete ``key``; with ``version``, only if that is still its version.

        Raises ``ObjectNotFound`` if absent, ``PreconditionFailed`` if the version moved on.
        """
        ...

    def sweep(
        self, older_than: float, *, only: Callable[[str], bool] | None = None
    ) -> builtins.list[str]:  # `list`: the method above
        """Remove leftovers of crashed writes (temp files) older than ``older_than`` seconds.

        ``only(key)``, given, limits the sweep to temp files of the objects it accepts (``key`` is
        the object the temp file was going to publish). Returns what was removed. Stores
        without temp files (GCS, memory) return ``[]``.
        """
        ...


# Optional operations: sub-protocols a backend may also meet. Upper layers reach them only
# through ``copier``/``rewriter``, which ask ``Capabilities`` first (a method can exist and still be
# unusable on this store, as Drive's ``copy`` is), so no caller needs ``getattr``.


class Writable(Protocol):
    """The one operation a streamed file write needs: ``write`` (atomic or not, as the store
    offers), and ``url`` for its messages. A :class:`Backend` is one; so are the save pipeline's
    wrappers that pace a background write or rewrite a recycled file in place."""

    url: str

    def write(self, key: str, data: Data) -> ObjectInfo:
        """Publish ``data`` at ``key``; see :meth:`Backend.write`."""
        ...


@runtime_checkable
class Copyable(Protocol):
    """A store that duplicates an object without sending its bytes through this machine."""

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Publish at ``dst`` (which must not exist) the object at ``src``, inside the store.

        Raises ``ObjectNotFound`` if ``src`` is absent, ``PreconditionFailed`` if ``dst`` exists.
        Hint: local ``os.link`` (files are never rewritten in place, so sharing an inode is
        safe); GCS ``rewriteTo`` with ``ifGenerationMatch=0``.
        """
        ...


@runtime_checkable
class Rewritable(Protocol):
    """A store that keeps a file's identity across a rename and a rewrite (Drive: no trash)."""

    def move(self, src: str, dst: str) -> ObjectInfo:
        """Rename ``src`` to ``dst`` (which must not exist), keeping the stored file itself."""
        ...

    def overwrite(self, key: str, data: Data) -> ObjectInfo:
        """Rewrite the existing file at ``key`` in place. **Not atomic**: only for a file no
        committed manifest refers to."""
        ...


@runtime_checkable
class Browsable(Protocol):
    """A store that names its top-level folders in one cheap call, without listing their files.

    A root of 1,000 checkpoints is 1,000 folders: a writer's open and a restore need their names
    (who writes the root, which is newest) and the files of one or two, so naming them costs a
    read of the root's directory where a full listing walks every folder.
    """

    def list_folders(self, prefix: str) -> builtins.list[str]:
        """The names of the folders at the top of the root whose names start with ``prefix``
        (which holds no ``/``), sorted.

        Hint: a folder may be named while it holds no object yet or no longer (a write in
        progress, a delete under way); ``list(name + "/")`` is then empty. Names starting with
        ``.ckptsdk-`` (temp and lock files) are never folders of objects.
        """
        ...


@runtime_checkable
class Batching(Protocol):
    """A store whose durability work can be gathered over several writes (local disk, Drive: one
    folder fsync per folder at the end of a block instead of one per rename)."""

    def durability(self, *, sync: bool = True) -> AbstractContextManager[None]:
        """A block whose writes on this thread share their durability work, done at its end.

        ``sync=False``: the block's name changes need no durability of their own (the caller
        says why); they become durable with the next such work on their folder.
        Hint: local/Drive put off ``fsync`` of folders (``posix.deferred_dir_sync``); object
        stores have nothing to gather and need not offer this.
        """
        ...


def durable_batch(backend: object, *, sync: bool = True) -> AbstractContextManager[None]:
    """``backend``'s :meth:`Batching.durability` block where it offers one, else a block that does
    nothing: the upper layers gather durability work without knowing which store they write."""
    if isinstance(backend, Batching):
        return backend.durability(sync=sync)
    return nullcontext()


def browser(backend: Backend) -> Browsable | None:
    """``backend`` as a :class:`Browsable` where it is one, else None (list everything instead)."""
    return backend if isinstance(backend, Browsable) else None


def copier(backend: Backend) -> Copyable | None:
    """``backend`` as a :class:`Copyable` where ``capabilities.cheap_copy`` says it is one, else None."""
    if backend.capabilities.cheap_copy and isinstance(backend, Copyable):
        return backend
    return None


def rewriter(backend: Backend) -> Rewritable | None:
    """``backend`` as a :class:`Rewritable` where ``capabilities.rewrite_in_place`` says so, else None."""
    if backend.capabilities.rewrite_in_place and isinstance(backend, Rewritable):
        return backend
    return None


def check_key(key: str, *, url: str = "", allow_empty: bool = False) -> str:
    """Return ``key`` if it is a safe relative key, else raise ``InvalidKey``.

    Args:
        key: the key to check.
        url: the backend root, for the error message.
        allow_empty: accept ``""`` (a list prefix meaning "everything").
    """
    if not isinstance(key, str):
        raise InvalidKey(f"key must be a str, got {type(key).__name__}", url=url, key=str(key))
    if key == "" and allow_empty:
        return key
    bad = (
        key == ""
        or key.startswith("/")
        or "\\" in key
        or "\x00" in key
        or any(part in ("", ".", "..") for part in key.split("/"))
    )
    if bad:
        raise InvalidKey(
            f"invalid key {key!r} under {url or 'the backend root'}: keys are relative, "
            "'/'-separated, with no empty, '.' or '..' components and no backslashes",
            url=url,
            key=key,
        )
    return key


def check_prefix(prefix: str, *, url: str = "") -> str:
    """Validate a list prefix: ``""`` or a key, optionally ending in ``/``."""
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix, url=url)
    return prefix


def check_folder_prefix(prefix: str, *, url: str = "") -> str:
    """A prefix of top-level folder names (:meth:`Browsable.list_folders`): a list prefix without ``/``."""
    check_prefix(prefix, url=url)
    if "/" in prefix:
        raise InvalidKey(f"list_folders({prefix!r}) under {url}: a prefix of top-level folder names has no '/'")
    return prefix


def iter_chunks(data: Data) -> Iterable[memoryview]:
    """Yield ``data`` as byte memoryviews, whether it is one buffer or an iterable of them."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        yield memoryview(data).cast("B")
        return
    for chunk in data:
        yield memoryview(chunk).cast("B")
