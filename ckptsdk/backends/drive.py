"""Google Drive backend: the Colab Drive mount (``drive://REL``), through the local-disk code.

What the mount does, with sources, is in ``docs/DRIVE.md`` ("The mount: facts the code relies
on"); nothing of it is documented by Google. In short:

- Writes land in a local write-back cache and upload later, in any order; a file closed (even
  fsynced) without error can still be lost with the VM, and over quota nothing uploads at all.
  ``durable_on_return`` is False to say so; no code reads it: ckptsdk does not wait for uploads.
  A checkpoint is committed once its manifest is published as this VM sees it; what protects a
  run is rotation running one save late (``immediately_consistent`` is False) and the digest
  checks on load. ``drive.flush_and_unmount()`` is how a user makes sure the newest has arrived.
- Another VM sees changes minutes late and out of order, so ``immediately_consistent`` is False:
  readers verify every file's size and digest instead of trusting a manifest's order.
- ``os.replace`` works on the writing VM, ``os.link`` fails (Errno 38), and ``flock``/``O_EXCL``
  hold at best on this VM: Drive allows two files of one name. ``create`` therefore checks and
  renames under the root flock (excluding writers on *this VM only*; if the mount refuses flock,
  only this process's threads), and ``exclusive_create`` / ``compare_and_swap`` are False: the
  lease falls back to write, settle, read back.
- Deletes go to the Drive trash, which counts against the quota for 30 days
  (``trash_on_delete``): retention must account for it.
- A dropped mount raises Errno 107 ("Transport endpoint is not connected"); huge folders or a full
  Drive raise Errno 5. Both become ``StorageUnavailable`` with a message that says to remount.
"""

from __future__ import annotations

import logging
import os

from ckptsdk.backends.base import Capabilities, Data, ObjectInfo, iter_chunks
from ckptsdk.backends.local import LocalBackend
from ckptsdk.backends.posix import fsync_dir, make_folders, prune, stamp, version_of
from ckptsdk.errors import BackendError, StorageUnavailable

logger = logging.getLogger(__name__)

# Colab mounts Drive here; "My Drive" and shared drives live below it.
COLAB_MOUNT_POINT = "/content/drive"


