"""Drive's recycle mode, the rewrite half: move a rotated-out tensor file and rewrite it in place.

Which checkpoint gives its file is rotation's (``Rotation.recycle_source``); this moves the file
into the new folder and hands ``write_tensorfile`` a backend that overwrites it there, and lets
the retire (the manifest's delete) run beside the listing that fences the save
(:func:`retire_while_listing`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ckptsdk.backends.base import Backend, Data, ObjectInfo, Rewritable, rewriter
from ckptsdk.backends.deadline import carried
from ckptsdk.errors import ObjectNotFound, PreconditionFailed

if TYPE_CHECKING:
    from ckptsdk.checkpoint.reading.catalog import CheckpointInfo

logger = logging.getLogger(__name__)

__all__ = ["InPlace", "retire_while_listing", "take_file"]


class InPlace:
    """The backend as ``write_tensorfile`` sees it when a recycled file is rewritten in place."""

    def __init__(self, backend: Rewritable, url: str) -> None:
        self._backend = backend
        self.url = url

    def write(self, key: str, data: Data) -> ObjectInfo:
        return self._backend.overwrite(key, data)


def take_file(backend: Backend, src: str, dst: str) -> InPlace | None:
    """Move ``src`` to ``dst`` for a rewrite in place: the store to rewrite it with (as
    ``write_tensorfile`` sees one), or None (write a new file) if it cannot."""
    rewriting = rewriter(backend)
    if rewriting is None:
        return None
    try:
        rewriting.move(src, dst)
    except (ObjectNotFound, PreconditionFailed) as exc:
        # ``dst`` left by an earlier failed save of this step, or ``src`` gone: a new file it
        # is; the recycled folder, now uncommitted, is removed by rotation as a leftover.
        logger.info("cannot recycle %s into %s under %s (%s): writing a new file", src, dst, backend.url, exc)
        return None
    return InPlace(rewriting, backend.url)


def retire_while_listing(
    relist: Callable[[], object], retire: Callable[[], CheckpointInfo | None]
) -> CheckpointInfo | None:
    """Run ``retire`` (the recycled checkpoint's manifest delete, chosen from the writer's catalog
    as its last listing left it) while ``relist`` lists the root: one round trip, not two.

    The listing is the fence for what touches a file: the move and the rewrite come after it,
    and a newer writer it shows stops the save there. The retire may run before that fence:
    it takes only a checkpoint this writer's retention lets go at this save, at the moment it
    went before, and leaves its file where it is (a newer writer that resumed from it has the
    manifest in memory and anchors its own copy). Both run to their end, whatever either raises.

    Returns:
        The retired checkpoint (its file for the caller to move), or None.

    Raises:
        What ``relist`` raised (first), else what ``retire`` raised.
    """
    listed: BaseException | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptsdk-retire") as pool:
        retiring = pool.submit(carried(retire))
        try:
            relist()
        except BaseException as exc:  # re-raised once the retire is done too
            listed = exc
    if listed is not None:
        raise listed
    return retiring.result()
