"""The resume audit: did the resumed run really continue the same run?

Reads every attempt's step log (``ckptsdk.runlog.writer``) and compares the steps logged by more than one
attempt: identical scalars and data digests mean the resume was bit-exact; when no step was run
twice nothing was proven and the verdict says so (``unverified``, with the reason). Writing the
log, checkpoints and plotting do not belong here. The attempts are merged by step as they are
read (``reading.py``), so memory does not grow with the length of the run.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Generator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ckptsdk.backends.base import Backend
from ckptsdk.errors import ConfigError
from ckptsdk.format.document import Document
from ckptsdk.runlog.reading import AttemptLog, OutOfOrder, list_attempts
from ckptsdk.runlog.record import DATA_PREFIX, LogFloat, StepRow

logger = logging.getLogger(__name__)

__all__ = [
    "AUDIT_FORMAT",
    "AttemptSummary",
    "OverlapRange",
    "ScalarDiff",
    "Divergence",
    "AuditReport",
    "audit",
    "read_runlog",
]

#: 1.2: "unverified" verdict and its reason, data digests compared; 1.1: non-finite floats as
#: {"$float": ...} (1.0: "NaN"/"Infinity" strings, still read).
AUDIT_FORMAT: Final = "ckptsdk.audit/1.2"
UNVERIFIED: Final = "unverified"
_READ_WORKERS = 8  # concurrent chunk reads (each a GCS/Drive round trip)


class AttemptSummary(BaseModel):
    """One attempt as the audit saw it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempt: int
    run_id: str | None = None
    lease_epoch: int | None = None
    host: str | None = None
    device: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    started_at: str | None = None
    resumed_from_step: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0
    chunks: int = 0
    missing_chunks: list[int] = Field(default_factory=list)
    closed: bool = False


class OverlapRange(BaseModel):
    """Steps logged by the same set of several attempts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: list[int]
    first_step: int
    last_step: int
    steps: int


class ScalarDiff(BaseModel):
    """For one scalar, the largest difference between attempts over the overlapping steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_abs_diff: LogFloat
    at_step: int | None
    compared_steps: int