class DriveBackend(LocalBackend):
    """Objects as files on the Drive mount, published like :class:`LocalBackend` but honest about
    what the mount cannot promise (see the module docstring).

    Args:
        root: the folder on the mount (``open_backend("drive://REL")`` makes it
            ``$CKPTSDK_DRIVE_ROOT/REL``, default ``/content/drive/MyDrive/REL``).
        url: the URL it was opened with (for messages); defaults to ``root``.

    Raises:
        StorageUnavailable: Drive is not mounted (the mount folder is missing), the mount dropped,
            or ``root`` is a file.

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> b = open_backend("drive://runs/cifar")  # doctest: +SKIP
        >>> DriveBackend.capabilities.trash_on_delete, DriveBackend.capabilities.exclusive_create
        (True, False)
    """

    capabilities = Capabilities(
        exclusive_create=False,
        compare_and_swap=False,
        durable_on_return=False,
        immediately_consistent=False,
        trash_on_delete=True,
        cheap_copy=False,  # os.link fails on the mount (Errno 38); Drive's server copy is not reachable
        rewrite_in_place=True,  # move() and overwrite(): reuse a file instead of trashing it
    )
    # DriveFS documents nothing about flock; if the mount refuses it, writes must still work
    # (capabilities promise no exclusion anyway), so fall back to excluding this process's threads.
    _flock_optional = True
    _unavailable_hint = (
        "the Google Drive mount dropped or is unhealthy (Errno 107 means it is gone; Errno 5 can "
        "mean a folder with too many items or a full Drive). In Colab run "
        "`from google.colab import drive; drive.mount('/content/drive', force_remount=True)` and "
        "retry; writes not yet uploaded before the drop may be lost"
    )

    def __init__(self, root: str, *, url: str | None = None) -> None:
        super().__init__(root, url=url)
        mount = _mount_point(self.root)
        if not os.path.isdir(mount):
            raise StorageUnavailable(
                f"Google Drive is not mounted: {mount} (for {self.url}) is not a folder. In Colab "
                "run `from google.colab import drive; drive.mount('/content/drive')`; elsewhere "
                "set CKPTSDK_DRIVE_ROOT to the mounted folder",
                url=self.url,
            )

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Not on the mount: no hard links (Errno 38), and Drive's server-side copy is an API call
        the mount does not offer. Callers check ``capabilities.cheap_copy`` first."""
        raise BackendError(
            f"copy of {src!r} to {dst!r} under {self.url}: the Drive mount has no cheap copy "
            "(capabilities.cheap_copy is False); read and write the bytes instead",
            url=self.url,
            key=dst,
        )

    def move(self, src: str, dst: str) -> ObjectInfo:
        """Rename the file at ``src`` to ``dst`` (which must not exist), keeping the file itself.

        On the mount a rename changes the file's name and folder; no content is uploaded and
        nothing goes to the trash (what DriveFS sends upstream for it is not documented).

        Raises:
            ObjectNotFound: ``src`` does not exist.
            PreconditionFailed: ``dst`` exists already (as this VM sees it).
        """
        src_path, path = self._path(src), self._path(dst)
        self.stat(src)
        with self._locked("move", dst):
            with self._errors("move", dst, missing=True):
                try:
                    os.lstat(path)
                except FileNotFoundError:
                    pass
                else:
                    raise self._exists_error(dst, path)
                make_folders(os.path.dirname(path))
                os.rename(src_path, path)
                fsync_dir(os.path.dirname(path))
                fsync_dir(os.path.dirname(src_path))
                prune(self.root, os.path.dirname(src_path))
                st = os.stat(path)
        return ObjectInfo(dst, st.st_size, version_of(st), st.st_mtime_ns / 1e9)

    def overwrite(self, key: str, data: Data) -> ObjectInfo:
        """Rewrite the existing file at ``key`` in place (truncated to the new length), fsynced.

        **Not atomic**: a reader can see a mix of old and new bytes. Only for a file no committed
        manifest refers to (its checkpoint's manifest was deleted first): a reader that still
        holds the old manifest fails its digest check instead of loading a mix. On Drive this
        should become a new revision of the same file instead of a new file plus a trashed one.

        Raises:
            ObjectNotFound: ``key`` does not exist.
        """
        path = self._path(key)
        self.stat(key)
        with self._errors("overwrite", key, missing=True):
            with open(path, "r+b") as f:
                for chunk in iter_chunks(data):
                    try:
                        f.write(chunk)
                    except OSError as exc:
                        raise self._translate(exc, "overwrite", key) from exc
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
                stamp(f.fileno())
                st = os.fstat(f.fileno())
        return ObjectInfo(key, st.st_size, version_of(st), st.st_mtime_ns / 1e9)

    def _commit_create(self, path: str, tmp: str) -> None:
        # The mount refuses link() (Errno 38). Under the root flock, which every publish of this
        # backend takes, check-then-rename excludes writers on this VM; another VM is not
        # excluded (Drive keeps both files as "name" and "name (1)"), as capabilities say.
        try:
            os.lstat(path)  # not lexists(): that would read a dropped mount (Errno 107) as "absent"
        except FileNotFoundError:
            os.replace(tmp, path)
            return
        raise self._exists_error(self._key_of(path), path)


def _mount_point(root: str) -> str:
    """The folder whose absence means "Drive is not mounted" for ``root``."""
    from ckptsdk.backends import drive_root  # the registry owns $CKPTSDK_DRIVE_ROOT's meaning

    configured = os.path.abspath(drive_root())
    if root == configured or root.startswith(configured.rstrip(os.sep) + os.sep):
        return configured
    return COLAB_MOUNT_POINT
