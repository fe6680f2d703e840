"""Keep rules: pure over committed manifests (kept, with why), and what a real writer keeps with them."""

import contextlib
import uuid
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.checkpoint import retention
from ckptsdk.errors import ConfigError, LeaseLostError
from ckptsdk.manager import Simulation
from ckptsdk.testing.faulty import FaultyBackend


def test_keep_last_over_twenty_saves():
    steps = list(range(100, 2100, 100))
    kept, deleted = retention.plan(steps, [retention.keep_last(3)])
    assert kept == [1800, 1900, 2000]
    assert deleted == list(range(100, 1800, 100))


def test_keep_every_composes_with_keep_last():
    steps = list(range(100, 1100, 100))
    kept, _ = retention.plan(steps, [retention.keep_last(2), retention.keep_every(500)])
    assert kept == [500, 900, 1000]


def test_protect_keeps_resume_point():
    kept, deleted = retention.plan([1, 2, 3, 4, 5], [retention.keep_last(2), retention.protect([2, 99])])
    assert kept == [2, 4, 5]
    assert deleted == [1, 3]


def test_empty_and_invalid():
    assert retention.plan([], [retention.keep_last(1)]) == ([], [])
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        retention.keep_last(0)
    with pytest.raises(ValueError, match="keep_every must be >= 1"):
        retention.keep_every(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 5))
def test_newest_always_kept_and_partition(steps, n):
    kept, deleted = retention.plan(steps, [retention.keep_last(n)])
    assert sorted(kept + deleted) == sorted(set(steps))
    if steps:
        assert max(steps) in kept
        assert len(kept) == min(n, len(set(steps)))


# ---------------------------------------------------------------- the rules over manifests


def _c(step: int, loss: object = None, time: float | None = None) -> retention.Candidate:
    return retention.Candidate(step, time=time, metrics={} if loss is None else {"val_loss": loss})


def test_best_k_skips_nan_inf_missing_and_flags():
    cands = [_c(1, 0.5), _c(2, float("nan")), _c(3), _c(4, float("-inf")), _c(5, True), _c(6, "0.1"), _c(7, 0.7)]
    assert retention.keep_best("val_loss", 3, "min")(cands) == {1: "best val_loss #1", 7: "best val_loss #2"}
    assert retention.keep_best("val_loss", 1, "max")(cands) == {7: "best val_loss #1"}


def test_best_k_tie_goes_to_the_older_step():
    assert retention.keep_best("val_loss", 1)([_c(1, 0.3), _c(2, 0.3)]) == {1: "best val_loss #1"}


def test_default_mode_follows_the_loss_suffix():
    assert retention.keep_best("val_loss", 1).mode == "min"
    assert retention.keep_best("accuracy", 1).mode == "max"
    assert retention.keep_best("accuracy", 1, "min").mode == "min"


def test_every_seconds_is_judged_from_the_manifests_times():
    cands = [_c(s, time=t) for s, t in ((1, 100.0), (2, 130.0), (3, 160.0), (4, 150.0), (5, 221.0), (6, None))]
    # 4's clock went back (another VM): it only delays the next keep; 6 has no time: not counted.
    assert sorted(retention.keep_every_seconds(60)(cands)) == [1, 3, 5]


def test_decide_unions_rules_with_reasons_and_keeps_the_newest():
    cands = [_c(s, loss) for s, loss in ((10, 0.1), (20, 0.9), (30, 0.8), (40, float("nan")))]
    rules = [retention.keep_last(1), retention.keep_best("val_loss", 1)]
    d = retention.decide(cands, rules, pinned={20: "resume point"})
    assert d.kept == {10: ("best val_loss #1",), 20: ("resume point",), 40: ("latest", "newest")}
    assert d.deleted == [30]


def test_decide_one_save_late_judges_all_but_the_newest():
    cands = [_c(s, loss) for s, loss in ((1, 0.5), (2, 0.4), (3, 0.1))]
    d = retention.decide(cands, [retention.keep_last(1), retention.keep_best("val_loss", 1)], settle=1)
    assert d.kept == {2: ("latest", "best val_loss #1"), 3: ("newest",)}
    assert d.deleted == [1]


