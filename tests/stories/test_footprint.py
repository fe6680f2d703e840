"""Storage footprint: one row per step, leftovers that can never commit, bytes by kind.

The catalog's pure decisions are tested on hand-aged folders; what rotation and gc do with them,
the anchor's cost and the SIGKILL runs on every backend live in tests/stories/test_leftovers.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, Retention, TrainState
from ckptsdk.backends import open_backend
from ckptsdk.checkpoint.pruning.usage import record_trash, usage
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.format.layout import TENSORS, checkpoint_dir
from ckptsdk.manager import Simulation


def _state() -> TrainState:
    torch.manual_seed(0)
    return TrainState(model=torch.nn.Linear(16, 16))


def _age(root, folder: str, seconds: float) -> None:
    """Make every file of ``folder`` look ``seconds`` older (the store's time, as a crash leaves it)."""
    for name in os.listdir(root / folder):
        path = root / folder / name
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def _unclean_takeover(url: str) -> None:
    """e1 saves 1 and 2 and dies without releasing; e2 breaks the lease, restores (anchoring 2).

    On local disk the anchor is a hard link, and replaces e1's folder of step 2 at e2's next save;
    on Drive (no cheap copy, late consistency) both stay until rotation lets step 2 go."""
    state = _state()
    # A long ttl: without a heartbeat only saves renew, and two saves on a loaded machine can take
    # longer than 5 s (the fresh-clone run saw "no renewal for 6.3 s"); the takeover forces anyway.
    first = CheckpointManager(
        url, keep_last=3, lease_options=LeaseOptions(ttl=120), _simulation=Simulation(heartbeat=False)
    )
    first.save(state, step=1)
    first.save(state, step=2)
    first._shutdown._closed = True  # dies: never closes, never releases its lease
    second = CheckpointManager(url, keep_last=3, lease_options=LeaseOptions(ttl=5, force=True))
    assert second.restore(state).step == 2
    second.close()


def test_rows_show_each_step_once_with_the_anchor_marked(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    url = "drive://r"
    _unclean_takeover(url)
    cat = scan(open_backend(url))
    assert sorted((c.step, c.epoch) for c in cat.checkpoints) == [(1, 1), (2, 1), (2, 2)]
    rows = cat.rows()
    e1_of_2 = next(c.key for c in cat.checkpoints if (c.step, c.epoch) == (2, 1))
    assert [(r.step, r.epoch, r.anchor, r.copies) for r in rows] == [(1, 1, False, ()), (2, 2, True, (e1_of_2,))]
    assert [(r.step, r.epoch) for r in CheckpointManager(url, read_only=True).list()] == [(1, 1), (2, 2)]
    # On local disk the anchor replaces e1's folder of step 2 at e2's next save.
    local = str(tmp_path / "local")
    _unclean_takeover(local)
    assert [(c.step, c.epoch, c.anchor) for c in scan(open_backend(local)).checkpoints] == [
        (1, 1, False),
        (2, 1, False),
        (2, 2, True),
    ]
    with CheckpointManager(local, keep_last=3, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.restore(_state())
        mgr.save(_state(), step=3)
    # e3 anchored 2 too
    assert [(c.step, c.epoch) for c in scan(open_backend(local)).checkpoints] == [(1, 1), (2, 3), (3, 3)]


def test_leftovers_rules(tmp_path):
    """A superseded writer's uncommitted folder goes at once under an exclusive lease, else after
    the grace by the store's own times; the live writer's busy folder and a newer writer's never."""
    root = tmp_path / "r"
    b = open_backend(str(root))
    for step, epoch in ((3, 1), (4, 2), (5, 2), (6, 3)):
        b.write(f"{checkpoint_dir(step, epoch)}/{TENSORS}", b"x" * 100 * step)
    b.write("lineage/epoch-000002.json.tmp-not-a-record", b"")  # ignored by the catalog
    _age(root, checkpoint_dir(3, 1), 7200)
    cat = scan(b)
    assert all(not c.committed for c in cat.checkpoints)

    def keys(**kw):  # type: ignore[no-untyped-def]
        return sorted(c.key for c, _why in cat.leftovers(**kw))

    # the live writer is e2, saving step 5 now; e3's folder belongs to a newer writer
    assert keys(rank=(2, ""), grace=3600, exclusive=True, busy=[checkpoint_dir(5, 2)]) == [
        checkpoint_dir(3, 1),
        checkpoint_dir(4, 2),
    ]
    assert keys(rank=(2, ""), grace=3600, exclusive=False, busy=[checkpoint_dir(5, 2)]) == [
        checkpoint_dir(3, 1),
        checkpoint_dir(4, 2),
    ]  # own: at once; the lower writer's: aged
    assert keys(rank=(2, ""), grace=9000, exclusive=False, busy=[checkpoint_dir(5, 2)]) == [checkpoint_dir(4, 2)]
    assert keys(rank=None, grace=3600, exclusive=False) == [checkpoint_dir(3, 1)]
    assert keys(rank=None, grace=0, exclusive=False) == sorted(c.key for c in cat.checkpoints)
    why = dict((c.key, w) for c, w in cat.leftovers(rank=(2, ""), grace=3600, exclusive=False))
    assert "superseded" in why[checkpoint_dir(3, 1)] and "7200 s" in why[checkpoint_dir(3, 1)]
    assert "own" in why[checkpoint_dir(4, 2)]
    # Ages come from the store's times, not this machine's clock: the reference is the newest object.
    assert cat.store_now() == max(c.mtime for c in cat.checkpoints)


def test_leftovers_without_store_times_wait_for_an_exclusive_lease(tmp_path):
    """A store that reports no time never has a leftover judged old: only the lease removes it."""
    b = open_backend("memory://footprint-notime")
    b.write(f"{checkpoint_dir(1, 1)}/{TENSORS}", b"x")
    cat = scan(b)
    stripped = [c.__class__(**{**c.__dict__, "mtime": None}) for c in cat.checkpoints]
    cat = cat.__class__(
        checkpoints=stripped, lineage=cat.lineage, resume_points=cat.resume_points, max_rank=cat.max_rank
    )
    assert cat.leftovers(rank=None, grace=0, exclusive=False) == []
    assert [c.key for c, _ in cat.leftovers(rank=(2, ""), grace=0, exclusive=True)] == [checkpoint_dir(1, 1)]


def test_du_counts_each_kind_and_hard_links_once(tmp_path, monkeypatch):
    """Until the anchoring writer saves again, the anchor and the folder it copies are a
    hard-linked duplicate on local disk: counted by kind, held once."""
    url = str(tmp_path / "r")
    _unclean_takeover(url)
    b = open_backend(url)
    b.write(f"{checkpoint_dir(9, 1)}/{TENSORS}", b"y" * 1000)  # a killed save of the superseded e1
    u = usage(b)
    cat = scan(b)
    size = {c.key: c.size for c in cat.checkpoints}
    assert u.folders["committed"] == [checkpoint_dir(1, 1)]
    assert u.folders["anchor"] == [checkpoint_dir(2, 2)]
    assert u.folders["duplicate"] == [checkpoint_dir(2, 1)]
    assert u.folders["uncommitted"] == [checkpoint_dir(9, 1)]
    assert (u.committed, u.anchor, u.duplicate, u.uncommitted) == (
        size[checkpoint_dir(1, 1)],
        size[checkpoint_dir(2, 2)],
        size[checkpoint_dir(2, 1)],
        1000,
    )
    # The anchor on local disk is a hard link of e1's tensor file: held once.
    tensors = os.path.getsize(tmp_path / "r" / checkpoint_dir(2, 1) / TENSORS)
    assert u.shared == tensors
    assert u.total == sum(size.values()) - tensors
    assert u.trash_bytes is None  # no trash on a local disk


def test_du_on_drive_sums_recent_trash_ledgers(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    b = open_backend("drive://run")
    b.write(f"{checkpoint_dir(1, 1, 'ab12cd34')}/{TENSORS}", b"z" * 10)
    record_trash(b, (1, "ab12cd34"), total_bytes=5000, files=2)
    record_trash(b, (2, "00ff00ff"), total_bytes=7000, files=3)
    old = tmp_path / "run" / "trash" / "epoch-000002.00ff00ff.json"
    st = os.stat(old)
    os.utime(old, ns=(st.st_atime_ns, st.st_mtime_ns - int(31 * 86400 * 1e9)))  # emptied by Drive by now
    u = usage(b)
    assert (u.trash_bytes, u.trash_files) == (5000, 2)


def test_trash_ledgers_of_the_previous_version_are_still_read(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    b = open_backend("drive://run")
    # What the previous ckptsdk wrote: no "format", a "+00:00" time.
    b.write(
        "trash/epoch-000001.ab12cd34.json",
        b'{"bytes": 5000, "files": 2, "updated_at": "2026-11-30T06:10:00.123456+00:00"}',
    )
    record_trash(b, (2, "00ff00ff"), total_bytes=7000, files=3)
    new = json.loads(b.read("trash/epoch-000002.00ff00ff.json"))
    assert new["format"] == "ckptsdk.trash/1.0" and new["updated_at"].endswith("Z")
    assert (usage(b).trash_bytes, usage(b).trash_files) == (12000, 5)
    b.write("trash/epoch-000003.ffffffff.json", b'{"format": "ckptsdk.trash/2.0", "bytes": 1, "files": 1}')
    assert usage(b).trash_bytes == 12000  # a newer major version's ledger is skipped, not misread


@pytest.mark.parametrize("argv_json", [False, True])
def test_du_command(tmp_path, capsys, argv_json, monkeypatch):
    from ckptsdk.cli import main

    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    url = "drive://r"
    _unclean_takeover(url)
    code = main(["du", url] + (["--json"] if argv_json else []))
    out = capsys.readouterr().out
    assert code == 0
    if argv_json:
        doc = json.loads(out)
        assert [k.split(".")[1] for k in doc["folders"]["anchor"]] == ["e2"] and doc["bytes"]["total"] > 0
        assert doc["trash_bytes"] == 0  # nothing deleted yet
    else:
        assert "anchor" in out and "duplicate" in out and "total" in out
    assert main(["ls", url]) == 0
    listing = capsys.readouterr().out
    assert "sizes ok (anchor, +1 copy)" in listing and [x.split()[0] for x in listing.splitlines()[1:3]] == ["1", "2"]
    assert "2 steps under" in listing  # step 2 shown once, though two folders hold it


def test_gc_dry_run_lists_leftovers_with_age_bytes_and_the_drive_trash(tmp_path, monkeypatch, capsys):
    from ckptsdk.cli import main

    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    url = "drive://r"
    with CheckpointManager(
        url, retention=Retention(keep_last=1, mode="delete"), lease_options=LeaseOptions(ttl=5, settle=0)
    ) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(_state(), step=step)
        assert [c.step for c in mgr.list()] == [3, 4]  # one save late on Drive
    dead = checkpoint_dir(9, 1, "0badcafe")
    b = open_backend(url)
    b.write(f"{dead}/{TENSORS}", b"t" * 5000)  # a killed save of a superseded writer
    _age(tmp_path / "r", dead, 7200)
    before = sorted(o.key for o in b.list(""))
    assert main(["gc", url, "--dry-run", "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith(dead))
    assert "4.9 KiB" in line and "silent for 72" in line and "grace 3600 s" in line
    assert "Drive trash: these deletes send 0.0 MiB" in out and "already sent" in out
    assert "Per 100 saves" in out and "manifests only" in out
    assert sorted(o.key for o in b.list("")) == before  # a dry run deletes nothing
    assert main(["gc", url, "--dry-run", "--keep-last", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sizes"][dead] == 5000 and doc["trash_bytes"] == 5000
    assert sorted(doc["deleted"]) == [dead]  # keep_last=1 keeps 2 steps on Drive (one save late)
    assert main(["gc", url, "--keep-last", "1"]) == 0
    assert not b.exists(f"{dead}/{TENSORS}")


def test_lease_says_whether_it_took_over_a_released_lease():
    """What the anchor rule reads: a fresh root or a broken lease is not a clean handover."""
    from ckptsdk.lease.acquire import Lease

    b = open_backend("memory://footprint-handover")
    first = Lease(b, ttl=5)
    first.acquire()
    assert not first.clean_handover  # a fresh root: nobody released anything
    first.release()
    second = Lease(b, ttl=5)
    second.acquire()
    assert second.clean_handover
    third = Lease(b, ttl=5, force=True)  # breaks a live lease: its holder may still be running
    third.acquire()
    assert not third.clean_handover
    third.release()


def test_recycle_failing_mid_rewrite_keeps_the_newest_and_cleans_up(tmp_path, monkeypatch):
    """Drive's ring: a rewrite in place that fails leaves the newest checkpoints intact (only the
    one retention had already let go is gone); the next save removes the half-written folder."""
    from ckptsdk.errors import BackendError
    from ckptsdk.testing import FaultyBackend

    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    state = _state()
    mgr = CheckpointManager("drive://r", keep_last=1, lease_options=LeaseOptions(ttl=60, settle=0))
    for step in (1, 2, 3):
        mgr.save(state, step=step)
    assert [c.step for c in mgr.list()] == [2, 3]
    mgr.backend = FaultyBackend(
        mgr.backend,
        fail_on=lambda op, key, n: BackendError("No space left on device", key=key) if op == "overwrite" else None,
    )
    with pytest.raises(BackendError) as err:
        mgr.save(state, step=4)
    assert "No space left" in str(err.value)
    cat = scan(open_backend("drive://r"))
    assert [(c.step, c.valid) for c in cat.rows() if c.committed] == [(3, True)]
    assert [c.step for c in cat.checkpoints if not c.committed] == [4]  # step 2's file, moved there
    assert CheckpointManager("drive://r", read_only=True).load(step=3) is not None  # digests hold
    mgr.backend = mgr.backend.inner
    mgr.save(state, step=5)
    assert mgr.wait(timeout=60)  # rotation (the leftover's removal) follows a sync save on the worker
    cat = scan(open_backend("drive://r"))
    assert [c.step for c in cat.checkpoints] == [3, 5]  # the failed save's folder went at once: ours
    mgr.close()
