"""Where the porting doors may write: never inside a checkpoint root, never over a file unasked.

``ckptsdk export`` writes one local file and ``ckptsdk import`` creates one root; a slip of the
hand (``export ROOT ROOT/step-…/tensors.safetensors``) must not destroy a committed checkpoint.
This module holds the rule for "inside a root" (local paths and every backend URL) and the
no-clobber publish of a finished temp file. What is exported or imported is not its business.
"""

from __future__ import annotations

import logging
import os

from ckptsdk.errors import BackendError, ConfigError
from ckptsdk.format.layout import CKPT_PREFIX, LINEAGE_PREFIX, folder_rank
from ckptsdk.lease.record import LEASE_KEY
from ckptsdk.runlog.record import RUNLOG_PREFIX

logger = logging.getLogger(__name__)

__all__ = ["check_new_root_url", "check_output_path", "enclosing_root", "publish"]

_ROOT_PARTS = (LINEAGE_PREFIX.rstrip("/"), RUNLOG_PREFIX.rstrip("/"))


def _looks_like_root(entries: set[str]) -> bool:
    """A folder whose names are a checkpoint root's: its lease, or a committed-looking step folder."""
    return LEASE_KEY in entries or any(
        folder_rank(name) is not None for name in entries if name.startswith(CKPT_PREFIX)
    )


def enclosing_root(path: str | os.PathLike[str]) -> str | None:
    """The checkpoint root (a local folder) that ``path`` lies in or is, else None.

    A folder is a root when it holds ``LEASE.json`` or a ``step-…`` checkpoint folder; a path
    through a folder named like a checkpoint folder (``step-0000000005.e1``), ``lineage`` or
    ``runlog`` next to a lease is inside one too. Symlinks are resolved first, so a link into a
    root counts as the root.
    """
    real = os.path.realpath(os.fspath(path))
    at = real if os.path.isdir(real) else os.path.dirname(real)
    while True:
        try:
            names = set(os.listdir(at))
        except OSError:
            names = set()
        if _looks_like_root(names):
            return at
        if folder_rank(os.path.basename(at)) is not None:
            return os.path.dirname(at)  # a checkpoint folder is inside its root, lease or not
        parent = os.path.dirname(at)
        if parent == at:
            return None
        if os.path.basename(at) in _ROOT_PARTS and os.path.exists(os.path.join(parent, LEASE_KEY)):
            return parent
        at = parent


def check_output_path(out: str | os.PathLike[str], *, force: bool) -> str:
    """Refuse an output file ckptsdk must not write; return it as a plain path.

    Args:
        out: the file to write.
        force: replace an existing (ordinary) file there.

    Raises:
        ConfigError: ``out`` is inside a checkpoint root, is a folder, its folder is missing,
            or it exists and ``force`` is false. Nothing was written.
    """
    out = os.fspath(out)
    root = enclosing_root(out)
    if root is not None:
        raise ConfigError(
            f"refusing to write {out}: it is inside the checkpoint root {root}, where it could replace or "
            "be mistaken for a committed checkpoint's files. Write it outside every checkpoint root"
        )
    if os.path.isdir(out):
        raise ConfigError(f"{out} is a folder; name the file to write, e.g. {os.path.join(out, 'model.safetensors')}")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write {out}: the folder {folder} does not exist; create it first")
    if os.path.lexists(out) and not force:
        raise ConfigError(f"{out} already exists; pass --force (force=True) to replace it, or choose another name")
    return out


def publish(tmp: str, out: str, *, force: bool) -> None:
    """Move the finished ``tmp`` to ``out`` in one step; without ``force`` never over a file.

    Without ``force`` a hard link is the atomic create-if-absent (a file that appeared since
    :func:`check_output_path` is kept, not replaced); a filesystem without hard links (some FUSE
    mounts) gets a checked rename, which a concurrent writer could still race.

    Raises:
        ConfigError: ``out`` exists and ``force`` is false.
        BackendError: the rename or link failed for another reason.
    """
    try:
        if force:
            os.replace(tmp, out)
            return
        try:
            os.link(tmp, out)
        except FileExistsError:
            raise
        except OSError as exc:
            logger.debug("no hard link for %s (%s); a checked rename instead", out, exc)
            if os.path.lexists(out):
                raise FileExistsError(out) from exc
            os.replace(tmp, out)
            return
        os.unlink(tmp)
    except FileExistsError as exc:
        raise ConfigError(
            f"{out} appeared while it was being written; it was kept. Pass --force to replace it"
        ) from exc
    except OSError as exc:
        raise BackendError(f"could not move the finished {tmp} to {out}: {exc}; check the folder") from exc


def check_new_root_url(url: str, storage_options: dict[str, object] | None = None) -> None:
    """Refuse a destination URL that lies inside another checkpoint root (any backend).

    A local or Drive URL is checked by :func:`enclosing_root` (the URL may itself be a root: the
    caller refuses one that holds checkpoints); a bucket URL (``gs://B/a/b``) by looking for a
    lease in each enclosing prefix and for checkpoint-folder names on the way. ``memory://``
    names are flat (no nesting) and are not checked.

    Raises:
        ConfigError: the URL is inside a checkpoint root.
    """
    from ckptsdk.backends import drive_root, open_backend

    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower() if sep else "file"
    if scheme == "memory":
        return

    def refuse(root: str) -> ConfigError:
        return ConfigError(
            f"refusing to import into {url}: it is inside the checkpoint root {root}; import into a new root "
            "outside every other one"
        )

    if scheme in ("file", "drive"):
        path = (rest if sep else url) if scheme == "file" else os.path.join(drive_root(), rest.strip("/"))
        root = enclosing_root(path)
        if root is not None and root != os.path.realpath(path):
            raise refuse(root)
        return
    parts = [p for p in rest.strip("/").split("/") if p]
    for i in range(len(parts) - 1, 0, -1):  # gs://B/a/b: look in gs://B/a, then gs://B
        parent_url = f"{scheme}://{'/'.join(parts[:i])}"
        if folder_rank(parts[i]) is not None or parts[i] in _ROOT_PARTS:
            raise refuse(parent_url)
        try:
            leased = open_backend(parent_url, **(storage_options or {})).exists(LEASE_KEY)
        except BackendError as exc:  # an unreadable prefix is no root we could damage
            logger.debug("cannot look for a lease at %s: %s", parent_url, exc)
            leased = False
        if leased:
            raise refuse(parent_url)
