"""The ``ckptsdk`` command line on local and GCS roots, run in-process (``cli.main(argv)``).

Roots are made by real training through CheckpointManager: attempt 1 trains steps 1..45 (saves
every 10), attempt 2 restores step 40 and trains 41..60, so steps 41..45 are logged twice. What
only a real process proves (the exit status of ``python -m ckptsdk`` and of the console script,
a reader closing the pipe, no stdin) is in tests/cli/test_cli_first_hour.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from ckptsdk import cli
from ckptsdk.errors import LeaseLostError
from ckptsdk.lease.acquire import read_lease
from ckptsdk.manager import CheckpointManager
from ckptsdk.state import TrainState

KINDS = ["local", pytest.param("gcs", marks=pytest.mark.gcs)]


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """``run_cli(*argv, target=, cwd=)``: ``cli.main`` in this process, its exit code and output
    as a CompletedProcess (``target.env`` set as a child process would get it)."""

    def run(*args: str, target=None, cwd=None) -> subprocess.CompletedProcess[str]:
        for name, value in (getattr(target, "env", {}) or {}).items():
            monkeypatch.setenv(name, value)
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()  # only this command's output
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["ckptsdk", *args], code, out, err)

    return run


def as_json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)  # one JSON document, nothing else on stdout


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(target, last_step: int, *, perturb_from: int | None = None, close: bool = True) -> CheckpointManager:
    """One attempt: restore if possible, train to ``last_step``, log every step, save every 10."""
    model, opt = _model()
    state = TrainState(model=model, optimizer=opt)
    mgr = CheckpointManager(target.url, keep_last=3, save_every=10, storage_options=target.options)
    pos = mgr.restore(state)
    for step in range((pos.step + 1) if pos else 1, last_step + 1):
        g = torch.Generator().manual_seed(step)  # data drawn from (seed, step): resumable
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        if perturb_from is not None and step >= perturb_from:
            x = x + 1e-3
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mgr.log_step(step, loss=loss.detach(), lr=opt.param_groups[0]["lr"])
        if mgr.should_save(step):
            mgr.save(state, step=step, epoch=step // 20, batch_idx=step % 20, metrics={"loss": loss.item()})
    if close:
        mgr.close()
    return mgr


def make_run(target, *, perturb_from: int | None = None):
    train(target, 45)
    train(target, 60, perturb_from=perturb_from)
    return target


def snapshot(target) -> dict[str, str]:
    return {o.key: o.version for o in target.open().list("")}


def flip_byte(backend, key: str, offset: int = -100) -> None:
    data = bytearray(backend.read(key))
    data[offset] ^= 0x01
    backend.write(key, bytes(data))


@pytest.mark.parametrize("kind", KINDS)
def test_every_subcommand(kind, make_backend_target, tmp_path, run_cli):
    target = make_run(make_backend_target(kind))
    url = target.url
    before = snapshot(target)

    ls = run_cli("ls", url, "--json", target=target, cwd=tmp_path)
    assert ls.returncode == 0, ls.stderr
    rows = as_json(ls)["checkpoints"]
    # Attempt 2 re-committed step 40 under its epoch (40.e2, a hard link), which replaced 40.e1
    # at its next save: one row per step.
    assert [(r["step"], r["lease_epoch"], r["attempt"], r["valid"]) for r in rows] == [
        (40, 2, 2, True),
        (50, 2, 2, True),
        (60, 2, 2, True),
    ]
    assert all(r["size"] > 1000 and r["reason"] is None for r in rows)
    assert rows[1]["train_epoch"] == 2 and rows[1]["batch_idx"] == 10

    show = run_cli("show", url, "--step", "50", "--json", target=target, cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    doc = as_json(show)
    assert doc["manifest"]["step"] == 50 and doc["key"] == "step-0000000050.e2"
    tensors = {t["name"]: t for t in doc["tensors"]}
    weight = next(
        t for name, t in tensors.items() if name.endswith("model/0/weight") or name.endswith("model/0.weight")
    )
    assert (weight["dtype"], weight["shape"], weight["bytes"]) == ("F32", [16, 8], 16 * 8 * 4)

    verify = run_cli("verify", url, "--all", "--json", target=target, cwd=tmp_path)
    assert verify.returncode == 0, verify.stderr
    vdoc = as_json(verify)
    assert vdoc["ok"] and [(c["key"], c["status"], c["rehashed"]) for c in vdoc["checked"]] == [
        (k, "ok", True) for k in ("step-0000000040.e2", "step-0000000050.e2", "step-0000000060.e2")
    ]

    audit = run_cli("audit", url, "--json", "--strict", target=target, cwd=tmp_path)
    assert audit.returncode == 0, audit.stderr
    report = as_json(audit)["report"]
    assert report["verdict"] == "bit-exact"  # a real restore of model + momentum: the same losses
    assert [(o["attempts"], o["first_step"], o["last_step"]) for o in report["overlaps"]] == [([1, 2], 41, 45)]
    assert [
        (a["attempt"], a["first_step"], a["last_step"], a["resumed_from_step"], a["closed"]) for a in report["attempts"]
    ] == [(1, 1, 45, None, True), (2, 41, 60, 40, True)]
    assert report["scalars"]["loss"] == {"max_abs_diff": 0.0, "at_step": None, "compared_steps": 5}

    lease = run_cli("lease", url, "--json", target=target, cwd=tmp_path)
    assert lease.returncode == 0, lease.stderr
    ldoc = as_json(lease)["lease"]
    assert ldoc["state"] == "released" and ldoc["record"]["epoch"] == 2 and ldoc["age_s"] >= 0

    gc = run_cli("gc", url, "--keep-last", "1", "--dry-run", "--json", target=target, cwd=tmp_path)
    assert gc.returncode == 0, gc.stderr
    gdoc = as_json(gc)
    assert gdoc["dry_run"] and gdoc["deleted"] == ["step-0000000040.e2", "step-0000000050.e2"]
    assert all("keep_last=1" in why for why in gdoc["reasons"].values())

    # Read-only commands and a dry run wrote nothing, deleted nothing, and never took the lease.
    assert snapshot(target) == before
    assert list(tmp_path.iterdir()) == [] or all(
        p.name.startswith("local-") or p.name == "drive" for p in tmp_path.iterdir()
    )


@pytest.mark.parametrize("kind", KINDS)
def test_verify_catches_a_flipped_byte(kind, make_backend_target, tmp_path, run_cli):
    target = make_run(make_backend_target(kind))
    backend = target.open()
    flip_byte(backend, "step-0000000060.e2/tensors.safetensors")
    before = snapshot(target)

    bad = run_cli("verify", target.url, "--json", target=target, cwd=tmp_path)
    assert bad.returncode == cli.EXIT_FAILED, bad.stderr
    doc = as_json(bad)
    assert not doc["ok"]
    (entry,) = doc["checked"]
    assert (entry["step"], entry["status"]) == (60, "CORRUPT")
    assert "digest" in entry["reason"] or "mismatch" in entry["reason"]

    # Nothing was lost: the other checkpoints re-hash clean, and verify touched nothing.
    good = run_cli("verify", target.url, "--step", "50", target=target, cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    assert "intact" in good.stdout
    assert snapshot(target) == before


def test_audit_strict_fails_on_divergence_and_plots(make_backend_target, tmp_path, run_cli):
    target = make_run(make_backend_target("local"), perturb_from=43)
    png = tmp_path / "out" / "audit.png"
    png.parent.mkdir()

    strict = run_cli("audit", target.url, "--strict", "--plot", str(png), cwd=tmp_path)
    assert strict.returncode == cli.EXIT_FAILED, strict.stderr
    assert "audit of" in strict.stdout and "DIVERGED at step 43" in strict.stdout
    assert "first divergence: step 43, loss" in strict.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 15_000

    relaxed = run_cli("audit", target.url, "--json", cwd=tmp_path)
    assert relaxed.returncode == 0, relaxed.stderr
    doc = as_json(relaxed)
    assert (doc["ok"], doc["report"]["verdict"], doc["report"]["diverged_at"]) == (False, "DIVERGED at step 43", 43)
    assert doc["report"]["scalars"]["lr"]["max_abs_diff"] == 0.0
    # With a tolerance wider than the perturbation's effect, --strict passes.
    loose = cli.main(["audit", target.url, "--strict", "--tolerance", "1.0"])
    assert loose == 0


def test_lease_break_needs_confirmation_and_fences_the_writer(make_backend_target, tmp_path, run_cli):
    target = make_backend_target("local")
    train(target, 20)
    live = train(target, 30, close=False)  # a writer still holding the lease (epoch 2)
    try:
        # The holder's heartbeat rewrites LEASE.json every ttl/3; who holds it must not change.
        holder_before = read_lease(target.open()).holder

        shown = run_cli("lease", target.url, "--json", cwd=tmp_path)
        ldoc = as_json(shown)["lease"]
        assert (ldoc["state"], ldoc["record"]["epoch"], ldoc["record"]["holder"]["pid"]) == ("held", 2, os.getpid())
        ls = run_cli("ls", target.url, "--json", cwd=tmp_path)  # read-only: no wait for the holder
        # one row per step
        assert ls.returncode == 0 and [r["step"] for r in as_json(ls)["checkpoints"]] == [10, 20, 30]

        unconfirmed = run_cli("lease", target.url, "--break", cwd=tmp_path)
        assert unconfirmed.returncode == cli.EXIT_USAGE
        assert "--yes-i-am-sure" in unconfirmed.stderr and len(unconfirmed.stderr.strip().splitlines()) == 1
        after = read_lease(target.open())
        assert (after.epoch, after.holder, after.released) == (2, holder_before, False)

        broke = run_cli("lease", target.url, "--break", "--yes-i-am-sure", "--json", cwd=tmp_path)
        assert broke.returncode == 0, broke.stderr
        bdoc = as_json(broke)
        assert bdoc["broken"]["epoch"] == 2 and bdoc["broken"]["holder"]["pid"] == os.getpid()
        assert (bdoc["lease"]["state"], bdoc["lease"]["record"]["epoch"]) == ("released", 3)

        model, opt = _model()
        with pytest.raises(LeaseLostError):
            live.save(TrainState(model=model, optimizer=opt), step=31)
    finally:
        live.close()
    assert [i.key for i in CheckpointManager(target.url, read_only=True).list() if i.valid] == [
        "step-0000000010.e1",
        "step-0000000020.e2",
        "step-0000000030.e2",
    ]  # 20.e2: the anchor, which replaced 20.e1


def test_gc_deletes_for_real_and_keeps_the_rest(make_backend_target, capsys):
    target = make_run(make_backend_target("local"))
    assert cli.main(["gc", target.url, "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted 2 item(s)" in out and "step-0000000040.e2" in out
    assert cli.main(["ls", target.url, "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)["checkpoints"]] == [60]
    keys = snapshot(target)
    assert "LEASE.json" in keys and any(k.startswith("runlog/attempt-000002/") for k in keys)
    assert cli.main(["audit", target.url]) == 0  # the step log survives gc
    assert "bit-exact" in capsys.readouterr().out


def test_human_tables(make_backend_target, capsys):
    target = make_run(make_backend_target("local"))
    assert cli.main(["ls", target.url]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["STEP", "EPOCH", "SIZE", "WRITER", "CREATED", "STATUS", "KEPT", "BY"]
    assert "e2/a2" in out and "3 restorable by their manifest and file sizes" in out  # one row per step
    assert "sizes ok" in out and "valid" not in out.split("\n\n")[0]
    assert cli.main(["show", target.url]) == 0
    out = capsys.readouterr().out
    assert "step        60" in out and "NAME" in out and "DTYPE" in out and "F32" in out
    assert cli.main(["audit", target.url]) == 0
    out = capsys.readouterr().out
    assert "bit-exact" in out and "41..45 (5 steps)" in out and "RESUMED FROM" in out
    assert cli.main(["lease", target.url]) == 0
    assert "released" in capsys.readouterr().out
    assert cli.main(["gc", target.url, "--dry-run"]) == 0
    assert "nothing to delete" in capsys.readouterr().out  # keep_last 3: all kept


def test_errors_are_one_line_with_documented_exit_codes(tmp_path, capsys):
    empty = str(tmp_path / "empty-root")
    cases = [
        (["ls", "ftp://host/x"], cli.EXIT_USAGE, "unknown scheme"),
        (["show", empty], cli.EXIT_CHECKPOINT, "no checkpoint root at"),  # as `ls` says (issue 28)
        (["show", empty, "--json"], cli.EXIT_CHECKPOINT, "no checkpoint root at"),  # as `ls` says (issue 28)
        (["verify", empty, "--step", "7"], cli.EXIT_CHECKPOINT, "no checkpoint root at"),
        (["ls", empty], cli.EXIT_CHECKPOINT, "no checkpoint root at"),
        (["audit", empty], cli.EXIT_CHECKPOINT, "no checkpoint root at"),
        (["verify", empty], cli.EXIT_CHECKPOINT, "no checkpoint root at"),
        (["gc", empty], cli.EXIT_CHECKPOINT, "no checkpoint root at"),
        (["ls", empty, "--storage-option", "novalue"], cli.EXIT_USAGE, "KEY=VALUE"),
        (["audit", empty, "--tolerance", "-1"], cli.EXIT_USAGE, "--tolerance"),
        (["gc", empty, "--keep-last", "0"], cli.EXIT_USAGE, "--keep-last"),
        (["lease", empty, "--break"], cli.EXIT_USAGE, "--yes-i-am-sure"),
    ]
    for argv, code, words in cases:
        assert cli.main(argv) == code, argv
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptsdk: error: ") and words in lines[0], (argv, lines)
        if "--json" in argv:
            assert json.loads(captured.out)["error"]["exit_code"] == code
    # A root a writer opened but never saved to is not an error for listings.
    assert cli.main(["lease", empty]) == 0 and "no lease" in capsys.readouterr().out
    CheckpointManager(empty).close()
    assert cli.main(["ls", empty]) == 0 and "no checkpoints" in capsys.readouterr().out
    assert cli.main(["verify", empty]) == 0 and "nothing to verify" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate", empty])
    assert info.value.code == cli.EXIT_USAGE


@pytest.mark.gcs
def test_missing_bucket_is_a_storage_error(gcs_emulator, tmp_path, run_cli):
    proc = run_cli("lease", "gs://no-such-bucket-here/run", target=gcs_emulator, cwd=tmp_path)
    assert proc.returncode == cli.EXIT_STORAGE
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "no-such-bucket-here" in proc.stderr and proc.stdout == ""


def test_torn_checkpoint_is_shown_and_fails_verify(make_backend_target, capsys):
    target = make_run(make_backend_target("local"))
    backend = target.open()
    backend.delete("step-0000000050.e2/tensors.safetensors")  # a torn folder: manifest, no data
    assert cli.main(["show", target.url, "--step", "50", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["manifest"]["step"] == 50 and doc["tensors"] == []
    assert "tensors.safetensors" in doc["tensor_file_error"] and "ckptsdk verify" in doc["tensor_file_error"]
    # The default verify re-hashes the newest and still reports every torn committed folder.
    assert cli.main(["verify", target.url, "--json"]) == cli.EXIT_FAILED
    checked = {c["key"]: (c["status"], c["rehashed"]) for c in json.loads(capsys.readouterr().out)["checked"]}
    assert checked == {"step-0000000050.e2": ("CORRUPT", False), "step-0000000060.e2": ("ok", True)}
    assert cli.main(["ls", target.url]) == 0
    assert "torn: tensors.safetensors is missing" in capsys.readouterr().out
