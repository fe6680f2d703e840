"""Extract a tar archive without letting any member escape the target folder.

Every member is checked before anything is written (no absolute paths, no ``..``, no links that
point outside, no devices or FIFOs), then Python's ``tarfile`` ``data`` filter extracts as a
second line of defence. Nothing here parses the extracted files.
"""

from __future__ import annotations

import logging
import os
import posixpath
import tarfile
import time

from .errors import UnsafeArchiveError

logger = logging.getLogger(__name__)

__all__ = ["check_members", "safe_extract"]


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root


def check_members(tar: tarfile.TarFile, target: str) -> list[tarfile.TarInfo]:
    """Return the members of ``tar`` if all of them stay inside ``target``, else raise.

    Args:
        tar: an open archive.
        target: the folder it would be extracted into.

    Raises:
        UnsafeArchiveError: a member is absolute, climbs out with ``..``, is a symlink or hard
            link whose target resolves outside ``target``, or is a device/FIFO.
    """
    root = os.path.realpath(target)
    members = tar.getmembers()
    for m in members:
        name = m.name
        if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
            raise UnsafeArchiveError(f"archive member {name!r} has an absolute path; refusing to extract", member=name)
        dest = os.path.realpath(os.path.join(root, name))
        if not _inside(root, dest):
            raise UnsafeArchiveError(
                f"archive member {name!r} would be written outside {target!r}; refusing to extract", member=name
            )
        if m.issym():
            # A symlink's target is relative to the folder holding the link.
            link_dest = os.path.realpath(os.path.join(root, posixpath.dirname(name), m.linkname))
            if os.path.isabs(m.linkname) or not _inside(root, link_dest):
                raise UnsafeArchiveError(
                    f"archive member {name!r} is a symlink to {m.linkname!r}, outside {target!r}; "
                    "refusing to extract",
                    member=name,
                )
        elif m.islnk():
            link_dest = os.path.realpath(os.path.join(root, m.linkname))
            if os.path.isabs(m.linkname) or not _inside(root, link_dest):
                raise UnsafeArchiveError(
                    f"archive member {name!r} is a hard link to {m.linkname!r}, outside {target!r}; "
                    "refusing to extract",
                    member=name,
                )
        elif not (m.isfile() or m.isdir()):
            raise UnsafeArchiveError(
                f"archive member {name!r} is a device or FIFO; data archives hold only files and folders",
                member=name,
            )
    return members


def safe_extract(archive: str, target: str) -> list[str]:
    """Extract ``archive`` (any compression tarfile reads) into ``target``.

    Args:
        archive: path of the tar file.
        target: destination folder, created if missing.

    Returns:
        The member names extracted, in archive order.

    Raises:
        UnsafeArchiveError: a member would land outside ``target`` or link out of it; nothing
            is extracted then (all members are checked first).
        tarfile.TarError: the file is not a readable tar archive.

    Example:
        >>> safe_extract("cifar-10-python.tar.gz", "/content/data")  # doctest: +SKIP
        ['cifar-10-batches-py', 'cifar-10-batches-py/data_batch_4', ...]
    """
    start = time.monotonic()
    os.makedirs(target, exist_ok=True)
    with tarfile.open(archive) as tar:
        members = check_members(tar, target)
        try:
            # The stdlib 'data' filter re-checks paths and links and strips modes/owners.
            tar.extractall(target, members=members, filter="data")
        except tarfile.FilterError as exc:
            info = getattr(exc, "tarinfo", None)
            raise UnsafeArchiveError(
                f"archive {archive!r} refused by tarfile's data filter: {exc}",
                member=info.name if info is not None else "",
            ) from exc
    size = os.path.getsize(archive)
    logger.info("extracted %s (%d members, %d bytes) into %s in %.2f s",
                archive, len(members), size, target, time.monotonic() - start)
    return [m.name for m in members]
