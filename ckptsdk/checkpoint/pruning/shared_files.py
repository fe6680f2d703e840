"""When a shared tensor file may go: no checkpoint left refers to it (rotation and gc).

Torch-free (``ckptsdk ls``/``gc`` never import torch). What goes into a shared file, and when a
save refers to one, is :mod:`ckptsdk.checkpoint.writing.sharing`'s; their names are
:mod:`ckptsdk.format.layout`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading.catalog import Catalog
from ckptsdk.errors import ObjectNotFound
from ckptsdk.format.layout import SHARED_PREFIX, Rank, outranks, shared_rank
from ckptsdk.format.manifest import Manifest

logger = logging.getLogger(__name__)

__all__ = ["loose_files", "referenced_files", "release"]


def referenced_files(manifests: Iterable[Manifest | None]) -> set[str]:
    """Every shared file some of ``manifests`` refers to (root-relative keys)."""
    return {f.name for m in manifests if m is not None for f in m.shared}


def loose_files(
    backend: Backend,
    cat: Catalog,
    gone: Iterable[str],
    *,
    rank: Rank | None,
    grace: float,
    exclusive: bool,
    listing: bool = True,
) -> dict[str, tuple[str, int]]:
    """Shared files that may go once the folders ``gone`` are deleted: key -> (why, bytes).

    A file goes when no manifest left in ``cat`` refers to it, never when a checkpoint of a newer
    major format (unreadable here) of a step at or above the file's may refer to it, and never when its writer
    outranks ``rank`` (``None``: gc, without the lease). Those only ``gone`` referred to go at
    once (the live writer refers only to what its newest commit does, which is never deleted).
    With ``listing`` (one listing of ``shared/``) so does any other unreferenced file (a killed
    save's, a zombie's), as a folder without a manifest does: the live writer's own of a step at
    or below its newest commit, a lower writer's when ``exclusive`` (compare-and-swap: it can
    never commit), else after ``grace`` seconds of silence by the store's clock.
    """
    gone = set(gone)
    left = referenced_files(c.manifest for c in cat.checkpoints if c.key not in gone)
    # A newer ckptsdk's manifest cannot be read here: any shared file written at or before its
    # step may be one it refers to, and stays (as far as this reader can tell).
    unknown = max((c.step for c in cat.checkpoints if c.newer and c.key not in gone), default=-1)
    was = {f.name: f.size for c in cat.checkpoints if c.key in gone and c.manifest for f in c.manifest.shared}
    out = {k: ("shared: no checkpoint kept refers to it any more", n) for k, n in was.items() if k not in left}
    if listing:
        top = cat.newest_step(rank)
        now = cat.store_now()
        for obj in backend.list(SHARED_PREFIX):
            named = shared_rank(obj.key)
            if named is None or obj.key in left or obj.key in out:
                continue
            age = None if now is None or obj.mtime is None else max(0.0, now - obj.mtime)
            if rank is not None and named[1] == rank and named[0] <= top:
                out[obj.key] = ("shared: this writer's failed save wrote it, nothing refers to it", obj.size)
            elif rank is not None and outranks(rank, named[1]) and exclusive:
                out[obj.key] = ("shared: a superseded writer's, nothing refers to it", obj.size)
            elif age is not None and age >= grace and (rank is None or outranks(rank, named[1])):
                out[obj.key] = (f"shared: nothing refers to it, silent for {age:.0f} s (grace {grace:.0f} s)", obj.size)

    def deletable(key: str) -> bool:  # never a higher writer's: the live writer refers only to its own
        named = shared_rank(key)
        return named is not None and named[0] > unknown and (rank is None or not outranks(named[1], rank))

    spared = [k for k in out if (named := shared_rank(k)) is not None and named[0] <= unknown]
    if spared:
        logger.warning(
            "keeping %d shared file(s) under %s that a checkpoint written by a newer ckptsdk (step %d) may "
            "refer to: this one cannot read its manifest; upgrade ckptsdk to clean them up",
            *(len(spared), backend.url, unknown),
        )
    return {k: v for k, v in out.items() if deletable(k)}


def release(
    backend: Backend,
    doomed: Mapping[str, tuple[str, int]],
    *,
    check: Callable[[], None],
    trashed: Callable[[int, int], None],
) -> set[str]:
    """Delete the shared files of :func:`loose_files` (``check()``: the lease, before each)."""
    out = set()
    for key, (why, size) in sorted(doomed.items()):
        check()
        try:
            backend.delete(key)
        except ObjectNotFound:
            continue  # another cleaner was first
        logger.info("removed %s/%s (%s, %d bytes)", backend.url, key, why, size)
        trashed(size, 1)
        out.add(key)
    return out
