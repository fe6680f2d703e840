"""Keep rules against a real writer: random rule sets, metric streams with NaN, restarts, takeovers.

After every commit the root must hold exactly what an independent oracle of the rules keeps
(the union, the newest, the resume point), nothing a rule keeps may have been deleted, the best
k over everything ever committed must still be there, and ``gc`` with the same rules must find
nothing more to delete (a restart decides as the writer did). A fenced writer deletes nothing.
"""

from __future__ import annotations

import argparse
import math
import uuid
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptsdk import CheckpointManager, LeaseOptions, Retention, SaveOptions, TrainState
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.checkpoint import retention
from ckptsdk.checkpoint.pruning.rotation import Rotation, kept
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.checkpoint.reading.reader import ResumePoint
from ckptsdk.checkpoint.retention import Candidate
from ckptsdk.cli.admin import rules_in_force
from ckptsdk.errors import LeaseLostError
from ckptsdk.manager import Simulation

METRIC = "val_loss"


@dataclass(frozen=True)
class Spec:
    """A drawn rule set, kept as plain numbers so the oracle below needs no library code."""

    keep_last: int
    keep_every: int | None
    seconds: float | None
    best_k: int | None
    mode: str
    predicate_mod: int | None  # keep_if(step % mod == 0), a custom predicate over manifests

    def rules(self) -> list[retention.Rule]:
        out: list[retention.Rule] = []
        if self.seconds is not None:
            out.append(retention.keep_every_seconds(self.seconds))
        if self.best_k is not None:
            out.append(retention.keep_best(METRIC, self.best_k, self.mode))  # type: ignore[arg-type]
        if self.predicate_mod is not None:
            mod = self.predicate_mod
            out.append(retention.keep_if(lambda c: c.manifest is not None and c.manifest.step % mod == 0, "custom"))
        return out


def _finite(c: Candidate) -> float | None:
    v = c.metrics.get(METRIC)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def oracle(cands: list[Candidate], spec: Spec, resume: int | None) -> set[int]:
    """What the rules keep, written out plainly (no retention.decide): the test's own reading."""
    if not cands:
        return set()
    cands = sorted(cands, key=lambda c: c.step)
    steps = [c.step for c in cands]
    keep = {steps[-1]} | set(steps[-spec.keep_last :])
    if spec.keep_every:
        keep |= {s for s in steps if s % spec.keep_every == 0}
    if spec.seconds is not None:
        keep |= _spaced(cands, spec.seconds)
    if spec.best_k is not None:
        keep |= _best(cands, spec)
    if spec.predicate_mod is not None:
        keep |= {s for s in steps if s % spec.predicate_mod == 0}
    if resume is not None and resume in steps:
        keep.add(resume)
    return keep


def _best(cands: list[Candidate], spec: Spec) -> set[int]:
    assert spec.best_k is not None
    scored = [(v, c.step) for c in cands if (v := _finite(c)) is not None]
    scored.sort(key=lambda vs: (vs[0] if spec.mode == "min" else -vs[0], vs[1]))
    return {s for _v, s in scored[: spec.best_k]}


def _forever(cands: list[Candidate], spec: Spec) -> set[int]:
    """The steps the keep-forever rules (every K steps, every T seconds) keep."""
    kept = {c.step for c in cands if spec.keep_every and c.step % spec.keep_every == 0}
    if spec.seconds is not None:
        kept |= _spaced(cands, spec.seconds)
    return kept


def _spaced(cands: list[Candidate], seconds: float) -> set[int]:
    """The oldest timed step, then each one at least ``seconds`` after the last one taken."""
    out: set[int] = set()
    last = None
    for c in sorted(cands, key=lambda c: c.step):
        assert c.time is not None  # every manifest has its created_at
        if last is None or c.time - last >= seconds:
            out.add(c.step)
            last = c.time
    return out


def _committed(mgr: CheckpointManager) -> dict[int, Candidate]:
    """The valid checkpoints of the root, one per step, as candidates read from their manifests."""
    return {c.step: Candidate.of(c.manifest) for c in mgr.list() if c.valid and c.manifest is not None}


def _bare_gc_keeps(mgr: CheckpointManager) -> tuple[set[int], str]:
    """What a bare ``ckptsdk gc URL`` keeps (no rule flags: the rules the root records), and whence."""
    flags = dict(keep_last=None, keep_every=None, keep_every_seconds=None, keep_best=None, metric=None, mode=None)
    cat = scan(mgr.backend)
    in_force = rules_in_force(argparse.Namespace(url=mgr.url, **flags), cat)
    rotation = Rotation(mgr.backend, keep_last=in_force.keep_last, keep_every=None)
    rules = rotation.retention_rules(in_force.keep_last, in_force.rules)
    return set(kept(cat, rules, settle=rotation.late)), in_force.source


