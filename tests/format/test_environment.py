"""The one description of a writing process (versions, device) that the manifest and the run log share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptsdk
from ckptsdk.backends import open_backend
from ckptsdk.format.environment import Environment, describe_device, versions
from ckptsdk.runlog.writer import RunLog

REPO = Path(__file__).resolve().parents[2]


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, *, initialised: bool) -> list[str]:
    asked: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append("current_device") or 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: asked.append(f"name {i}") or "NVIDIA H200")
    return asked


def test_versions_name_this_process_in_a_fixed_order() -> None:
    assert versions() == {
        "python": sys.version.split()[0],
        "ckptsdk": ckptsdk.__version__,
        "torch": str(torch.__version__),
        "numpy": np.__version__,
    }
    assert list(versions()) == ["python", "ckptsdk", "torch", "numpy"]  # the run log's byte order


def test_the_manifest_and_the_run_log_describe_a_process_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, initialised=True)
    env = Environment.current()
    log = RunLog(open_backend("memory://env-alike"), run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None)
    assert log.record.device == env.device == "cuda:0 (NVIDIA H200)"
    assert log.record.versions == {name: getattr(env, name) for name in ("python", "ckptsdk", "torch", "numpy")}


def test_a_cuda_device_is_named_only_once_the_job_initialised_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _fake_gpu(monkeypatch, initialised=False)
    assert describe_device() == "cpu"
    assert describe_device(torch.device("cuda", 1)) == "cuda:1"
    assert asked == []  # no question that could create a CUDA context
    asked = _fake_gpu(monkeypatch, initialised=True)
    assert describe_device(torch.device("cuda", 1)) == "cuda:1 (NVIDIA H200)"
    assert describe_device("cuda") == "cuda:0 (NVIDIA H200)"  # no index: the current device
    assert describe_device(torch.device("cpu")) == "cpu"
    assert asked == ["name 1", "current_device", "name 0"]


def test_a_broken_driver_or_a_missing_device_keeps_what_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_initialized", broken)
    assert describe_device() == "cpu (cuda unusable)"
    assert describe_device("cuda:0") == "cuda:0"

    def no_such(index: int) -> str:
        raise AssertionError("Invalid device id")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", no_such)
    assert describe_device("cuda:7") == "cuda:7"


_WITHOUT_TORCH = """
import sys
from ckptsdk.format.environment import describe_device, versions
print(describe_device(), sorted(versions()), "torch" in sys.modules)
"""


def test_describing_the_process_never_imports_torch() -> None:
    # The CLI and child processes import the run log without torch: naming them must not load it.
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH], capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "['ckptsdk',", "'python']", "False"]
