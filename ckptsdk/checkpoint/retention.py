"""Which committed checkpoints to keep: small pure policies that compose.

A policy maps the sorted committed steps of one lineage to the set of steps it wants kept; the
plan keeps the union and deletes the rest. Nothing here touches storage, leases or epochs: the
manager decides *which* checkpoints are candidates (its own lineage, never while fenced) and the
order of deletion (manifest first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

# A policy: sorted unique steps -> the steps it keeps.
Policy = Callable[[Sequence[int]], set[int]]


def keep_last(n: int) -> Policy:
    """Keep the ``n`` highest steps.

    Example:
        >>> sorted(keep_last(2)([100, 200, 300]))
        [200, 300]
    """
    if n < 1:
        raise ValueError(f"keep_last must be >= 1 (got {n}): the newest checkpoint is never deleted")

    def policy(steps: Sequence[int]) -> set[int]:
        return set(steps[-n:])

    return policy


def keep_every(k: int) -> Policy:
    """Keep, forever, every step that is a multiple of ``k`` (milestones).

    Example:
        >>> sorted(keep_every(1000)([500, 1000, 1500, 2000]))
        [1000, 2000]
    """
    if k < 1:
        raise ValueError(f"keep_every must be >= 1 (got {k})")

    def policy(steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % k == 0}

    return policy


def protect(protected: Iterable[int]) -> Policy:
    """Keep these steps whatever the other policies say (e.g. the step a run resumed from)."""
    fixed = set(protected)

    def policy(steps: Sequence[int]) -> set[int]:
        return fixed.intersection(steps)

    return policy


def plan(steps: Iterable[int], policies: Iterable[Policy]) -> tuple[list[int], list[int]]:
    """Split ``steps`` into (kept, deleted), both sorted ascending.

    The newest step is always kept, whatever the policies: losing the last committed checkpoint
    is never the right answer to a retention setting.

    Example:
        >>> plan([1, 2, 3, 4], [keep_last(2), protect([1])])
        ([1, 3, 4], [2])
    """
    ordered = sorted(set(steps))
    if not ordered:
        return [], []
    keep = {ordered[-1]}
    for policy in policies:
        keep |= policy(ordered)
    return [s for s in ordered if s in keep], [s for s in ordered if s not in keep]