def test_custom_predicate_sees_the_candidate():
    rule = retention.keep_if(lambda c: c.metrics.get("milestone") is True, "milestone")
    cands = [retention.Candidate(1, metrics={"milestone": True}), retention.Candidate(2), retention.Candidate(3)]
    assert retention.plan([1, 2, 3], [retention.keep_last(1)]) == ([3], [1, 2])
    assert retention.decide(cands, [retention.keep_last(1), rule]).deleted == [2]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: retention.keep_best("", 1), "keep_best needs the name of a metric"),
        (lambda: retention.keep_best("val_loss", 0), "keep_best must keep >= 1"),
        (lambda: retention.KeepBest("val_loss", 1, "up"), "mode must be 'min' or 'max'"),  # type: ignore[arg-type]
        (lambda: retention.keep_every_seconds(0), "positive number of seconds"),
        (lambda: retention.keep_every_seconds(float("nan")), "positive number of seconds"),
    ],
)
def test_bad_rules_are_config_errors(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_describe_says_the_rules_as_written():
    rules = [retention.keep_last(3), retention.keep_every_seconds(3600), retention.keep_best("acc", 2)]
    said = [retention.describe(r) for r in rules]
    assert said == ["keep_last=3", "keep_every_seconds=3600", "keep_best=2 by acc (max)"]


# ---------------------------------------------------------------- a real writer


def _manager(url: str, *, force: bool = False, **kw: Any) -> CheckpointManager:
    return CheckpointManager(
        url,
        lease_options=LeaseOptions(ttl=30, force=force),
        save_options=SaveOptions(on_signal=False),
        _simulation=Simulation(heartbeat=False),
        **kw,
    )


def test_orbax_526_best_k_on_and_the_run_resumes_at_its_last_step(tmp_path):
    """Orbax's best_fn turned LatestN into BestN, deleting the newest checkpoint, so a resume to
    the last step failed (orbax #526). Here the rules add: every val_loss after the first is worse,
    yet the newest is kept, and a new runtime resumes at the last step with its exact weights."""
    url = str(tmp_path / "run")
    rules = [retention.keep_best("val_loss", 2)]
    model = torch.nn.Linear(3, 3)
    state = TrainState(model=model)
    with _manager(url, keep_last=1, keep=rules) as mgr:
        for step in range(1, 9):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(state, step=step, metrics={"val_loss": float(step)})
            assert [c.step for c in mgr.list()] == sorted({1, min(2, step), step})
        last = model.weight.detach().clone()
        assert mgr.kept() == {1: ("best val_loss #1",), 2: ("best val_loss #2",), 8: ("latest", "newest")}
    fresh = torch.nn.Linear(3, 3)
    with _manager(url, keep_last=1, keep=rules) as mgr:
        pos = mgr.restore(TrainState(model=fresh))
        assert pos is not None and pos.step == 8
        assert torch.equal(fresh.weight, last)
        assert mgr.best("val_loss").step == 1  # type: ignore[union-attr]


def test_a_zombies_checkpoint_is_never_best(tmp_path):
    """A writer commits step 6 (the best val_loss ever) just after a newcomer took over from step
    5: that folder is a zombie's orphan. best() ignores it, the rules never keep it as best, and
    gc removes it as an orphan; the newcomer's own best survives."""
    url = f"memory://zombie-best-{uuid.uuid4().hex}"
    state = TrainState(model=torch.nn.Linear(1, 1))
    rules = [retention.keep_best("val_loss", 1)]
    zombie = _manager(url, keep_last=1, keep=rules)
    newcomer: list[CheckpointManager] = []

    def take_over_before_the_commit(op: str, key: str, _n: int) -> BaseException | None:
        if op == "write" and key.startswith("step-0000000006.") and key.endswith("/manifest.json") and not newcomer:
            newcomer.append(_manager(url, keep_last=1, keep=rules, force=True))
            newcomer[0].restore(state)  # resumes from step 5: 6 is not committed yet
        return None

    try:
        for step, loss in ((4, 0.4), (5, 0.5)):
            zombie.save(state, step=step, metrics={"val_loss": loss})
        zombie.backend = FaultyBackend(zombie.backend, fail_on=take_over_before_the_commit)
        zombie.save(state, step=6, metrics={"val_loss": -100.0})  # commits, then rotation sees epoch 2
        mgr = newcomer[0]
        orphan = next(c for c in mgr.reader.scan().checkpoints if c.step == 6)
        assert orphan.committed and orphan.orphan and not orphan.valid
        mgr.save(state, step=7, metrics={"val_loss": 0.7})
        assert mgr.best("val_loss").step == 4  # type: ignore[union-attr]
        assert mgr.kept() == {4: ("best val_loss #1",), 7: ("latest", "newest")}
        report = mgr.gc()
        assert [k for k in report.deleted if k.startswith("step-0000000006.")] == [orphan.key]
        assert [c.step for c in mgr.list()] == [4, 7]
        assert mgr.load(step=4) is not None  # the best stays readable
    finally:
        for m in (zombie, *newcomer):
            with contextlib.suppress(LeaseLostError):
                m.close()
        MemoryBackend.discard_store(url.removeprefix("memory://"))


def test_keep_takes_rules_only():
    with pytest.raises(ConfigError, match="keep= takes keep rules"):
        CheckpointManager(f"memory://keep-{uuid.uuid4().hex}", keep=["val_loss"], read_only=True)  # type: ignore[list-item]


def test_decide_settle_beyond_the_steps_keeps_them_all_and_rules_cannot_invent_steps():
    cands = [_c(1), _c(2)]
    assert retention.decide(cands, [retention.keep_last(1)], settle=3).kept == {1: ("settling",), 2: ("newest",)}
    d = retention.decide(cands, [retention.keep_if(lambda c: True), lambda _cands: {99: "made up"}])
    assert d.kept == {1: ("custom",), 2: ("custom", "newest")} and d.deleted == []


def test_gc_names_the_rules_that_let_a_checkpoint_go(tmp_path):
    url = str(tmp_path / "run")
    state = TrainState(model=torch.nn.Linear(1, 1))
    with _manager(url, keep_last=4) as mgr:  # keeps all four: gc then decides alone
        for step, loss in ((1, 0.1), (2, 0.5), (3, 0.9), (4, 0.8)):
            mgr.save(state, step=step, metrics={"val_loss": loss})
        report = mgr.gc(keep_last=1, keep=[retention.keep_best("val_loss", 1)], dry_run=True)
    assert report.reasons == {
        "step-0000000002.e1": "no rule keeps it (keep_last=1, keep_best=1 by val_loss (min))",
        "step-0000000003.e1": "no rule keeps it (keep_last=1, keep_best=1 by val_loss (min))",
    }
