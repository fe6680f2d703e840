"""Which writer supersedes which: the lineage and fencing rule, in one place.

A writer is its lease epoch, its tag and the step it resumed from (a frozen :class:`LineageWriter`,
in the spirit of orbax's ``_src/path/step.py``). A higher writer fences a lower one, and a lower
writer's checkpoint past the point a higher one resumed from is an orphan. Key formats are
:mod:`ckptsdk.format.layout`'s; what a root holds is the catalog's; acting on a fence is the lease's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ckptsdk.format.layout import Rank, checkpoint_dir, lineage_key, outranks, writer_tag

__all__ = ["LineageWriter", "superseded_by"]


@dataclass(frozen=True)
class LineageWriter:
    """One writer of a root, as its names and its lineage record say.

    Attributes:
        epoch: its lease epoch (the fencing token).
        tag: its writer tag ("" on stores with compare-and-swap; see ``layout.writer_tag``).
        resumed_from: the step it resumed from (None: a fresh start, or not restored yet).

    Example:
        >>> w = LineageWriter.of(epoch=2, nonce="0123456789abcdef", compare_and_swap=True)
        >>> w.folder(100), w.fenced_by((3, ""))
        ('step-0000000100.e2', True)
    """

    epoch: int
    tag: str = ""
    resumed_from: int | None = None

    @classmethod
    def of(cls, *, epoch: int, nonce: str, compare_and_swap: bool, resumed_from: int | None = None) -> LineageWriter:
        """The writer holding the lease of ``epoch`` with ``nonce`` on a store with or without CAS."""
        return cls(epoch=epoch, tag=writer_tag(nonce, compare_and_swap=compare_and_swap), resumed_from=resumed_from)

    @property
    def rank(self) -> Rank:
        """(epoch, tag): higher ranks supersede lower ones."""
        return (self.epoch, self.tag)

    def fenced_by(self, seen: Rank) -> bool:
        """Whether a writer of rank ``seen`` supersedes this one (then this one must stop)."""
        return outranks(seen, self.rank)

    def may_delete(self, rank: Rank) -> bool:
        """Whether this writer may delete a checkpoint of ``rank``: its own lineage only, never a higher writer's."""
        return not outranks(rank, self.rank)

    def folder(self, step: int) -> str:
        """The folder this writer's checkpoint of ``step`` goes to."""
        return checkpoint_dir(step, self.epoch, self.tag)

    @property
    def lineage_key(self) -> str:
        """Where this writer's takeover record goes."""
        return lineage_key(self.epoch, self.tag)


def superseded_by(step: int, rank: Rank, resume_points: Mapping[Rank, int | None]) -> tuple[Rank, int | None] | None:
    """The newer writer that makes the checkpoint (``step``, ``rank``) an orphan, and where it resumed from.

    A checkpoint of a lower writer past the point a higher writer resumed from (or any, after a
    higher writer's fresh start) is a zombie's orphan: never restored, removed by gc.
    Returns None when no writer supersedes it.
    """
    for newer in sorted(resume_points, reverse=True):
        if not outranks(newer, rank):
            break
        point = resume_points[newer]
        if point is None or step > point:
            return newer, point
    return None