class Divergence(BaseModel):
    """The first step where attempts disagree: a scalar beyond the tolerance, or a data digest
    (``scalar`` under ``data/``: ``values`` are the digests, ``abs_diff`` is inf)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int
    scalar: str
    values: dict[int, LogFloat]
    abs_diff: LogFloat

    @property
    def in_data(self) -> bool:
        """Whether the attempts ran this step on different data (a digest differs)."""
        return self.scalar.startswith(DATA_PREFIX)

    @field_validator("values", mode="before")
    @classmethod
    def _attempt_keys(cls, value: Any) -> Any:
        # JSON keys are strings: {"1": ...} is attempt 1 (read strictly, as every document is).
        if isinstance(value, dict):
            return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value.items()}
        return value


class AuditReport(Document):
    """What :func:`audit` found. ``verdict`` is "bit-exact", "within tolerance",
    "DIVERGED at step N", or "unverified" (no step was logged by two attempts: nothing was
    proven; ``unverified_reason`` says why, e.g. a killed attempt's last steps never flushed).

    ``series`` (attempt -> [(step, {scalar: value})]) is filled only by ``audit(..., series=True)``
    (for plotting in-process) and left out of the JSON form. Read a saved report with
    ``parse_document(data, AuditReport)``. No checksum: a report is printed for people and
    tools, never trusted by ckptsdk itself.
    """

    FORMAT: ClassVar[str] = AUDIT_FORMAT

    format: str = Field(default=AUDIT_FORMAT, pattern=r"^ckptsdk\.audit/1(\.[0-9]+)?$")
    url: str
    tolerance: LogFloat
    verdict: str
    diverged_at: int | None = None
    attempts: list[AttemptSummary]
    overlap_steps: int
    overlaps: list[OverlapRange]
    scalars: dict[str, ScalarDiff]
    first_divergence: Divergence | None = None
    #: data digest name (e.g. ``loader/batch``) -> steps where several attempts logged it
    data_compared: dict[str, int] = Field(default_factory=dict)
    unverified_reason: str | None = None
    warnings: list[str] = Field(default_factory=list)
    # repr=False: every scalar of every step would bury the verdict in a REPL.
    series: dict[int, list[tuple[int, dict[str, float]]]] = Field(default_factory=dict, exclude=True, repr=False)

    @property
    def ok(self) -> bool:
        """False only when the attempts diverged beyond the tolerance (see also :attr:`verified`)."""
        return self.diverged_at is None

    @property
    def verified(self) -> bool:
        """True only when steps run by several attempts were compared and agreed."""
        return self.diverged_at is None and self.overlap_steps > 0

    def __str__(self) -> str:
        """One line: the verdict, how many attempts and shared steps, each scalar's max |diff|.

        Example:
            ``audit of /tmp/run: bit-exact: 2 attempts, 5 steps run by more than one; max |loss
            diff| 0``
        """
        text = (
            f"audit of {self.url}: {self.verdict}: {len(self.attempts)} attempt"
            f"{'' if len(self.attempts) == 1 else 's'}, {self.overlap_steps} step"
            f"{'' if self.overlap_steps == 1 else 's'} run by more than one"
        )
        if self.scalars:
            text += "; " + ", ".join(f"max |{n} diff| {d.max_abs_diff:.6g}" for n, d in self.scalars.items())
        if self.unverified_reason:
            text += f"; {self.unverified_reason}"
        if self.warnings:
            text += f"; {len(self.warnings)} warning(s): see .warnings"
        return text


def read_runlog(
    backend: Backend,
) -> tuple[dict[int, AttemptSummary], dict[int, dict[int, dict[str, float]]], list[str]]:
    """Read every attempt's log under ``runlog/`` (scalars only; see :func:`read_runlog_rows`)."""
    summaries, rows, warnings = read_runlog_rows(backend)
    return summaries, {a: {s: dict(r.scalars) for s, r in per.items()} for a, per in rows.items()}, warnings


def read_runlog_rows(
    backend: Backend,
) -> tuple[dict[int, AttemptSummary], dict[int, dict[int, StepRow]], list[str]]:
    """Read every attempt's log under ``runlog/`` into memory (the audit streams instead).

    Chunks are read in sequence order whatever order the store lists them in; missing chunks
    (not yet visible on Drive, or lost), unreadable ones and damaged or overlong lines are
    reported, never fatal.

    Returns:
        (attempt -> summary, attempt -> {step: row}, warnings). Within one attempt a step
        logged twice keeps the last row (later chunk, later line).
    """
    with ThreadPoolExecutor(max_workers=_READ_WORKERS, thread_name_prefix="ckptsdk-runlog") as pool:
        logs = {a: AttemptLog(backend, a, e, pool) for a, e in sorted(list_attempts(backend).items())}
        steps = {a: {row.step: row for row in log.steps(held=True)} for a, log in logs.items()}
    summaries, warnings = _summaries(logs)
    return summaries, steps, warnings


def _summaries(logs: Mapping[int, AttemptLog]) -> tuple[dict[int, AttemptSummary], list[str]]:
    """Each attempt's summary once its rows were read, and every warning met (attempt order)."""
    summaries: dict[int, AttemptSummary] = {}
    warnings: list[str] = []
    for attempt, log in logs.items():
        rec = log.record()
        warnings += log.warnings
        seqs = sorted(log.entry.chunks)
        missing = sorted(set(range(0, (seqs[-1] + 1) if seqs else 0)) - set(seqs))
        if rec is not None and rec.chunk is not None and seqs and rec.chunk > seqs[-1]:
            missing += list(range(seqs[-1] + 1, rec.chunk + 1))
        if missing:
            warnings.append(
                f"attempt {attempt}: chunks {_ranges(missing)} not found (not visible yet on an "
                "eventually consistent store such as Drive, or lost); audited without them"
            )
        summaries[attempt] = AttemptSummary(
            attempt=attempt,
            run_id=rec.run_id if rec else None,
            lease_epoch=rec.lease_epoch if rec else None,
            host=rec.host if rec else None,
            device=rec.device if rec else None,
            versions=dict(rec.versions) if rec else {},
            started_at=rec.started_at if rec else None,
            resumed_from_step=rec.resumed_from_step if rec else None,
            first_step=log.first_step,
            last_step=log.last_step,
            steps=log.count,
            chunks=log.read_chunks,
            missing_chunks=missing,
            closed=log.closed,
        )
    run_ids = {s.run_id for s in summaries.values() if s.run_id is not None}
    if len(run_ids) > 1:
        warnings.append(f"attempts belong to different run ids {sorted(run_ids)}: one root should hold one run")
    return summaries, warnings


def _same(a: float, b: float) -> bool:
    """Bit-level sameness as far as a float can show it (nan equals nan; 0.0 differs from -0.0)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _spread(values: Iterable[float]) -> float:
    """The largest |a - b| over the values (inf when a nan meets a number, or +inf meets -inf)."""
    vals = list(values)
    nans = [v for v in vals if math.isnan(v)]
    if nans:
        return 0.0 if len(nans) == len(vals) else math.inf
    lo, hi = min(vals), max(vals)
    if lo == hi:
        return 0.0
    return hi - lo  # inf when an inf meets anything else: an inf loss is a divergence


def audit(backend: Backend, *, tolerance: float = 0.0, series: bool = False) -> AuditReport:
    """Compare the steps logged by more than one attempt.

    Args:
        backend: the checkpoint root (its ``runlog/`` objects are read, nothing is written).
        tolerance: the largest |difference| of any scalar at a shared step still accepted
            (data digests must always be equal).
        series: also keep every logged step's scalars in ``report.series`` (for a plot; memory
            grows with the log). Without it the attempts are compared as they are read, step
            by step, in memory bounded by the number of attempts, not of steps.

    Returns:
        An :class:`AuditReport`; ``verdict`` is "bit-exact" when every shared step has identical
        scalars and data digests, "within tolerance" when scalar differences are all <=
        ``tolerance``, "DIVERGED at step N" at the first step where one exceeds it (a nan
        against a number always does) or a data digest differs, and "unverified" when no step
        was logged twice (``unverified_reason`` says why).

    Raises:
        ConfigError: a negative or non-finite tolerance.
        BackendError: the root cannot be listed.

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> from ckptsdk.runlog.writer import RunLog
        >>> root = open_backend("memory://audit-doc")
        >>> for attempt, steps in ((1, range(0, 5)), (2, range(3, 8))):  # 2 resumed from step 3
        ...     log = RunLog(root, run_id="r", attempt=attempt, lease_epoch=attempt, resumed_from_step=None)
        ...     for s in steps:
        ...         log.log_step(s, loss=1.0 / (s + 1))
        ...     log.close()
        >>> report = audit(root)
        >>> report.verdict, report.overlap_steps
        ('bit-exact', 2)
    """
    if not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance < 0:
        raise ConfigError(f"audit tolerance must be a finite number >= 0, got {tolerance!r}")
    held: set[int] = set()  # attempts that logged steps out of order: read whole, then sorted
    while True:
        try:
            return _audit(backend, float(tolerance), series, held)
        except OutOfOrder as exc:
            logger.warning("%s: comparing it from memory", exc)
            held.add(exc.attempt)


class _Tally:
    """What the verdict needs, updated one shared step at a time (nothing per step is kept)."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self.diffs: dict[str, list[Any]] = {}  # name -> [max diff, at step, compared]
        self.data_compared: dict[str, int] = {}
        self.first_div: Divergence | None = None
        self.bit_exact = True
        self.shared = 0
        self.groups: dict[tuple[int, ...], list[int]] = {}  # attempts -> [first, last, steps]

    def step(self, step: int, per: Mapping[int, StepRow]) -> None:
        self.shared += 1
        group = self.groups.setdefault(tuple(sorted(per)), [step, step, 0])
        group[1], group[2] = step, group[2] + 1
        for name in sorted({n for row in per.values() for n in row.scalars}):
            by_attempt = {a: r.scalars[name] for a, r in per.items() if name in r.scalars}
            if len(by_attempt) < 2:
                continue  # a scalar only one attempt logged here cannot be compared
            first = next(iter(by_attempt.values()))
            same = all(_same(first, v) for v in by_attempt.values())
            if name.startswith(DATA_PREFIX):
                # The same step ran on other data: no tolerance applies, whatever the losses say.
                self.data_compared[name] = self.data_compared.get(name, 0) + 1
                if not same:
                    self.bit_exact = False
                    if self.first_div is None:
                        self.first_div = Divergence(step=step, scalar=name, values=by_attempt, abs_diff=math.inf)
                continue
            d = _spread(by_attempt.values())
            if not same:
                self.bit_exact = False
            entry = self.diffs.setdefault(name, [0.0, None, 0])
            entry[2] += 1
            if d > entry[0]:  # at_step stays None while every difference is 0
                entry[0], entry[1] = d, step
            if self.first_div is None and d > self.tolerance:
                self.first_div = Divergence(step=step, scalar=name, values=by_attempt, abs_diff=d)


