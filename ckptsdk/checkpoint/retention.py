"""Which committed checkpoints to keep: small pure rules over committed manifests, kept by union.

A rule looks at the committed steps of one lineage (as :class:`Candidate` records: step, the
manifest's own time, its metrics) and says which steps it keeps and why; :func:`decide` keeps the
union, plus the newest and any pinned step (the resume point), and lets the rest go. :func:`record`
and :func:`rules_of` turn rules into what each manifest records of them (``keep``) and back, so a
command decides as the writer did. Nothing here touches storage, leases or epochs: rotation decides
which checkpoints are candidates (its own lineage, never a zombie's, never while fenced) and the
order of deletion (manifest first).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from ckptsdk.errors import ConfigError
from ckptsdk.format.manifest import (
    CustomRuleRecord,
    KeepBestRecord,
    KeepEveryRecord,
    KeepEverySecondsRecord,
    KeepLastRecord,
    KeepRecord,
    ProtectRecord,
)

if TYPE_CHECKING:
    from ckptsdk.format.manifest import Manifest

logger = logging.getLogger(__name__)

__all__ = [
    "Candidate",
    "Decision",
    "KeepBest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepIf",
    "KeepLast",
    "Mode",
    "Pinned",
    "Rule",
    "Unjudged",
    "best_order",
    "decide",
    "default_mode",
    "describe",
    "describe_rules",
    "keep_best",
    "keep_every",
    "keep_every_seconds",
    "keep_if",
    "keep_last",
    "plan",
    "protect",
    "record",
    "rules_of",
    "same_rules",
    "warn_if_changed",
]

Mode = Literal["min", "max"]
#: Why a step is kept when no rule but the safety rules keep it.
NEWEST = "newest"
RESUME_POINT = "resume point"
#: Why a command keeps a step that only a rule it cannot judge (:class:`Unjudged`) may keep.
NOT_JUDGED = "not judged here"


@dataclass(frozen=True)
class Candidate:
    """One committed step as the rules see it: what its manifest says, nothing of this machine.

    Attributes:
        step: the training step saved.
        time: the manifest's ``created_at`` as POSIX seconds (the writer's clock when it
            committed), or None when unknown (then no time rule counts it).
        metrics: the metrics saved with it.
        manifest: the parsed manifest, for custom predicates (None in pure step lists).
    """

    step: int
    time: float | None = None
    metrics: Mapping[str, object] = field(default_factory=dict)
    manifest: Manifest | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, manifest: Manifest) -> Candidate:
        """The candidate a committed manifest describes."""
        when = datetime.fromisoformat(manifest.created_at.replace("Z", "+00:00")).timestamp()
        return cls(step=manifest.step, time=when, metrics=dict(manifest.metrics), manifest=manifest)


@runtime_checkable
class Rule(Protocol):
    """A keep rule: the candidates (sorted by step, one per step) in, ``{step: why}`` out."""

    def __call__(self, candidates: Sequence[Candidate]) -> dict[int, str]: ...


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` highest steps."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"keep_last must be >= 1 (got {self.n}): the newest checkpoint is never deleted")

    def __call__(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        return {c.step: "latest" for c in candidates[-self.n :]}


@dataclass(frozen=True)
class KeepEvery:
    """Keep, forever, every step that is a multiple of ``k`` (milestones)."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"keep_every must be >= 1 (got {self.k})")

    def __call__(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        return {c.step: f"every {self.k}" for c in candidates if c.step % self.k == 0}


@dataclass(frozen=True)
class KeepEverySeconds:
    """Keep checkpoints at least ``seconds`` apart by their manifests' times, forever.

    The oldest timed checkpoint is kept; then, in step order, each one whose time is at least
    ``seconds`` after the last one this rule kept. The times are the manifests' own (never this
    machine's clock), so every reader decides alike; a step this rule lets go never changes what
    it keeps later, so deleting it is safe. A clock that went back (another VM) only delays the
    next keep.
    """

    seconds: float

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ConfigError(f"keep_every_seconds must be a positive number of seconds (got {self.seconds})")

    def __call__(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        out: dict[int, str] = {}
        last: float | None = None
        for c in candidates:
            if c.time is None:
                continue
            if last is None or c.time - last >= self.seconds:
                out[c.step] = f"every {self.seconds:g} s"
                last = c.time
        return out


def default_mode(metric: str) -> Mode:
    """The direction a metric is better in when none is given: ``"min"`` for a name ending in
    ``loss`` (Hugging Face's rule for ``greater_is_better``), else ``"max"``.

    Example:
        >>> default_mode("val_loss"), default_mode("accuracy")
        ('min', 'max')
    """
    return "min" if metric.lower().endswith("loss") else "max"


def _score(value: object) -> int | float | None:
    """A metric value as a rankable number; None for anything that must never be best."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # a flag or a string is not a score
    if isinstance(value, int):
        # Kept an int: one beyond a float (10**400, in a manifest an older ckptsdk wrote) is
        # ranked exactly, where float() would raise OverflowError in every save's rotation.
        return value
    return value if math.isfinite(value) else None  # NaN and inf are never best


def best_order(candidates: Iterable[Candidate], metric: str, mode: Mode) -> list[Candidate]:
    """The candidates that hold a finite number for ``metric``, best first.

    Ties go to the older step (it reached that value first), so a later equal score never
    displaces a kept one. A checkpoint without the metric, or with NaN/inf, is not a candidate.
    """
    scored = [(s, c) for c in candidates if (s := _score(c.metrics.get(metric))) is not None]
    # Negated, not multiplied by -1.0: an int score stays an int (Python compares it with floats exactly).
    return [c for _s, c in sorted(scored, key=lambda sc: (sc[0] if mode == "min" else -sc[0], sc[1].step))]


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``k`` best checkpoints by ``metric`` (``mode="min"``: lowest is best)."""

    metric: str
    k: int = 1
    mode: Mode = "min"

    def __post_init__(self) -> None:
        if not self.metric:
            raise ConfigError("keep_best needs the name of a metric saved with the checkpoints")
        if self.k < 1:
            raise ConfigError(f"keep_best must keep >= 1 checkpoint (got k={self.k})")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"keep_best mode must be 'min' or 'max' (got {self.mode!r})")

    def __call__(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        best = best_order(candidates, self.metric, self.mode)[: self.k]
        return {c.step: f"best {self.metric} #{i}" for i, c in enumerate(best, 1)}


@dataclass(frozen=True)
class KeepIf:
    """Keep every checkpoint for which ``predicate(candidate)`` is true; ``name`` says why."""

    predicate: Callable[[Candidate], bool] = field(compare=False)
    name: str = "custom"

    def __call__(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        return {c.step: self.name for c in candidates if self.predicate(c)}


@dataclass(frozen=True)
class Pinned:
    """Keep these steps whatever the other rules say (the step a run resumed from)."""

    steps: frozenset[int]
    why: str = RESUME_POINT

    def __call__(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        return {c.step: self.why for c in candidates if c.step in self.steps}


@dataclass(frozen=True)
class Unjudged:
    """Keep every candidate: stands for a writer's rule that cannot be judged here.

    A predicate is recorded by name only, and a root written before the rules were recorded
    says nothing of them: a command that deleted by the rules it can judge would delete what
    those may keep, so it keeps everything they might (``what`` says which rule that is).
    """

    what: str

    def __call__(self, candidates: Sequence[Candidate]) -> dict[int, str]:
        return {c.step: f"{self.what}: {NOT_JUDGED}" for c in candidates}


def keep_last(n: int) -> KeepLast:
    """Keep the ``n`` highest steps.

    Example:
        >>> sorted(keep_last(2)([Candidate(100), Candidate(200), Candidate(300)]))
        [200, 300]
    """
    return KeepLast(n)


def keep_every(k: int) -> KeepEvery:
    """Keep, forever, every step that is a multiple of ``k``.

    Example:
        >>> sorted(keep_every(1000)([Candidate(s) for s in (500, 1000, 1500, 2000)]))
        [1000, 2000]
    """
    return KeepEvery(k)


def keep_every_seconds(seconds: float) -> KeepEverySeconds:
    """Keep checkpoints ``seconds`` apart by their manifests' times (see :class:`KeepEverySeconds`).

    Example:
        >>> sorted(keep_every_seconds(60)([Candidate(s, time=t) for s, t in ((1, 0), (2, 30), (3, 61))]))
        [1, 3]
    """
    return KeepEverySeconds(seconds)


def keep_best(metric: str, k: int = 1, mode: Mode | None = None) -> KeepBest:
    """Keep the ``k`` best checkpoints by ``metric``; ``mode`` None: :func:`default_mode`.

    Example:
        >>> rule = keep_best("val_loss", 1)
        >>> rule([Candidate(1, metrics={"val_loss": 0.5}), Candidate(2, metrics={"val_loss": float("nan")})])
        {1: 'best val_loss #1'}
    """
    return KeepBest(metric, k, mode or default_mode(metric))


def keep_if(predicate: Callable[[Candidate], bool], name: str = "custom") -> KeepIf:
    """Keep what ``predicate`` accepts (e.g. ``lambda c: c.metrics.get("milestone") is True``).

    Example:
        >>> keep_if(lambda c: c.step == 7, "the demo")([Candidate(6), Candidate(7)])
        {7: 'the demo'}
    """
    return KeepIf(predicate, name)


def protect(protected: Iterable[int], why: str = RESUME_POINT) -> Pinned:
    """Keep these steps whatever the other rules say (e.g. the step a run resumed from)."""
    return Pinned(frozenset(protected), why)


def describe(rule: Rule) -> str:
    """One rule as a user would write it (gc's reasons, ``ckptsdk ls``'s header).

    Example:
        >>> describe(keep_best("val_loss", 2))
        'keep_best=2 by val_loss (min)'
    """
    if isinstance(rule, KeepLast):
        return f"keep_last={rule.n}"
    if isinstance(rule, KeepEvery):
        return f"keep_every={rule.k}"
    if isinstance(rule, KeepEverySeconds):
        return f"keep_every_seconds={rule.seconds:g}"
    if isinstance(rule, KeepBest):
        return f"keep_best={rule.k} by {rule.metric} ({rule.mode})"
    if isinstance(rule, KeepIf):
        return f"keep_if {rule.name!r}"
    if isinstance(rule, Pinned):
        return f"{rule.why} {sorted(rule.steps)}"
    if isinstance(rule, Unjudged):
        return f"{rule.what} ({NOT_JUDGED})"
    return repr(rule)  # a user's own Rule: its repr is all we know


def describe_rules(rules: Iterable[Rule]) -> str:
    """Rules as a user wrote them, comma-separated (``ckptsdk ls``'s footer, gc's reasons).

    Example:
        >>> describe_rules([keep_last(3), keep_best("val_loss", 2)])
        'keep_last=3, keep_best=2 by val_loss (min)'
    """
    return ", ".join(describe(r) for r in rules)


def record(rules: Iterable[Rule]) -> list[KeepRecord]:
    """The rules as each manifest records them (its ``keep`` field), for commands to read back.

    A predicate (:func:`keep_if`) or a user's own rule cannot be written down: it is recorded by
    name, and :func:`rules_of` turns it into an :class:`Unjudged` rule that keeps everything.

    Example:
        >>> [r.rule for r in record([keep_last(1), keep_best("val_loss", 2), keep_if(bool, "mine")])]
        ['keep_last', 'keep_best', 'custom']
    """
    out: list[KeepRecord] = []
    for r in rules:
        if isinstance(r, KeepLast):
            out.append(KeepLastRecord(rule="keep_last", n=int(r.n)))
        elif isinstance(r, KeepEvery):
            out.append(KeepEveryRecord(rule="keep_every", k=int(r.k)))
        elif isinstance(r, KeepEverySeconds):
            out.append(KeepEverySecondsRecord(rule="keep_every_seconds", seconds=float(r.seconds)))
        elif isinstance(r, KeepBest):
            out.append(KeepBestRecord(rule="keep_best", metric=r.metric, k=int(r.k), mode=r.mode))
        elif isinstance(r, Pinned):
            out.append(ProtectRecord(rule="protect", steps=sorted(int(s) for s in r.steps), why=r.why))
        else:  # a predicate, an Unjudged stand-in, a user's own rule: only its name can be written
            name = r.name if isinstance(r, KeepIf) else r.what if isinstance(r, Unjudged) else describe(r)
            out.append(CustomRuleRecord(rule="custom", name=name[:200]))
    return out


def rules_of(records: Iterable[KeepRecord]) -> list[Rule]:
    """The rules a manifest records, to judge with: a custom one becomes :class:`Unjudged`.

    Example:
        >>> describe_rules(rules_of(record([keep_last(2), keep_if(bool, "mine")])))
        "keep_last=2, keep_if 'mine' (not judged here)"
    """
    out: list[Rule] = []
    for r in records:
        if isinstance(r, KeepLastRecord):
            out.append(KeepLast(r.n))
        elif isinstance(r, KeepEveryRecord):
            out.append(KeepEvery(r.k))
        elif isinstance(r, KeepEverySecondsRecord):
            out.append(KeepEverySeconds(r.seconds))
        elif isinstance(r, KeepBestRecord):
            out.append(KeepBest(r.metric, r.k, r.mode))
        elif isinstance(r, ProtectRecord):
            out.append(Pinned(frozenset(r.steps), r.why))
        else:
            out.append(Unjudged(f"keep_if {r.name!r}"))
    return out


def same_rules(a: Iterable[KeepRecord], b: Iterable[KeepRecord]) -> bool:
    """Whether two recorded rule lists keep the same (order does not matter: the union is kept)."""
    return sorted(r.model_dump_json() for r in a) == sorted(r.model_dump_json() for r in b)


def warn_if_changed(manifest: Manifest | None, rules: Sequence[Rule], url: str) -> bool:
    """Warn (and return True) when ``rules`` differ from those ``manifest``'s writer recorded.

    A restart or takeover keeps by its own rules from its first save on; a checkpoint only the
    previous writer's rules kept (a best one, say) then goes, so the new writer says so once.
    """
    if manifest is None or manifest.keep is None or same_rules(manifest.keep, record(rules)):
        return False
    logger.warning(
        "%s was kept by its previous writer's rules (%s, recorded in step %d); this writer's are %s: "
        "from its first save on it keeps by its own, and what only the old rules kept is deleted",
        url,
        describe_rules(rules_of(manifest.keep)),
        manifest.step,
        describe_rules(rules),
    )
    return True


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` found: each kept step with why, and the steps to let go (ascending)."""

    kept: dict[int, tuple[str, ...]]
    deleted: list[int]


def decide(
    candidates: Iterable[Candidate],
    rules: Iterable[Rule],
    *,
    pinned: Mapping[int, str] | None = None,
    settle: int = 0,
) -> Decision:
    """Keep the union of what ``rules`` keep, the newest step and the ``pinned`` ones.

    Args:
        candidates: one per step (the first of a repeated step counts).
        rules: the keep rules.
        pinned: steps kept whatever the rules say, each with why (the resume point).
        settle: steps by which the decision runs late: the newest ``settle`` steps are kept and
            the rules judge the others only, as if those had not committed yet (Drive, where the
            newest checkpoint may still be uploading when a delete of an older one arrives).

    Returns:
        A :class:`Decision`; kept steps map to their reasons in rule order, safety rules last.

    Example:
        >>> d = decide([Candidate(s) for s in (1, 2, 3, 4)], [keep_last(2)], pinned={1: "resume point"})
        >>> d.kept, d.deleted
        ({1: ('resume point',), 3: ('latest',), 4: ('latest', 'newest')}, [2])
    """
    by_step: dict[int, Candidate] = {}
    for c in candidates:
        by_step.setdefault(c.step, c)
    ordered = [by_step[s] for s in sorted(by_step)]
    if not ordered:
        return Decision({}, [])
    judged = ordered[: max(0, len(ordered) - settle)] if settle > 0 else ordered
    why: dict[int, list[str]] = {}
    for rule in rules:
        for step, reason in rule(judged).items():
            if step in by_step:  # a user's rule cannot keep what is not there
                why.setdefault(step, []).append(reason)
    for c in ordered[len(judged) :]:
        why.setdefault(c.step, []).append("settling" if c is not ordered[-1] else NEWEST)
    if settle <= 0:  # else the loop above named it
        why.setdefault(ordered[-1].step, []).append(NEWEST)
    for step, reason in (pinned or {}).items():
        if step in by_step:
            why.setdefault(step, []).append(reason)
    kept = {s: tuple(why[s]) for s in sorted(why)}
    return Decision(kept, [c.step for c in ordered if c.step not in kept])


def plan(steps: Iterable[int], rules: Iterable[Rule]) -> tuple[list[int], list[int]]:
    """Split bare ``steps`` into (kept, deleted), both sorted ascending (no times, no metrics).

    The newest step is always kept, whatever the rules: losing the last committed checkpoint
    is never the right answer to a retention setting.

    Example:
        >>> plan([1, 2, 3, 4], [keep_last(2), protect([1])])
        ([1, 3, 4], [2])
    """
    decision = decide((Candidate(s) for s in steps), rules)
    return list(decision.kept), decision.deleted
