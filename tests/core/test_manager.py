"""CheckpointManager: verified restore, corruption handling, rotation, lineage, async saves."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import ckptsdk
from ckptsdk import CheckpointManager, LeaseOptions, Retention, TrainState
from ckptsdk.errors import (
    BackendError,
    ConfigError,
    CorruptCheckpointError,
    LeaseLostError,
    NoValidCheckpointError,
    StateMismatchError,
)
from ckptsdk.format.document import seal
from ckptsdk.format.layout import MANIFEST, TENSORS, checkpoint_dir
from ckptsdk.testing import FaultyBackend


def make_state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    return TrainState(model=model, optimizer=opt, scheduler=sched)


def train(state: TrainState, steps: int) -> list[float]:
    model, opt, sched = state.objects["model"], state.objects["optimizer"], state.objects["scheduler"]
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8)
        noise = float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean() + noise * 0.0
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def flat(state: TrainState) -> dict[str, torch.Tensor]:
    tensors, _ = ckptsdk.format.codec.encode(state.state_dict()["objects"])
    return tensors


def assert_same(a: TrainState, b: TrainState) -> None:
    ta, tb = flat(a), flat(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def open_mgr(url, options, **kw) -> CheckpointManager:
    kw.setdefault("lease_options", LeaseOptions(ttl=5.0))
    return CheckpointManager(url, storage_options=options, **kw)


def test_round_trip_and_continue_identically(backend_url):
    url, options = backend_url.url, backend_url.options
    a = make_state()
    train(a, 3)
    with open_mgr(url, options) as mgr:
        assert mgr.restore(a) is None
        info = mgr.save(a, step=3, epoch=0, batch_idx=3, metrics={"loss": 1.5}, tags={"data_hash": "abc"})
        assert info.committed and info.step == 3
    after_save = train(a, 3)

    b = make_state(seed=123)
    with open_mgr(url, options) as mgr:
        pos = mgr.restore(b)
        assert (pos.step, pos.epoch, pos.batch_idx) == (3, 0, 3)
        assert pos.metrics == {"loss": 1.5} and pos.tags == {"data_hash": "abc"}
    assert train(b, 3) == after_save  # RNG streams and optimizer state came back exactly
    assert_same(a, b)


def test_save_never_draws_from_global_rngs(tmp_path):
    state = make_state()
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    with CheckpointManager(str(tmp_path / "r"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(state, step=1)
        mgr.save(state, step=2, blocking=False)
        mgr.wait()
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


@pytest.mark.parametrize(
    "damage",
    ["flip_byte", "truncate", "delete_tensors", "junk_manifest", "future_format", "wrong_type"],
)
def test_corrupt_newest_is_skipped_and_previous_restored(tmp_path, caplog, damage):
    root = tmp_path / "run"
    state = make_state()
    with CheckpointManager(str(root), keep_last=5, lease_options=LeaseOptions(ttl=5)) as mgr:
        train(state, 1)
        mgr.save(state, step=1)
        good = {k: v.clone() for k, v in flat(state).items()}
        train(state, 1)
        mgr.save(state, step=2)
    newest = root / checkpoint_dir(2, 1)
    tensors, manifest = newest / TENSORS, newest / MANIFEST
    if damage == "flip_byte":
        data = bytearray(tensors.read_bytes())
        data[len(data) // 2] ^= 0x01
        tensors.write_bytes(bytes(data))
    elif damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:-10])
    elif damage == "delete_tensors":
        tensors.unlink()
    elif damage == "junk_manifest":
        manifest.write_bytes(b"{not json")
    elif damage == "future_format":
        manifest.write_text(manifest.read_text().replace('"ckptsdk.checkpoint/1', '"ckptsdk.checkpoint/9'))
    elif damage == "wrong_type":
        manifest.write_text(manifest.read_text().replace('"step":2', '"step":"two"', 1))
    kept_bytes = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and "step-" in str(p)}

    restored = make_state(seed=5)
    caplog.set_level(logging.WARNING, logger="ckptsdk")
    with CheckpointManager(str(root), lease_options=LeaseOptions(ttl=5)) as mgr:
        pos = mgr.restore(restored)
        assert pos.step == 1
    assert any(checkpoint_dir(2, 1) in r.getMessage() for r in caplog.records), caplog.text
    tensors_now, _ = ckptsdk.format.codec.encode(restored.state_dict()["objects"])
    assert all(torch.equal(good[k], tensors_now[k]) for k in good)
    # Nothing was deleted or rewritten by a restore (the anchor adds a new folder only).
    for p, data in kept_bytes.items():
        assert p.read_bytes() == data


def test_verify_and_the_cli_share_one_check(tmp_path):
    """``verify()`` raises what ``check()`` (the verdict ``ckptsdk verify`` prints) reports."""
    url = str(tmp_path / "r")
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        for step in (1, 2):
            mgr.save(make_state(), step=step)
    reader = CheckpointManager(url, read_only=True)
    assert [(v.status, v.reason, v.rehashed) for v in map(reader.check, reader.list())] == [("ok", None, True)] * 2
    path = tmp_path / "r" / checkpoint_dir(2, 1) / TENSORS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as info:
        reader.verify(2)
    verdict = reader.check(reader.list()[1])
    assert (verdict.status, verdict.reason, verdict.rehashed) == ("CORRUPT", str(info.value), True)
    assert reader.verify(1).step == 1 and reader.verify(key=checkpoint_dir(1, 1)).key == checkpoint_dir(1, 1)


def test_no_valid_checkpoint_left_raises_with_each_reason(tmp_path):
    root = tmp_path / "run"
    state = make_state()
    with CheckpointManager(str(root), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(state, step=1)
    (root / checkpoint_dir(1, 1) / TENSORS).write_bytes(b"junk")
    with CheckpointManager(str(root), lease_options=LeaseOptions(ttl=5)) as mgr:
        with pytest.raises(NoValidCheckpointError) as err:
            mgr.restore(make_state())
    assert checkpoint_dir(1, 1) in err.value.tried
    assert "torn" in err.value.tried[checkpoint_dir(1, 1)]
    assert (root / checkpoint_dir(1, 1) / MANIFEST).exists()  # nothing was deleted


def test_rotation_keep_last_three_over_twenty_saves(tmp_path):
    state = make_state()
    with CheckpointManager(
        str(tmp_path / "r"), retention=Retention(keep_last=3, keep_every=10), lease_options=LeaseOptions(ttl=5)
    ) as mgr:
        for step in range(1, 21):
            mgr.save(state, step=step)
        steps = [c.step for c in mgr.list()]
    assert steps == [10, 18, 19, 20]


def test_resumed_from_survives_until_a_newer_one_is_committed(tmp_path):
    url = str(tmp_path / "r")
    state = make_state()
    with CheckpointManager(url, keep_last=1, lease_options=LeaseOptions(ttl=5)) as mgr:
        for step in (1, 2, 3):
            mgr.save(state, step=step)
        assert [c.step for c in mgr.list()] == [3]
    with CheckpointManager(url, keep_last=1, lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(state).step == 3
        mgr.wait()
        # the takeover re-committed step 3 under epoch 2 (the anchor, a hard link); one row per step
        assert {(c.step, c.epoch) for c in mgr.list()} == {(3, 2)}
        mgr.save(state, step=4)
        assert [(c.step, c.epoch) for c in mgr.list()] == [(4, 2)]


def test_failed_save_deletes_nothing(tmp_path):
    url = str(tmp_path / "r")
    state = make_state()
    with CheckpointManager(url, keep_last=2, lease_options=LeaseOptions(ttl=5)) as mgr:
        for step in (1, 2):
            mgr.save(state, step=step)
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "r").rglob("*") if "step-" in str(p))

    mgr = CheckpointManager(url, keep_last=2, lease_options=LeaseOptions(ttl=5))
    mgr.restore(state)
    mgr.wait()  # the takeover anchor is written in the background
    before_after_anchor = {c.key for c in mgr.list()}
    mgr.backend = FaultyBackend(
        mgr.backend,
        fail_on=lambda op, key, n: (
            BackendError("No space left on device", key=key) if op == "write" and key.endswith(TENSORS) else None
        ),
    )
    with pytest.raises(BackendError) as err:
        mgr.save(state, step=3)
    assert "No space left" in str(err.value)
    assert {c.key for c in mgr.list()} == before_after_anchor
    mgr.close()
    after = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "r").rglob("*") if "step-" in str(p))
    assert set(before) <= set(after)


def test_restore_in_a_fresh_process_is_bit_identical(tmp_path):
    url = str(tmp_path / "r")
    state = make_state()
    train(state, 2)
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(state, step=2)
    out = tmp_path / "child.safetensors"
    code = textwrap.dedent(f"""
        import torch, safetensors.torch, ckptsdk
        from tests.core.test_manager import make_state
        s = make_state(seed=99)
        with ckptsdk.CheckpointManager({url!r}, lease_options=ckptsdk.LeaseOptions(ttl=5)) as m:
            assert m.restore(s).step == 2
        t, _ = ckptsdk.format.codec.encode(s.state_dict()["objects"])
        safetensors.torch.save_file({{k: v.contiguous() for k, v in t.items()}}, {str(out)!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=os.getcwd())
    import safetensors.torch

    child = safetensors.torch.load_file(str(out))
    mine = flat(state)
    assert child.keys() == mine.keys()
    assert all(torch.equal(child[k], mine[k]) for k in mine)


def test_mismatched_model_gives_clear_error(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(make_state(), step=1)
    wrong = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        with pytest.raises(StateMismatchError) as err:
            mgr.restore(
                TrainState(
                    model=wrong,
                    optimizer=torch.optim.SGD(wrong.parameters(), lr=0.1),
                    scheduler=make_state().objects["scheduler"],
                )
            )
    assert any("0.weight" in m for m in err.value.mismatches)


def test_zombie_orphans_are_ignored_and_zombie_is_fenced(tmp_path):
    url = str(tmp_path / "r")
    state = make_state()
    zombie = CheckpointManager(url, keep_last=2, lease_options=LeaseOptions(ttl=5))
    for step in (1, 2):
        zombie.save(state, step=step)
    newcomer = CheckpointManager(url, keep_last=2, lease_options=LeaseOptions(ttl=5, force=True))
    assert newcomer.restore(make_state()).step == 2
    # The zombie has not noticed yet; its next save writes its tensor file, then its one
    # renewal (the fence, right before the commit) fails: it must not commit.
    with pytest.raises(LeaseLostError):
        zombie.save(state, step=3)
    assert not (tmp_path / "r" / checkpoint_dir(3, 1) / MANIFEST).exists()
    newcomer.save(state, step=3)
    steps = {(c.step, c.epoch) for c in newcomer.list() if c.valid}
    assert (3, 2) in steps and (2, 2) in steps
    newcomer.close()
    zombie.close()


def test_orphan_written_after_takeover_is_never_restored(tmp_path):
    """A zombie that commits before it notices the takeover leaves an orphan; restore skips it."""
    url = str(tmp_path / "r")
    state = make_state()
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as first:
        first.save(state, step=1)
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as second:
        second.restore(state)
    # Simulate the zombie's late commit: an epoch-1 checkpoint past epoch 2's resume point.
    src, dst = tmp_path / "r" / checkpoint_dir(1, 1), tmp_path / "r" / checkpoint_dir(5, 1)
    dst.mkdir()
    (dst / TENSORS).write_bytes((src / TENSORS).read_bytes())
    (dst / MANIFEST).write_bytes(seal({**json.loads((src / MANIFEST).read_text()), "step": 5}))
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as third:
        orphan = next(c for c in third.list() if c.key == checkpoint_dir(5, 1))
        assert orphan.orphan and not orphan.valid and "orphan" in orphan.reason
        assert third.restore(make_state()).step == 1
        report = third.gc(dry_run=True)
        assert checkpoint_dir(5, 1) in report.deleted and dst.exists()
        third.gc()
        assert not dst.exists()


def test_async_and_sync_saves_restore_identically(tmp_path):
    state = make_state()
    train(state, 2)
    with CheckpointManager(str(tmp_path / "a"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(state, step=2, blocking=False)
    with CheckpointManager(str(tmp_path / "s"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(state, step=2)
    a, s = make_state(1), make_state(2)
    with CheckpointManager(str(tmp_path / "a"), read_only=True) as mgr:
        tree_a = mgr.load()
    with CheckpointManager(str(tmp_path / "s"), read_only=True) as mgr:
        tree_s = mgr.load()
    a.load_state_dict(tree_a)
    s.load_state_dict(tree_s)
    assert_same(a, s)
    assert_same(a, state)


def test_async_snapshot_is_taken_at_save_time(tmp_path):
    state = make_state()
    with CheckpointManager(
        str(tmp_path / "r"), keep_last=10, lease_options=LeaseOptions(ttl=5), async_save=True
    ) as mgr:
        expected = {}
        for i in range(5):  # rapid saves never wait: one writes, the newest waits (replacing another)
            expected[i + 1] = {k: v.clone() for k, v in flat(state).items()}
            mgr.save(state, step=i + 1)
            train(state, 1)  # mutates parameters while the background write runs
        mgr.wait()
        committed = [c.step for c in mgr.list() if c.valid]
        assert committed[-1] == 5 and mgr.stats.committed + mgr.stats.replaced == 5
        trees = {step: mgr.load(step=step) for step in committed}
    for step, tree in trees.items():
        got, _ = ckptsdk.format.codec.encode(tree["objects"])
        assert all(torch.equal(got[k], expected[step][k]) for k in expected[step]), step


def test_background_failure_surfaces_on_next_call(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "r"), lease_options=LeaseOptions(ttl=5))
    state = make_state()
    mgr.save(state, step=1)
    mgr.backend = FaultyBackend(
        mgr.backend,
        fail_on=lambda op, key, n: (
            BackendError("Input/output error", key=key) if op == "write" and key.endswith(TENSORS) else None
        ),
    )
    mgr.save(state, step=2, blocking=False)
    with pytest.raises(BackendError, match="Input/output error"):
        mgr.wait()
    assert [c.step for c in mgr.list() if c.valid] == [1]
    mgr.close()


def test_read_only_never_takes_the_lease_and_refuses_save(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(make_state(), step=1)
        ro = CheckpointManager(url, read_only=True)  # while the writer holds the lease
        assert [c.step for c in ro.list()] == [1]
        with pytest.raises(ConfigError, match="read_only"):
            ro.save(make_state(), step=2)
        ro.close()


def test_a_restore_after_a_save_loads_and_leaves_the_lineage_alone(tmp_path, caplog):
    """Where a writer's lineage starts is fixed by its first save: a later restore() (the
    benchmarks time restores on a writer) loads the newest checkpoint and rewrites nothing, so
    its manifests keep agreeing with its lineage record (no "believing the checkpoints")."""
    url = str(tmp_path / "r")
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(make_state(), step=1)
    state = make_state()
    with (
        CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr,
        caplog.at_level(logging.INFO, logger="ckptsdk"),
    ):
        assert mgr.restore(state).step == 1  # the lineage of epoch 2 starts at step 1
        first = mgr.resumed_from
        for step in (2, 3, 4):
            train(state, 1)
            mgr.save(state, step=step)
            other = make_state(step)
            pos = mgr.restore(other)
            assert (pos.step, pos.lease_epoch) == (step, 2)
            assert_same(other, state)
            assert mgr.resumed_from is first  # unchanged
    resumed = {
        m["writer"]["resumed_from_step"]
        for m in (json.loads((tmp_path / "r" / checkpoint_dir(s, 2) / MANIFEST).read_text()) for s in (3, 4))
    }
    assert resumed == {1}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with CheckpointManager(url, read_only=True) as reader:
        assert [c.step for c in reader.list()] == [2, 3, 4] and reader.latest().step == 4
    assert not [r for r in caplog.records if "believing" in r.getMessage()]


def test_interrupted_first_save_is_a_fresh_start(tmp_path):
    root = tmp_path / "r"
    folder = root / checkpoint_dir(100, 1)
    folder.mkdir(parents=True)
    (folder / TENSORS).write_bytes(b"half a tensor file")  # killed before the manifest
    with CheckpointManager(str(root), lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(make_state()) is None
        [info] = mgr.list()
        assert not info.committed and "uncommitted" in info.reason


@pytest.mark.parametrize("mode", ["delete", "recycle"])
def test_drive_rotation_reports_the_trash_cost(tmp_path, monkeypatch, caplog, mode):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path / "drive"))
    (tmp_path / "drive").mkdir()
    caplog.set_level(logging.INFO, logger="ckptsdk")
    with CheckpointManager(
        "drive://run", retention=Retention(keep_last=1, mode=mode), lease_options=LeaseOptions(ttl=5, settle=0)
    ) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(make_state(), step=step)
        # Drive rotates one save late: the newest may still be uploading when it is committed.
        assert [c.step for c in mgr.list()] == [3, 4]
        assert all(c.tag and c.key.endswith("." + c.tag) for c in mgr.list())  # no CAS: tagged names
        size = mgr.list()[-1].size
        tensors = mgr.list()[-1].manifest.files[0].size
    trash = [r for r in caplog.records if "trash" in r.getMessage() and "MB sent there by this run" in r.getMessage()]
    recycled = [r for r in caplog.records if r.getMessage().startswith("recycled")]
    if mode == "delete":
        assert trash[0].levelno == logging.WARNING and len(trash) == 2 and not recycled
        assert "Retention(mode='recycle')" in trash[0].getMessage()
        assert mgr._rotation.trashed_bytes >= 2 * size
    else:  # steps 1 and 2 gave their tensor files to 3 and 4: only their manifests went to the trash
        assert not trash and len(recycled) == 2
        assert mgr._rotation.trashed_bytes == 0 and mgr._rotation.trashed_files == 2
        assert mgr._rotation.recycled_bytes == 2 * tensors
