"""Opening a writer: the lease first or the listing first, and the epoch that keeps names unique.

A writer's first listing of the root serves two ends: the epoch floor its lease must clear (no
folder name is ever used twice, even on a root whose LEASE.json was lost) and the candidates its
first restore walks. Which comes first depends on the store: see :func:`take_lease`.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading.listing import lineage_floor
from ckptsdk.checkpoint.reading.outline import Outline
from ckptsdk.lease.acquire import Lease

__all__ = ["take_lease"]


def take_lease(lease: Lease, backend: Backend, outline: Callable[[], Outline]) -> Outline | None:
    """Acquire ``lease``; returns the root's listing the first restore may walk, or None.

    With compare-and-swap the lease comes first (above every lineage record's epoch: each writer
    records one before its first folder), then the one listing of the root, which shows what a
    restore's own listing would: nobody commits past our takeover but a previous holder's save
    already through its fence, whose late folder the lineage orphans either way. Where that
    listing shows a name of our epoch or above, our record moves up before anything is written.
    Without compare-and-swap (Drive) the listing comes first and restore lists again: other
    machines' writes reach us late there, and the later listing sees more of them.
    """
    if not backend.capabilities.compare_and_swap:
        lease.acquire(min_epoch=outline().epoch_floor + 1)
        return None
    lease.acquire(min_epoch=lineage_floor(backend) + 1)
    opened = outline()
    if opened.epoch_floor >= lease.epoch:
        lease.raise_epoch(opened.epoch_floor + 1)
    return opened
