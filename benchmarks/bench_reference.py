#!/usr/bin/env python
"""Reference mode (issue 48): a fine-tune's frozen base recorded by digest, never stored. Not a test.

The job: a frozen base of ``--base-mib`` MiB (1 GiB by default: 1024x1024 float32 Linear layers,
``requires_grad=False``), ``--adapters`` LoRA adapters (r=8; 16, spread over the base's layers:
the same trained state whatever the base's size, so the rows differ by the base alone), AdamW and
a linear schedule. The step is ``gpu_like``'s: the GPU's forward and backward as a sleep of
``GPU_STEP_S`` (the base never enters a CPU graph), then the adapters' gradients and the optimizer
step on the CPU. A non-blocking ``save()`` every ``--every`` (10) steps, ``keep_last=3``.

Each configuration runs in its own process (so its peak RSS is its own), the order reversed from
one round to the next (``--reps``, 2), and the table gives the median and min-max over the rounds:

- ``store``: ``SaveOptions(frozen="store")``, today's incremental saves (the base in ``shared/``
  once, snapshotted at every ``save()``);
- ``reference``: ``SaveOptions(frozen="reference")``;
- ``trainer``: the files the Hugging Face Trainer writes for a peft model at each
  ``checkpoint-N`` (``adapter_model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
  ``rng_state.pth``, ``trainer_state.json``; ``save_total_limit=3``), written here by the same
  calls the Trainer makes (safetensors' ``save_file``, ``torch.save``) for the same state. The
  real Trainer side by side is ``tests/integrations/test_integration_peft.py``.

Per configuration: bytes written per save after the first (everything the writer streamed through
a ``CountingBackend``: tensors, manifest, lease renewals, run log), the root's footprint after the
last save (hard links once, as ``du`` counts), the ``save()`` call's pause (median, p99), the
process's peak RSS and how much of it is above the job's own (model + optimizer), and the restore
time into a freshly built job (the base rebuilt from its "source", the seed; the root's page cache
dropped first; for ``reference`` the digest proof included), checked bit-exact. Then the issue's
targets: footprint <= 10 % of the base, the pause with a 256 MiB base <= 2x the pause with 32 MiB,
and the digest proof <= 1.5x a plain read of the base's bytes (page cache warm, and cold).

    python -m benchmarks.bench_reference                     # 1 GiB base, 2 rounds: ~5 min on 2 cores
    python -m benchmarks.bench_incremental --reference       # the same (bench_incremental's entry)
    python -m benchmarks.bench_reference --smoke             # seconds: checks the benchmark runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_checkpoint import drop_cache, loadavg  # noqa: E402
from ckptsdk import CheckpointManager, LeaseOptions, TrainState, open_backend  # noqa: E402
from ckptsdk.format.files.reference import hash_tensor  # noqa: E402
from ckptsdk.options import Retention, SaveOptions  # noqa: E402
from ckptsdk.testing.counting import CountingBackend  # noqa: E402

WIDTH = 1024
RANK = 8
GPU_STEP_S = 0.08  # gpu_like.GPU_STEP_S: a T4's forward + backward (imported lazily there: torchvision)
KEEP_LAST = 3
SOURCE = "bench:base@seed0"

# The targets.
FOOTPRINT_MAX = 0.10  # reference mode's root, keep_last=3, against the base's bytes
PAUSE_RATIO_MAX = 2.0  # pause with a 256 MiB base against a 32 MiB base
PROOF_RATIO_MAX = 1.5  # the digest proof against a plain read of the base's bytes

SMOKE = dict(base_mib=8, sizes=[8, 4], saves=3, every=2, reps=1, adapters=2, step_s=0.0)


# ------------------------------------------------------------------------------ the job


class Job:
    """A frozen base with LoRA adapters on some of its layers, AdamW, a linear schedule."""

    def __init__(self, base_mib: int, adapters: int, seed: int = 0) -> None:
        torch.manual_seed(seed)  # the base's "source": rebuilt from it on resume
        layers = max(1, base_mib * (1 << 20) // (WIDTH * WIDTH * 4))
        self.base = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
        for p in self.base.parameters():
            p.requires_grad_(False)
        torch.manual_seed(seed + 1)
        self.lora = torch.nn.ModuleList()
        for _ in range(adapters):
            a = torch.nn.Linear(WIDTH, RANK, bias=False)
            b = torch.nn.Linear(RANK, WIDTH, bias=False)
            torch.nn.init.zeros_(b.weight)  # LoRA's B starts at zero
            self.lora.append(torch.nn.Sequential(a, b))
        self.model = torch.nn.ModuleDict({"base": self.base, "lora": self.lora})
        self.opt = torch.optim.AdamW(self.lora.parameters(), lr=1e-3)
        self.sched = torch.optim.lr_scheduler.LinearLR(self.opt, start_factor=1.0, end_factor=0.1, total_iters=1000)
        self.state = TrainState(model=self.model, optimizer=self.opt, scheduler=self.sched)

    def step(self, i: int, step_s: float) -> None:
        time.sleep(step_s)  # the GPU's forward and backward through the base
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
        sum(ab(x).square().mean() for ab in self.lora).backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.contiguous() for k, v in self.lora.state_dict().items()}


def folder_bytes(root: Path) -> int:
    seen, total = set(), 0
    for f in root.rglob("*"):
        if f.is_file() and (st := f.stat()).st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM). Not ``ru_maxrss``: Linux carries that over an
    exec from the parent's memory at fork, so a child would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB (no /proc: not Linux)


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


# ------------------------------------------------------------------------------ one configuration


def run_ckptsdk(mode: str, job: Job, root: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    backend = CountingBackend(open_backend(str(root)))
    options = SaveOptions(frozen=mode, frozen_source=SOURCE, asynchronous=True, on_signal=False)
    pauses: list[float] = []
    after_first = 0
    with CheckpointManager(
        backend, save_options=options, retention=Retention(keep_last=KEEP_LAST), lease_options=LeaseOptions(ttl=600.0)
    ) as mgr:
        for i in range(1, cfg["saves"] * cfg["every"] + 1):
            job.step(i, cfg["step_s"])
            if i % cfg["every"]:
                continue
            t0 = time.perf_counter()
            mgr.save(job.state, step=i)
            pauses.append(time.perf_counter() - t0)
            if len(pauses) == 1:
                mgr.wait()  # the first save writes (store) or hashes (reference) the base: apart
                after_first = backend.bytes_written
        mgr.wait()
        written = backend.bytes_written - after_first
    return {"pauses": pauses, "bytes_per_save": written / (cfg["saves"] - 1)}


def restore_ckptsdk(root: Path, cfg: dict[str, Any]) -> tuple[float, Job]:
    fresh = Job(cfg["base_mib"], cfg["adapters"])  # the base rebuilt from its source
    for p in fresh.lora.parameters():
        torch.nn.init.normal_(p)  # the adapters must come from the checkpoint
    t0 = time.perf_counter()
    with CheckpointManager(str(root), read_only=True) as mgr:
        mgr.restore(fresh.state)
    return time.perf_counter() - t0, fresh


def run_trainer(job: Job, root: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's ``_save_checkpoint`` for a peft model, by the same library calls, for the same state."""
    from safetensors.torch import save_file

    pauses: list[float] = []
    sizes: list[int] = []
    for i in range(1, cfg["saves"] * cfg["every"] + 1):
        job.step(i, cfg["step_s"])
        if i % cfg["every"]:
            continue
        t0 = time.perf_counter()
        out = root / f"checkpoint-{i}"
        out.mkdir(parents=True)
        save_file(job.adapter_tensors(), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        torch.save(job.opt.state_dict(), out / "optimizer.pt")
        torch.save(job.sched.state_dict(), out / "scheduler.pt")
        torch.save({"cpu": torch.get_rng_state(), "python": None, "numpy": None}, out / "rng_state.pth")
        (out / "trainer_state.json").write_text(json.dumps({"global_step": i, "log_history": []}))
        for old in sorted(root.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[:-KEEP_LAST]:
            shutil.rmtree(old)  # save_total_limit
        pauses.append(time.perf_counter() - t0)
        sizes.append(folder_bytes(out))
    return {"pauses": pauses, "bytes_per_save": statistics.median(sizes[1:])}


def restore_trainer(root: Path, cfg: dict[str, Any]) -> tuple[float, Job]:
    from safetensors.torch import load_file

    fresh = Job(cfg["base_mib"], cfg["adapters"])
    for p in fresh.lora.parameters():
        torch.nn.init.normal_(p)
    last = max(root.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    t0 = time.perf_counter()
    fresh.lora.load_state_dict(load_file(str(last / "adapter_model.safetensors")))
    fresh.opt.load_state_dict(torch.load(last / "optimizer.pt", weights_only=True))
    fresh.sched.load_state_dict(torch.load(last / "scheduler.pt", weights_only=True))
    torch.set_rng_state(torch.load(last / "rng_state.pth", weights_only=True)["cpu"])
    return time.perf_counter() - t0, fresh  # the base: taken on trust (peft records it by name)


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process: train and save, then restore into a fresh job."""
    torch.set_num_threads(cfg["threads"])
    root = Path(cfg["root"])
    job = Job(cfg["base_mib"], cfg["adapters"])
    job_rss = peak_rss_mib()  # model + adapters; the optimizer's moments are small beside them
    if cfg["mode"] == "trainer":
        out = run_trainer(job, root, cfg)
    else:
        out = run_ckptsdk(cfg["mode"], job, root, cfg)
    out["peak_rss_mib"] = peak_rss_mib()
    out["above_job_mib"] = out["peak_rss_mib"] - job_rss
    out["footprint"] = folder_bytes(root)
    drop_cache(root)
    restore_s, fresh = (restore_trainer if cfg["mode"] == "trainer" else restore_ckptsdk)(root, cfg)
    out["restore_s"] = restore_s
    saved, back = job.state.state_dict(), fresh.state.state_dict()
    out["bit_exact"] = _equal(saved["objects"], back["objects"])
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def spawn(cfg: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_reference", "--child", json.dumps(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"{cfg['mode']} {cfg['base_mib']} MiB failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ the proof against a read


def proof_vs_read(base_mib: int, tmp: Path) -> dict[str, float]:
    """The digest proof of the base's tensors against plain reads of the same bytes from a file."""
    job = Job(base_mib, 1)
    tensors = list(job.base.parameters())
    path = tmp / "base.bin"
    with open(path, "wb") as f:
        for t in tensors:
            f.write(t.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    buf = bytearray(tensors[0].nbytes)

    def read() -> float:
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return time.perf_counter() - t0

    read()  # warm
    warm = min(read() for _ in range(3))
    drop_cache(path)
    cold = read()
    proof = min(_timed(lambda: [hash_tensor(t) for t in tensors]) for _ in range(3))
    path.unlink()
    return {"proof_s": proof, "read_warm_s": warm, "read_cold_s": cold}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------ the report


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.3f}"


def _med(xs: list[float]) -> str:
    return f"{_num(statistics.median(xs))} ({_num(min(xs))}-{_num(max(xs))})" if len(xs) > 1 else _num(xs[0])


def report(rows: dict[tuple[str, int], list[dict[str, Any]]], proofs: list[dict[str, float]], base_mib: int) -> None:
    print("\nmedian (min-max) over the rounds; pause = the save() call, p99 over the saves after the first")
    head = f"{'mode':10} {'base':>6} {'KiB/save':>22} {'footprint MiB':>22} {'pause med ms':>22} "
    print(head + f"{'pause p99 ms':>22} {'peak RSS MiB':>20} {'above job MiB':>20} {'restore s':>22}  exact")
    for (mode, mib), runs in rows.items():
        col = {k: [r[k] for r in runs] for k in ("bytes_per_save", "footprint", "peak_rss_mib", "above_job_mib")}
        col["med"] = [statistics.median(r["pauses"][1:]) * 1e3 for r in runs]
        col["p99"] = [_p99(r["pauses"][1:]) * 1e3 for r in runs]
        print(
            f"{mode:10} {mib:>4}Mi {_med([b / 1024 for b in col['bytes_per_save']]):>22} "
            f"{_med([b / 2**20 for b in col['footprint']]):>22} {_med(col['med']):>22} {_med(col['p99']):>22} "
            f"{_med(col['peak_rss_mib']):>20} {_med(col['above_job_mib']):>20} "
            f"{_med([r['restore_s'] for r in runs]):>22}  {all(r['bit_exact'] for r in runs)}"
        )
    print("\ntargets (ratios of medians; per round in brackets):")
    ref = rows[("reference", base_mib)]
    foot = [r["footprint"] / (base_mib << 20) for r in ref]
    met = _met(foot, FOOTPRINT_MAX)
    print(f"  reference footprint / base ({base_mib} MiB): {_pct(foot)} (<= {FOOTPRINT_MAX:.0%}): {met}")
    if ("reference", 256) in rows and ("reference", 32) in rows:
        pr = [
            statistics.median(a["pauses"][1:]) / statistics.median(b["pauses"][1:])
            for a, b in zip(rows[("reference", 256)], rows[("reference", 32)], strict=True)
        ]
        print(f"  reference pause 256 MiB / 32 MiB base: {_x(pr)} (<= {PAUSE_RATIO_MAX}x): {_met(pr, PAUSE_RATIO_MAX)}")
    for what in ("read_warm_s", "read_cold_s"):
        ratio = [p["proof_s"] / p[what] for p in proofs]
        met = _met(ratio, PROOF_RATIO_MAX)
        print(f"  digest proof / plain {what[5:9]} read of the base: {_x(ratio)} (<= {PROOF_RATIO_MAX}x): {met}")
    if ("trainer", base_mib) in rows and ("reference", base_mib) in rows:
        tr = rows[("trainer", base_mib)]
        bb = [a["bytes_per_save"] / b["bytes_per_save"] for a, b in zip(ref, tr, strict=True)]
        ff = [a["footprint"] / b["footprint"] for a, b in zip(ref, tr, strict=True)]
        print(f"  reference / Trainer checkpoint-N: bytes per save {_x(bb)}, footprint {_x(ff)}")
    proof = [p["proof_s"] for p in proofs]
    print(f"  digest proof of the {base_mib} MiB base: {_med(proof)} s")


def _pct(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2%} [" + ", ".join(f"{x:.2%}" for x in xs) + "]"


def _x(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x [" + ", ".join(f"{x:.2f}" for x in xs) + "]"


def _met(xs: list[float], limit: float) -> str:
    return "met" if statistics.median(xs) <= limit else "MISSED"


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-mib", type=int, default=1024, help="the frozen base of the main comparison (1 GiB)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 32], help="more bases, both modes (pause target)")
    ap.add_argument("--saves", type=int, default=12, help="saves per configuration (default 12)")
    ap.add_argument("--every", type=int, default=10, help="steps between saves (default 10)")
    ap.add_argument("--adapters", type=int, default=16, help="LoRA adapters (r=8), whatever the base's size")
    ap.add_argument("--reps", type=int, default=2, help="rounds, the order reversed each round (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per configuration")
    ap.add_argument("--dir", default=None, help="where the roots go (default: a temp folder on disk)")
    ap.add_argument("--smoke", action="store_true", help="tiny bases, no sleep: checks the benchmark runs")
    ap.add_argument("--json-out", default=None, help="write every figure here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.step_s = GPU_STEP_S
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    configs = [("store", args.base_mib), ("reference", args.base_mib), ("trainer", args.base_mib)]
    configs += [(m, s) for s in args.sizes if s != args.base_mib for m in ("store", "reference")]
    print(f"load average before: {loadavg()}  command: {' '.join(sys.argv)}")
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    proofs = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        tmp = Path(d)
        for rnd in range(args.reps):
            for mode, mib in configs if rnd % 2 == 0 else configs[::-1]:
                root = tmp / f"{mode}-{mib}-{rnd}"
                cfg = dict(vars(args), mode=mode, base_mib=mib, root=str(root), child=None)
                out = spawn(cfg)
                shutil.rmtree(root, ignore_errors=True)
                rows[(mode, mib)].append(out)
                print(
                    f"round {rnd + 1} {mode:9} {mib:>5} MiB: pause med "
                    f"{statistics.median(out['pauses'][1:]) * 1e3:.1f} ms, "
                    f"{out['bytes_per_save'] / 1024:.0f} KiB/save, restore {out['restore_s']:.2f} s",
                    flush=True,
                )
            proofs.append(proof_vs_read(args.base_mib, tmp))
    report(rows, proofs, args.base_mib)
    print(f"load average after: {loadavg()}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({f"{m}-{s}": r for (m, s), r in rows.items()} | {"proofs": proofs}))
    return 0 if all(r["bit_exact"] for runs in rows.values() for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
