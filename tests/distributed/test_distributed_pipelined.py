"""A non-blocking distributed save copies at ``save()`` only what changes before the next step.

One real 2-rank gloo job (``_pipelined_child.py``: a DTensor-sharded Linear with SGD momentum and
a replicated Linear with Adam and a 40,000-float buffer, on a CPU mesh) runs every scenario on
fresh roots; the tests read its results. The background copy is held (staging's memcpy waits off
the main thread) or the commit is gated, so each scenario is deterministic: no timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

# One worker runs them all: each reads the results of the one module-scoped job (two ranks, every
# scenario, ~80 s), which every worker given one of them ran again for itself.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400), pytest.mark.xdist_group("distributed-pipelined")]

REPO = Path(__file__).resolve().parents[2]

BROKEN = [
    "add_-under-no_grad",
    "copy_",
    "detach-then-mul_",
    "a-slice-fill_",
    "nn.init",
    "foreach_add_",
    "set_",
    "model.load_state_dict",
    "other-optimizer-foreach",
    "other-optimizer-for-loop",
]
SCENARIOS: list[dict[str, Any]] = [
    {"kind": "exact", "name": "exact"},
    *({"kind": "broken", "name": f"broken-{how}", "how": how, "editor": 1} for how in BROKEN),
    {"kind": "broken", "name": "broken-on-rank-0", "how": "add_-under-no_grad", "editor": 0},
    {"kind": "broken", "name": "broken-dtensor", "how": "dtensor-add_", "editor": 1},
    {"kind": "broken", "name": "broken-optimizer-state", "how": "optimizer-state", "editor": 1},
    {"kind": "broken", "name": "broken-after-copy", "how": "after-copy:add_-under-no_grad", "editor": 1},
    *(
        {"kind": "broken", "name": f"replaced-{how}", "how": how, "editor": 1}
        for how in ("data-assigned", "new-parameter", "optimizer.load_state_dict")
    ),
    *(
        {"kind": "broken", "name": f"copy-{how}", "how": how, "editor": 1, "snapshot": "copy"}
        for how in ("add_-under-no_grad", "data-add_", "dtensor-add_")
    ),
]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipelined")
    init = out / f"store-{uuid.uuid4().hex[:8]}"
    procs = []
    logs = []
    for rank in (0, 1):
        cfg = {"rank": rank, "world": 2, "init": str(init), "out": str(out), "scenarios": SCENARIOS}
        log = open(out / f"log-{rank}.txt", "w")  # noqa: SIM115 -- closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.distributed._pipelined_child", json.dumps(cfg)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        )
    try:
        codes = [p.wait(360) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        for log in logs:
            log.close()
    text = "\n".join(f"--- rank {r}\n{(out / f'log-{r}.txt').read_text()[-4000:]}" for r in (0, 1))
    assert codes == [0, 0], text
    return out


def _results(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}-{rank}.json").read_text()) for rank in (0, 1)]


def test_training_right_after_an_async_save_restores_the_state_at_save_bit_exactly(job: Path) -> None:
    for res in _results(job, "exact"):
        at_save = res["at_save"]
        step, restored = res["async"]
        block_step, blocked = res["block"]
        assert step == block_step == 3
        # Parameters (DTensor shards and replicated), SGD momentum, Adam moments and steps, the buffer.
        assert len(at_save) == 13 and "plain.model.stat" in at_save
        assert restored == at_save, [k for k in at_save if restored.get(k) != at_save[k]]
        assert blocked == restored  # what a blocking save of the same state restores


def test_the_pause_copies_only_what_the_next_step_does_not_wait_for(job: Path) -> None:
    for res in _results(job, "exact"):
        # On the training thread, before the step: the 40,000-float buffer only (160,000 bytes).
        assert res["pause_step_only"] == [False] and res["pause_bytes"] == 160_000
        assert res["snapshot"] == {"at_save": 160_000, "deferred": res["step_only_bytes"]}
        # Every parameter and optimizer-state tensor was copied by the worker, nothing else.
        assert res["background_step_only"] and all(res["background_step_only"])
        assert res["background_bytes"] == res["step_only_bytes"] > 700_000


def _assert_failed_everywhere_and_intact(job: Path, name: str, tensor: str) -> None:
    for rank, res in enumerate(_results(job, name)):
        error = res["error"]
        assert error is not None, f"rank {rank}: the save of step 2 committed"
        assert error["type"] == "CheckpointError", error
        message = error["message"]
        assert f"the pipelined snapshot's rule was broken: {tensor!r} was changed in place" in message
        assert 'DistributedCheckpointManager(..., save_options=SaveOptions(snapshot="copy"))' in message
        assert "the previous checkpoint is intact" in message and "the save of step 2 under" in message
        assert res["restored_step"] == 1  # nothing committed: the previous checkpoint is the newest
        assert res["restored"] == res["first"], [k for k in res["first"] if res["restored"].get(k) != res["first"][k]]


@pytest.mark.parametrize("how", BROKEN)
def test_an_edit_of_a_parameter_on_one_rank_fails_the_save_on_every_rank(job: Path, how: str) -> None:
    _assert_failed_everywhere_and_intact(job, f"broken-{how}", "plain.model.weight")


@pytest.mark.parametrize(
    ("name", "tensor"),
    [
        ("broken-on-rank-0", "plain.model.weight"),
        ("broken-dtensor", "dt.model.weight"),
        ("broken-optimizer-state", "plain.optim.state.weight.exp_avg"),
        ("broken-after-copy", "plain.model.weight"),
    ],
)
def test_other_breaks_fail_the_save_on_every_rank(job: Path, name: str, tensor: str) -> None:
    """The coordinator's edit, a DTensor shard's, an Adam moment's, and an edit made after the
    copy but before the commit (the first held step records the counters the commit compares)."""
    _assert_failed_everywhere_and_intact(job, name, tensor)


@pytest.mark.parametrize("how", ["data-assigned", "new-parameter", "optimizer.load_state_dict"])
def test_a_replaced_storage_leaves_the_snapshot_exact(job: Path, how: str) -> None:
    """Replacing a tensor (not editing its storage) breaks the rule harmlessly: the snapshot reads
    the storage the tensor had at save(), so the save commits the values of save()."""
    for res in _results(job, f"replaced-{how}"):
        assert res["error"] is None and res["restored_step"] == 2
        assert res["restored"] == res["at_save"]


@pytest.mark.parametrize("how", ["add_-under-no_grad", "data-add_", "dtensor-add_"])
def test_snapshot_copy_is_exact_whatever_the_edit(job: Path, how: str) -> None:
    for res in _results(job, f"copy-{how}"):
        assert res["error"] is None and res["restored_step"] == 2
        assert res["restored"] == res["at_save"]