def _audit(backend: Backend, tolerance: float, keep_series: bool, held: set[int]) -> AuditReport:
    """One streaming pass: every attempt's rows merged by step, each shared step compared once."""
    tally = _Tally(tolerance)
    series: dict[int, list[tuple[int, dict[str, float]]]] = {}
    with ThreadPoolExecutor(max_workers=_READ_WORKERS, thread_name_prefix="ckptsdk-runlog") as pool:
        logs = {a: AttemptLog(backend, a, e, pool) for a, e in sorted(list_attempts(backend).items())}
        streams: dict[int, Generator[StepRow, None, None]] = {a: log.steps(held=a in held) for a, log in logs.items()}
        try:
            heap: list[tuple[int, int, StepRow]] = []
            for attempt, stream in streams.items():
                series[attempt] = []
                _push(heap, attempt, stream)
            while heap:
                step = heap[0][0]
                per: dict[int, StepRow] = {}
                while heap and heap[0][0] == step:
                    _, attempt, row = heapq.heappop(heap)
                    per[attempt] = row
                    _push(heap, attempt, streams[attempt])
                if keep_series:
                    for attempt, row in per.items():
                        values = {n: v for n, v in row.scalars.items() if not n.startswith(DATA_PREFIX)}
                        series[attempt].append((step, values))
                if len(per) > 1:
                    tally.step(step, per)
        finally:
            for stream in streams.values():
                stream.close()
    summaries, warnings = _summaries(logs)
    warnings = [f"attempt {a} logged steps out of order: compared from memory" for a in sorted(held)] + warnings
    first_div = tally.first_div
    reason = None
    if not tally.shared:
        verdict = UNVERIFIED
        reason = _why_unverified([summaries[a] for a in sorted(summaries)])
    elif first_div is not None:
        verdict = f"DIVERGED at step {first_div.step}"
    elif tally.bit_exact:
        verdict = "bit-exact"
    else:
        verdict = "within tolerance"
    overlaps = [
        OverlapRange(attempts=list(attempts), first_step=g[0], last_step=g[1], steps=g[2])
        for attempts, g in sorted(tally.groups.items(), key=lambda kv: kv[1][0])
    ]
    report = AuditReport(
        url=backend.url,
        tolerance=tolerance,
        verdict=verdict,
        diverged_at=first_div.step if first_div else None,
        attempts=[summaries[a] for a in sorted(summaries)],
        overlap_steps=tally.shared,
        overlaps=overlaps,
        scalars={
            n: ScalarDiff(max_abs_diff=v[0], at_step=v[1], compared_steps=v[2]) for n, v in sorted(tally.diffs.items())
        },
        first_divergence=first_div,
        data_compared=tally.data_compared,
        unverified_reason=reason,
        warnings=warnings,
        series=series if keep_series else {},
    )
    logger.info("audit of %s: %s (%d shared steps)", report.url, verdict, tally.shared)
    return report


