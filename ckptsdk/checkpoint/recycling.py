"""Drive's recycle mode, the rewrite half: move a rotated-out tensor file and rewrite it in place.

Which checkpoint gives its file is rotation's (``Rotation.recycle_source``); this only moves the
file into the new folder and hands ``write_tensorfile`` a backend that overwrites it there.
"""

from __future__ import annotations

import logging
from typing import Any

from ckptsdk.backends.base import Backend, Rewritable, rewriter
from ckptsdk.errors import ObjectNotFound, PreconditionFailed

logger = logging.getLogger("ckptsdk.checkpoint.rotation")

__all__ = ["InPlace", "take_file"]


class InPlace:
    """The backend as ``write_tensorfile`` sees it when a recycled file is rewritten in place."""

    def __init__(self, backend: Rewritable, url: str) -> None:
        self._backend = backend
        self.url = url

    def write(self, key: str, data: Any) -> Any:
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
