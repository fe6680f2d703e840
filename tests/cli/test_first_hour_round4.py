"""The first hour, round 4 (issue 47, item 13): what ``verify`` says gc does, gc does; one address
syntax (``URL@STEP``) for every command that takes a checkpoint; an unreachable ``gs://`` endpoint
is one clear line, quickly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, TrainState, cli
from ckptsdk.format.layout import TENSORS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def root(tmp_path) -> Path:
    url = tmp_path / "run"
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(str(url), keep_last=3) as mgr:
        for step in (10, 20, 30):
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save(TrainState(model=model), step=step, metrics={"loss": 1.0 / step})
    return url


def _corrupt(root: Path, step: int) -> Path:
    (folder,) = root.glob(f"step-{step:010d}*")
    data = bytearray((folder / TENSORS).read_bytes())
    data[-1] ^= 0xFF  # same size: only a re-hash sees it
    (folder / TENSORS).write_bytes(bytes(data))
    return folder


def test_verify_says_what_gc_does_with_a_corrupt_checkpoint(root, capsys):
    folder = _corrupt(root, 20)
    assert cli.main(["verify", str(root), "--all"]) == cli.EXIT_FAILED
    said = capsys.readouterr().out
    assert cli.main(["gc", str(root)]) == cli.EXIT_OK
    gc_said = capsys.readouterr().out
    if folder.exists():  # gc kept it: verify must not have promised that gc removes it
        assert "removes them" not in said, (said, gc_said)
        assert "keep rules" in said and "nothing restores them" in said
    assert "corrupt checkpoint(s)" in said


def test_show_and_verify_take_url_at_step_as_export_does(root, capsys, tmp_path):
    assert cli.main(["show", f"{root}@20", "--json"]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["manifest"]["step"] == 20
    assert cli.main(["show", f"{root}@best:loss", "--json"]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["manifest"]["step"] == 30
    assert cli.main(["verify", f"{root}@10", "--json"]) == cli.EXIT_OK
    assert [r["step"] for r in json.loads(capsys.readouterr().out)["checked"]] == [10]
    assert cli.main(["export", f"{root}@20", str(tmp_path / "w.safetensors")]) == cli.EXIT_OK
    capsys.readouterr()
    # The same step twice is fine; two different ones, or a step with --all, are a usage error.
    assert cli.main(["show", f"{root}@20", "--step", "20", "--json"]) == cli.EXIT_OK
    capsys.readouterr()
    assert cli.main(["show", f"{root}@20", "--step", "10"]) == cli.EXIT_USAGE
    assert "give one of them" in capsys.readouterr().err
    assert cli.main(["verify", f"{root}@20", "--all"]) == cli.EXIT_USAGE
    capsys.readouterr()


def test_a_command_that_takes_a_root_says_so_when_given_url_at_step(root, capsys):
    assert cli.main(["ls", f"{root}@20"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "names one checkpoint" in err and f"ckptsdk COMMAND {root}" in err
    assert "no checkpoint root" not in err


def test_an_unreachable_gcs_endpoint_is_one_clear_line(tmp_path):
    pytest.importorskip("gcsfs")
    with socket.socket() as s:  # a loopback port nothing listens on (closed again at once)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ckptsdk", "ls", "gs://bucket/run"]
        + ["--storage-option", f"endpoint_url=http://127.0.0.1:{port}", "--storage-option", "token=anon"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    took = time.monotonic() - started
    assert proc.returncode == cli.EXIT_STORAGE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"ckptsdk: error: cannot reach GCS at http://127.0.0.1:{port}")
    assert "attempt 1/" not in proc.stderr and "Traceback" not in proc.stderr
    assert took < 20, took