def _push(heap: list[tuple[int, int, StepRow]], attempt: int, stream: Iterator[StepRow]) -> None:
    row = next(stream, None)
    if row is not None:
        heapq.heappush(heap, (row.step, attempt, row))


def _why_unverified(attempts: list[AttemptSummary]) -> str:
    """Why no step was compared, in the words a user can act on; the case named first, so that a
    handoff (nothing ran twice, nothing lost) reads apart from a lost log."""
    logged = [a for a in attempts if a.steps]
    if not logged:
        return "no attempt logged a step (call mgr.log_step(step, loss=...) in the training loop)"
    if len(attempts) == 1:
        return f"one attempt only (attempt {attempts[0].attempt}): the run never resumed, so nothing ran twice"
    reasons = [_why_pair(before, after) for before, after in itertools.pairwise(attempts)]
    said = [(case, text) for case, text in reasons if text]
    cases = {case for case, _ in said}
    if said and cases <= {_CLEAN, _AT_SAVE}:
        # Honest still (nothing was compared), but not a lost log: say so first.
        case = _CLEAN if cases == {_CLEAN} else _AT_SAVE
        return f"{case}: no step ran twice; " + "; ".join(text for _, text in said)
    listed = [f"{case}: {text}" if case else text for case, text in said]
    return "no step was run by two attempts: " + "; ".join(listed or ["the attempts logged disjoint steps"])


