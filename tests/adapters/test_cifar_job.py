"""The CIFAR-10 job end to end: SIGKILLed anywhere and resumed, it ends bit-for-bit where an
uninterrupted run ends; it moves between backends mid-run; it refuses a resume on other data.

Real child processes (``python -m examples.train_cifar10``) killed with SIGKILL, real storage
(local disk, the GCS emulator on 127.0.0.1), a narrow ResNet-18 on synthetic data on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ckptsdk
from adapters.cifar10.determinism import augment
from adapters.cifar10.kill_resume import (
    REPO,
    audit,
    child_command,
    child_env,
    final_state,
    plan_kills,
    run_attempt,
)
from adapters.cifar10.synthetic import synthetic_cifar10
from adapters.cifar10.train import PRESETS, run_job
from ckptsdk.errors import ConfigError, DatasetMismatchError
from ckptsdk.format import codec

# The quick preset made smaller still: 8-wide ResNet-18, 3 epochs of 10 steps of 32 images.
EPOCHS, STEPS_PER_EPOCH, SAVE_EVERY = 3, 10, 4
TOTAL = EPOCHS * STEPS_PER_EPOCH
JOB = [
    "--width",
    "8",
    "--batch-size",
    "32",
    "--n-train",
    "320",
    "--n-test",
    "100",
    "--epochs",
    str(EPOCHS),
    "--save-every",
    str(SAVE_EVERY),
]
TTL = 1.5  # the children's lease ttl: each resume waits this long for the killed writer's lease


def _flat(tree: Any) -> tuple[dict[str, bytes], Any]:
    """Every tensor of a state tree as (dtype, shape, raw bytes), plus its JSON skeleton."""
    tensors, skeleton = codec.encode(tree)
    raw = {
        k: (str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for k, t in tensors.items()
    }
    return raw, skeleton


def _assert_same_state(ref: tuple[int, Any], got: tuple[int, Any]) -> None:
    assert got[0] == ref[0] == TOTAL
    ref_tensors, ref_skeleton = _flat(ref[1])
    got_tensors, got_skeleton = _flat(got[1])
    assert got_skeleton == ref_skeleton  # scalars: optimizer hyper-parameters, scheduler, RNGs
    assert sorted(got_tensors) == sorted(ref_tensors)
    differ = [k for k in ref_tensors if got_tensors[k] != ref_tensors[k]]
    assert not differ, f"{len(differ)} tensors differ from the uninterrupted run, e.g. {differ[:5]}"
    assert ref[1]["objects"]["optimizer"]["state"], "the optimizer's momentum buffers are compared too"


class _Reference:
    """The uninterrupted run, started once for the module and left running alongside."""

    def __init__(self, root: str) -> None:
        self.url = root
        self.log = open(root + ".log", "w+")
        self.proc = subprocess.Popen(
            child_command(root, lease_ttl=TTL, extra=JOB),
            cwd=REPO,
            env=child_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._state: tuple[int, Any] | None = None

    def state(self) -> tuple[int, Any]:
        if self._state is None:
            rc = self.proc.wait(timeout=400)
            self.log.seek(0)
            assert rc == 0, f"the uninterrupted run failed ({rc}):\n{self.log.read()[-3000:]}"
            self._state = final_state(self.url)
        return self._state

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)
        self.log.close()


# The tests that take ``reference`` run on one xdist worker (scripts/test.sh: --dist loadgroup), so
# the uninterrupted run is trained once, not once per worker.
ON_THE_REFERENCE_WORKER = pytest.mark.xdist_group("cifar-job-reference")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Reference]:
    ref = _Reference(str(tmp_path_factory.mktemp("reference") / "run"))
    try:
        yield ref
    finally:
        ref.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
@ON_THE_REFERENCE_WORKER
def test_killed_three_times_incl_mid_save_resumes_bit_exact(reference: _Reference, tmp_path: Any) -> None:
    seed = random.SystemRandom().randrange(10**6)
    plan = plan_kills(
        total_steps=TOTAL, save_every=SAVE_EVERY, steps_per_epoch=STEPS_PER_EPOCH, count=3, rng=random.Random(seed)
    )
    assert len(plan) == 3 and sum(1 for e, _ in plan if e == "saving") == 1, plan
    root = str(tmp_path / "run")
    env = child_env()
    attempts = []
    for number, kill in enumerate([*plan, None], start=1):
        att = run_attempt(
            number, child_command(root, lease_ttl=TTL, extra=JOB), env=env, kill=kill, local_root=root, timeout=300
        )
        attempts.append(att)
        context = f"kill seed {seed}, plan {plan}, attempt {number}: {att.lines[-6:]}"
        if kill is not None:
            assert att.killed, context
            assert att.killed_at == kill[1], context
        else:
            assert att.returncode == 0, context
            # Resumed from a committed checkpoint at or before the last kill point.
            resumed = [ln for ln in att.lines if ln.startswith("resumed from step")]
            assert resumed and int(resumed[0].split()[3]) <= plan[-1][1], context

    report = audit(root)
    assert len(report.attempts) == 4, report.attempts
    # The kill inside a save comes after that save flushed the step log: the steps since the
    # previous checkpoint were run again by the next attempt, and the audit compared them.
    assert report.overlap_steps >= 1, (seed, plan, report)
    assert report.verdict == "bit-exact", (seed, plan, report.verdict, report.first_divergence)
    assert report.scalars["loss"].max_abs_diff == 0.0
    assert report.scalars["loss"].compared_steps >= 1

    _assert_same_state(reference.state(), final_state(root))


@pytest.mark.slow
@pytest.mark.gcs
@pytest.mark.timeout(600)
@ON_THE_REFERENCE_WORKER
def test_resume_moves_from_local_disk_to_gcs(reference: _Reference, gcs_emulator: Any, tmp_path: Any) -> None:
    local = str(tmp_path / "run")
    first = run_attempt(
        1,
        child_command(local, lease_ttl=TTL, extra=JOB),
        env=child_env(),
        kill=("step", 17),
        local_root=local,
        timeout=300,
    )
    assert first.killed, first.lines[-6:]

    # The same root, object for object (lease, lineage, run log, checkpoints), now in a bucket.
    bucket = f"cifar-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    gcs_emulator.make_bucket(bucket)
    url = gcs_emulator.url(bucket, "runs/cifar")
    gcs = ckptsdk.open_backend(url, **gcs_emulator.storage_options)
    copied = 0
    for folder, _dirs, files in os.walk(local):
        for name in files:
            if name.startswith(".ckptsdk-tmp."):
                continue  # a crashed write's leftover is not part of the root
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                gcs.write(os.path.relpath(path, local).replace(os.sep, "/"), f.read())
            copied += 1
    assert copied >= 3

    second = run_attempt(2, child_command(url, lease_ttl=TTL, extra=JOB), env=child_env(gcs_emulator.env), timeout=300)
    assert second.returncode == 0, second.lines[-10:]
    assert any(ln.startswith("resumed from step 16") for ln in second.lines), second.lines[:6]

    _assert_same_state(reference.state(), final_state(url, gcs_emulator.storage_options))
    report = audit(url, gcs_emulator.storage_options)
    assert len(report.attempts) == 2 and report.ok, report


@pytest.fixture
def in_process_job() -> Iterator[None]:
    """run_job switches on deterministic kernels process-wide; put the flags back after. One
    thread: two OpenMP threads spinning on two shared cores run a step ten times slower."""
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags[2], flags[3]


@pytest.mark.slow
def test_resume_on_other_data_is_refused(tmp_path: Any, in_process_job: None) -> None:
    cfg = PRESETS["quick"].replace(width=8, batch_size=32, n_train=320, n_test=100, epochs=3, save_every=4, max_steps=4)
    url = str(tmp_path / "run")
    data = synthetic_cifar10(n_train=cfg.n_train, n_test=cfg.n_test, seed=0)
    first = run_job(cfg, data, url, lease_ttl=TTL)
    assert first.final_step == 4
    before = final_state(url)

    other = synthetic_cifar10(n_train=cfg.n_train, n_test=cfg.n_test, seed=1)
    assert other.tensor_hash != data.tensor_hash
    with pytest.raises(DatasetMismatchError) as err:
        run_job(cfg.replace(max_steps=8), other, url, lease_ttl=TTL)
    assert err.value.expected == data.tensor_hash
    assert err.value.actual == other.tensor_hash
    assert data.tensor_hash in str(err.value) and other.tensor_hash in str(err.value)
    assert url in str(err.value)

    # Nothing was lost or added: the checkpoint it refused is still the newest, byte for byte.
    after = final_state(url)
    assert after[0] == before[0] == 4
    assert _flat(after[1]) == _flat(before[1])

    # The right data resumes where the run stopped.
    again = run_job(cfg.replace(max_steps=6), data, url, lease_ttl=TTL)
    assert (again.start_step, again.final_step) == (4, 6)


def test_colab_notebook_is_clean_nbformat4_and_uses_real_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with open(os.path.join(REPO, "examples", "colab_cifar10.ipynb"), encoding="utf-8") as f:
        nb = json.load(f)
    assert nb["nbformat"] == 4 and nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    text = "".join("".join(c["source"]) for c in nb["cells"])
    for needed in ("drive.mount", "pip install", "drive://", "examples.train_cifar10", "audit", "plot_audit"):
        assert needed in text, needed
    assert not re.search(r"(api[_-]?key|token|secret|password)\s*=", text, re.I)
    # Every --option the notebook passes to the job exists (its parser, in process: importing the
    # example sets CUBLAS_WORKSPACE_CONFIG, which monkeypatch puts back).
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    from examples.train_cifar10 import parse_args

    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    parser_help = capsys.readouterr().out
    job_lines = [ln for ln in text.splitlines() if "examples.train_cifar10" in ln]
    for option in {o for ln in job_lines for o in re.findall(r"--[a-z][a-z-]+", ln)}:
        assert option in parser_help, option


@pytest.mark.slow
def test_resume_with_other_settings_is_refused(tmp_path: Any, in_process_job: None) -> None:
    cfg = PRESETS["quick"].replace(width=8, batch_size=32, n_train=320, n_test=100, epochs=3, save_every=4, max_steps=4)
    url = str(tmp_path / "run")
    data = synthetic_cifar10(n_train=cfg.n_train, n_test=cfg.n_test, seed=0)
    run_job(cfg, data, url, lease_ttl=TTL)
    before = final_state(url)
    with pytest.raises(ConfigError) as err:
        run_job(cfg.replace(lr=0.2, max_steps=8), data, url, lease_ttl=TTL)
    assert "lr: saved 0.05, now 0.2" in str(err.value) and url in str(err.value)
    after = final_state(url)
    assert after[0] == 4 and _flat(after[1]) == _flat(before[1])


@pytest.mark.slow
def test_bf16_autocast_on_cpu_resumes_bit_exact_in_process(tmp_path: Any, in_process_job: None) -> None:
    cfg = PRESETS["quick"].replace(width=8, batch_size=32, n_train=320, n_test=100, epochs=1, save_every=3, amp="bf16")
    data = synthetic_cifar10(n_train=cfg.n_train, n_test=cfg.n_test, seed=0)
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    run_job(cfg, data, whole, lease_ttl=TTL)
    first = run_job(cfg.replace(max_steps=5), data, split, lease_ttl=TTL)
    assert first.final_step == 5
    second = run_job(cfg, data, split, lease_ttl=TTL)
    assert (second.start_step, second.final_step) == (5, 10)
    a, b = final_state(whole), final_state(split)
    assert a[0] == b[0] == 10 and _flat(a[1]) == _flat(b[1])
    assert any(t.dtype == torch.float32 for t in a[1]["objects"]["model"].values())  # master weights stay fp32


def test_augmentation_is_a_function_of_seed_and_step() -> None:
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    one = augment(images, 7, 11)
    assert one.dtype == torch.uint8 and one.shape == images.shape
    assert torch.equal(one, augment(images, 7, 11))  # no hidden state, no global RNG
    assert not torch.equal(one, augment(images, 7, 12))
    assert not torch.equal(one, augment(images, 8, 11))
    # Each output is a 32x32 window of the zero-padded input, possibly mirrored.
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    for i in range(images.shape[0]):
        windows = [padded[i, :, y : y + 32, x : x + 32] for y in range(9) for x in range(9)]
        assert any(torch.equal(one[i], w) or torch.equal(one[i], w.flip(-1)) for w in windows), i


@pytest.mark.parametrize("seed", range(50))
def test_kill_plan_increases_and_kills_once_inside_a_save(seed: int) -> None:
    plan = plan_kills(
        total_steps=TOTAL, save_every=SAVE_EVERY, steps_per_epoch=STEPS_PER_EPOCH, count=3, rng=random.Random(seed)
    )
    steps = [s for _, s in plan]
    assert steps == sorted(set(steps)) and 2 <= steps[0] and steps[-1] < TOTAL
    assert [e for e, _ in plan] == ["step", "saving", "step"]
    assert steps[1] % SAVE_EVERY == 0 or steps[1] % STEPS_PER_EPOCH == 0
