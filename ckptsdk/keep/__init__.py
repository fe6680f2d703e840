"""Keep rules under short names, for ``CheckpointManager(keep=[...])``: ``keep.best("val_loss", 2)``.

Each rule says which committed checkpoints it keeps; the manager keeps the union of its rules,
``keep_last`` and ``keep_every``, plus the newest checkpoint and the resume point. The rules
themselves (how they judge, how manifests record them) live in :mod:`ckptsdk.checkpoint.retention`;
this is only the name a job types. A subpackage, not a root module: the root holds at most ten.

Example:
    >>> import torch, ckptsdk
    >>> from ckptsdk import keep
    >>> rules = [keep.best("val_loss", 2), keep.every(1000), keep.every_seconds(3600)]
    >>> with ckptsdk.CheckpointManager("memory://keep-doc", keep_last=1, keep=rules) as mgr:
    ...     for step, loss in [(500, 0.3), (1000, 0.9), (1500, 0.1), (1600, 0.8), (1700, 0.7)]:
    ...         _ = mgr.save({"w": torch.ones(2)}, step=step, metrics={"val_loss": loss})
    ...     sorted(mgr.kept())
    [500, 1000, 1500, 1700]
"""

from __future__ import annotations

from collections.abc import Callable

from ckptsdk.checkpoint.retention import (
    Candidate,
    KeepBest,
    KeepEvery,
    KeepEverySeconds,
    KeepIf,
    KeepLast,
    Mode,
    Rule,
    keep_best,
    keep_every,
    keep_every_seconds,
    keep_if,
    keep_last,
)

__all__ = ["Candidate", "Rule", "best", "every", "every_seconds", "last", "when"]


def last(n: int) -> KeepLast:
    """Keep the ``n`` highest steps (what ``keep_last=n`` does).

    Example:
        >>> sorted(last(2)([Candidate(100), Candidate(200), Candidate(300)]))
        [200, 300]
    """
    return keep_last(n)


def every(k: int) -> KeepEvery:
    """Keep, forever, every step that is a multiple of ``k`` (milestones).

    Example:
        >>> sorted(every(1000)([Candidate(s) for s in (500, 1000, 1500, 2000)]))
        [1000, 2000]
    """
    return keep_every(k)


def every_seconds(seconds: float) -> KeepEverySeconds:
    """Keep checkpoints at least ``seconds`` apart, by their manifests' own times.

    Example:
        >>> sorted(every_seconds(60)([Candidate(s, time=t) for s, t in ((1, 0), (2, 30), (3, 61))]))
        [1, 3]
    """
    return keep_every_seconds(seconds)


def best(metric: str, k: int = 1, mode: Mode | None = None) -> KeepBest:
    """Keep the ``k`` best checkpoints by ``metric`` (a name the saves pass in ``metrics``).

    Args:
        metric: the metric's name.
        k: how many to keep.
        mode: ``"min"`` or ``"max"``; None: ``"min"`` for a name that ends in loss or error,
            else ``"max"``. NaN and inf are never best; a checkpoint without the metric is no
            candidate.

    Example:
        >>> best("val_loss", 1)([Candidate(1, metrics={"val_loss": 0.5}), Candidate(2, metrics={"val_loss": 0.2})])
        {2: 'best val_loss #1'}
    """
    return keep_best(metric, k, mode)


def when(predicate: Callable[[Candidate], bool], name: str = "custom") -> KeepIf:
    """Keep what ``predicate`` accepts; ``name`` is what manifests record and ``ckptsdk ls`` shows.

    A predicate is recorded by name only, so ``ckptsdk gc`` without rule flags lets nothing go
    by retention on a root whose writer used one.

    Example:
        >>> when(lambda c: c.metrics.get("milestone") is True, name="milestone")(
        ...     [Candidate(6), Candidate(7, metrics={"milestone": True})]
        ... )
        {7: 'milestone'}
    """
    return keep_if(predicate, name)