_CLEAN, _AT_SAVE, _LOST = "clean handoff", "handoff at a save", "lost log"


def _why_pair(before: AttemptSummary, after: AttemptSummary) -> tuple[str, str]:
    """(the case, what happened) between two attempts that ran no step in common."""
    resumed = after.resumed_from_step
    if resumed is None:
        return "", f"attempt {after.attempt} started fresh (no checkpoint restored): nothing to compare"
    if before.last_step is None:
        return _LOST, f"attempt {before.attempt} has no step on storage: none of its steps was ever flushed"
    if before.last_step == resumed and before.closed:
        return _CLEAN, (
            f"attempt {before.attempt} stopped cleanly at step {resumed}, the step attempt {after.attempt} "
            "resumed from: no step ran twice and nothing was lost"
        )
    if before.last_step == resumed:
        return _AT_SAVE, (
            f"attempt {before.attempt} was not closed cleanly and its last step on storage is {resumed}, the "
            f"step attempt {after.attempt} resumed from: no step ran twice (a step it ran after that save in "
            "its last second, if any, never reached storage)"
        )
    if before.last_step < resumed:
        how = "stopped cleanly" if before.closed else "was not closed cleanly"
        return _LOST, (
            f"attempt {before.attempt} {how} and its last step on storage is {before.last_step}, before step "
            f"{resumed} that attempt {after.attempt} resumed from: the steps it ran after its last flush never "
            "reached storage" + ("" if before.closed else " (killed within the flush interval)")
        )
    if after.steps == 0:
        return "", f"attempt {after.attempt} logged no step after resuming from step {resumed}"
    return "", ""


def _ranges(nums: list[int]) -> str:
    out: list[str] = []
    start: int | None = None
    prev = 0  # meaningful only once start is set
    for n in sorted(nums):
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = n
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)