def _check_resume(mgr: CheckpointManager, pos: ResumePoint | None) -> None:
    """After a restore, the resume point is kept as such and the decision deletes nothing new."""
    if pos is None:
        return
    kept = mgr.kept()
    assert "resume point" in kept[pos.step]
    assert set(kept) == set(_committed(mgr))


specs = st.builds(
    Spec,
    keep_last=st.integers(1, 3),
    keep_every=st.one_of(st.none(), st.sampled_from([2, 3, 5])),
    seconds=st.one_of(st.none(), st.sampled_from([0.002, 0.01, 0.05])),
    best_k=st.one_of(st.none(), st.integers(1, 3)),
    mode=st.sampled_from(["min", "max"]),
    predicate_mod=st.one_of(st.none(), st.sampled_from([4, 7])),
)
metrics = st.one_of(
    st.none(),  # the save carries no val_loss: never a candidate
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.floats(-5, 5, allow_nan=False, width=32),
)
saves = st.lists(st.tuples(st.just("save"), st.integers(1, 4), metrics), min_size=4, max_size=24)
breaks = st.lists(st.tuples(st.integers(0, 24), st.sampled_from(["restart", "takeover"])), max_size=4)


@st.composite
def events(draw: st.DrawFn) -> list[tuple[str, int, float | None]]:
    """Mostly saves (each with a step increment and a val_loss), a few restarts and takeovers between them."""
    schedule: list[tuple[str, int, float | None]] = list(draw(saves))
    for at, kind in sorted(draw(breaks), reverse=True):
        schedule.insert(min(at, len(schedule)), (kind, 0, None))
    return schedule


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=specs, schedule=events())
def test_kept_is_the_rules_union_after_every_commit(spec: Spec, schedule: list[tuple[str, int, float | None]]) -> None:
    name = f"retention-prop-{uuid.uuid4().hex}"
    url = f"memory://{name}"
    kw = dict(
        retention=Retention(keep_last=spec.keep_last, keep_every=spec.keep_every, keep=spec.rules()),
        save_options=SaveOptions(on_signal=False),
        _simulation=Simulation(heartbeat=False),
    )
    state = TrainState(model=torch.nn.Linear(1, 1))
    ever: dict[int, Candidate] = {}  # every step ever committed (the best over these must survive)
    forever: set[int] = set()  # steps a keep-forever rule (every K, every T) kept: never deleted
    mgr = CheckpointManager(url, lease_options=LeaseOptions(ttl=30), **kw)  # type: ignore[arg-type]
    step = 0
    try:
        for kind, inc, value in schedule:
            if kind == "save":
                step += inc
                before = _committed(mgr)
                mgr.save(state, step=step, metrics={} if value is None else {METRIC: value})
                after = _committed(mgr)
                new = after[step]
                ever[step] = new
                pool = list({**before, step: new}.values())
                # The resume point is pinned only until the writer commits a newer step, which it
                # just did (steps only grow): here the pin is already off.
                expected = oracle(pool, spec, None)
                assert set(after) == expected, (spec, sorted(before), step, sorted(after), sorted(expected))
                for gone in set(before) - set(after):  # nothing a rule keeps is ever deleted
                    assert gone not in expected
                assert forever <= set(after), f"a keep-forever step was deleted: {sorted(forever - set(after))}"
                forever |= _forever(list(after.values()), spec)
                if spec.best_k is not None:  # the best over all time, not only over what is left
                    assert _best(list(ever.values()), spec) <= set(after)
                    best = mgr.best(METRIC, spec.mode)  # type: ignore[arg-type]
                    top = _best(list(ever.values()), Spec(1, None, None, 1, spec.mode, None))
                    assert (best.step if best is not None else None) == (min(top) if top else None)
                # A restart (or gc) with the same rules reaches the same decision: nothing more goes.
                assert set(mgr.kept()) == set(after)
                assert [k for k, why in mgr.gc(dry_run=True).reasons.items() if "no rule keeps" in why] == []
                # ...and so does a bare `ckptsdk gc URL`, from the rules the newest manifest records
                # (a predicate among them: it lets nothing go, which is the root as it stands).
                assert _bare_gc_keeps(mgr) == (set(after), "writer")
            elif kind == "restart":
                mgr.close()
                mgr = CheckpointManager(url, lease_options=LeaseOptions(ttl=30), **kw)  # type: ignore[arg-type]
                _check_resume(mgr, mgr.restore(state))
            else:  # takeover: a newcomer breaks the live lease; the old writer is fenced
                old = mgr
                mgr = CheckpointManager(url, lease_options=LeaseOptions(ttl=30, force=True), **kw)  # type: ignore[arg-type]
                _check_resume(mgr, mgr.restore(state))
                keys = {o.key for o in mgr.backend.list("")}
                with pytest.raises(LeaseLostError):
                    old.save(state, step=step + 1000, metrics={METRIC: -1e9})  # the best score ever: refused
                assert {o.key for o in mgr.backend.list("")} >= {k for k in keys if k.startswith("step-")}
                old.close()
    finally:
        mgr.close()
        MemoryBackend.discard_store(name)
