"""Extract a tar archive without letting any member escape the target folder.

Every member is checked before it is written (no absolute paths, no ``..``, no links that point
outside, no devices or FIFOs) into a staging folder, Python's ``tarfile`` ``data`` filter checks
again, and only a fully accepted archive is moved into place. Nothing here parses the extracted files.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import tarfile
import tempfile
import time

from ckptsdk.errors import UnsafeArchiveError

logger = logging.getLogger(__name__)

__all__ = ["check_members", "safe_extract"]

# tarfile's extraction filters came in Python 3.10.12 / 3.11.4 / 3.12; Debian 12's 3.11.2 lacks
# them. There ``_check_member`` is the whole check, and attributes (owner, mode) are not applied.
_HAS_FILTER = hasattr(tarfile, "data_filter")
_FILTER_ERRORS: tuple[type[BaseException], ...] = (tarfile.FilterError,) if _HAS_FILTER else ()


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root


def _check_member(m: tarfile.TarInfo, root: str, target: str) -> None:
    name = m.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchiveError(f"archive member {name!r} has an absolute path; refusing to extract", member=name)
    # realpath follows links already on disk, so a file placed "through" an earlier symlink is caught too.
    dest = os.path.realpath(os.path.join(root, name))
    if not _inside(root, dest):
        raise UnsafeArchiveError(
            f"archive member {name!r} would be written outside {target!r}; refusing to extract", member=name
        )
    if m.issym() or m.islnk():
        kind = "symlink" if m.issym() else "hard link"
        # A symlink's target is relative to the folder holding the link; a hard link's to the root.
        base = os.path.join(root, posixpath.dirname(name)) if m.issym() else root
        link_dest = os.path.realpath(os.path.join(base, m.linkname))
        if os.path.isabs(m.linkname) or not _inside(root, link_dest):
            raise UnsafeArchiveError(
                f"archive member {name!r} is a {kind} to {m.linkname!r}, outside {target!r}; refusing to extract",
                member=name,
            )
    elif not (m.isfile() or m.isdir()):
        raise UnsafeArchiveError(
            f"archive member {name!r} is a device or FIFO; data archives hold only files and folders",
            member=name,
        )


def check_members(tar: tarfile.TarFile, target: str) -> list[tarfile.TarInfo]:
    """Return the members of ``tar`` if all of them stay inside ``target``, else raise.

    Args:
        tar: an open (seekable) archive.
        target: the folder it would be extracted into.

    Raises:
        UnsafeArchiveError: a member is absolute, climbs out with ``..``, is a symlink or hard
            link whose target resolves outside ``target``, or is a device/FIFO.
    """
    root = os.path.realpath(target)
    members = tar.getmembers()
    for m in members:
        _check_member(m, root, target)
    return members


def safe_extract(archive: str, target: str) -> list[str]:
    """Extract ``archive`` (any compression tarfile reads) into ``target``.

    One streaming pass (a .tar.gz is decompressed once) into a staging folder inside ``target``;
    each member is checked before it is written, and Python's ``data`` filter checks it again
    (where this Python has it).
    Only when every member passed are the staged entries moved into ``target`` (replacing
    entries of the same name); on any refusal the staging folder is deleted.

    Args:
        archive: path of the tar file.
        target: destination folder, created if missing.

    Returns:
        The member names extracted, in archive order.

    Raises:
        UnsafeArchiveError: a member would land outside ``target`` or link out of it; nothing
            is left behind in ``target`` then.
        tarfile.TarError: the file is not a readable tar archive.

    Example:
        >>> safe_extract("cifar-10-python.tar.gz", "/content/data")  # doctest: +SKIP
        ['cifar-10-batches-py', 'cifar-10-batches-py/data_batch_4', ...]
    """
    start = time.monotonic()
    os.makedirs(target, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".ckptsdk-tmp.extract.", dir=target)
    names: list[str] = []
    try:
        root = os.path.realpath(stage)
        with tarfile.open(archive, mode="r|*") as tar:
            for m in tar:
                _check_member(m, root, target)
                try:
                    if _HAS_FILTER:
                        tar.extract(m, stage, filter="data")
                    else:  # pragma: no cover - Pythons before the filters (see _HAS_FILTER)
                        tar.extract(m, stage, set_attrs=False)
                except _FILTER_ERRORS as exc:
                    raise UnsafeArchiveError(
                        f"archive {archive!r} member {m.name!r} refused by tarfile's data filter: {exc}",
                        member=m.name,
                    ) from exc
                names.append(m.name)
        for entry in os.listdir(stage):
            dest = os.path.join(target, entry)
            if os.path.isdir(dest) and not os.path.islink(dest):
                shutil.rmtree(dest)
            os.replace(os.path.join(stage, entry), dest)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    size = os.path.getsize(archive)
    logger.info(
        "extracted %s (%d members, %d bytes) into %s in %.2f s",
        archive,
        len(names),
        size,
        target,
        time.monotonic() - start,
    )
    return names
