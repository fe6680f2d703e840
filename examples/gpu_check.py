"""GPU check: the full-size AMP ResNet-18 job on CUDA, killed twice, resumed, audited and timed.

    python -m examples.gpu_check            # < 5 min on one modern GPU; no network

Runs the full preset (ResNet-18, batch 256, fp16 autocast + GradScaler, deterministic kernels)
on full-size synthetic CIFAR-10 (50,000 + 10,000 images) for a few hundred steps as child
processes: once uninterrupted, and once SIGKILLed inside the save at step 200 and again at step
250, resuming each time. Prints one compact report: step time, time per save and per restore,
checkpoint size, the audit's max |loss diff| over the steps run twice, and whether the final
weights equal the uninterrupted run's. Exit code 0 only if the audit is bit-exact and they do.

Then (skip with ``--no-overhead``) the training-overhead benchmark of issue #12 at full width with
AMP: ``benchmarks/bench_overhead.py --device cuda --amp --width 64 --batch-size 256``: overhead
in % saving every 1, 10 and 100 steps (local disk and behind a 50 ms-per-call wrapper), stall
per save (median, p99), and seconds from SIGTERM to a committed checkpoint; then issue #23's
``bench_overhead --step gpu-like --device cuda --amp``: the real AMP step saving every 10 steps at
0, 20 and 50 ms per storage call (overhead, stall, calls and bytes per save, saves replaced/skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from adapters.cifar10.kill_resume import audit, child_env, compare_states, final_state, run_attempt


def _command(root: str, result_json: str, args: argparse.Namespace) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "examples.train_cifar10",
        "--ckpt",
        root,
        "--data",
        "synthetic",
        "--preset",
        "full",
        "--max-steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--device",
        args.device,
        "--lease-ttl",
        str(args.lease_ttl),
        "--no-progress",
        "--events",
        "--result-json",
        result_json,
    ]
    if args.small:  # a CPU smoke test of this script's logic, not a measurement
        cmd += [
            "--width",
            "8",
            "--batch-size",
            "32",
            "--n-train",
            "640",
            "--n-test",
            "100",
            "--epochs",
            "3",
            "--threads",
            "1",
        ]
    return cmd


def _figures(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, help="global steps of the run (default 300; 60 with --small)")
    p.add_argument("--save-every", type=int, help="default 100; 20 with --small")
    p.add_argument(
        "--kill-in-save", type=int, help="SIGKILL inside the save of this step (default 200; 40 with --small)"
    )
    p.add_argument("--kill-at", type=int, help="then SIGKILL after this step (default 250; 50 with --small)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lease-ttl", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds allowed per child")
    p.add_argument("--workdir", default=None)
    p.add_argument("--small", action="store_true", help="tiny model and data (CPU smoke test)")
    p.add_argument("--no-overhead", action="store_true", help="skip the training-overhead benchmark")
    p.add_argument("--overhead-steps", type=int, default=200, help="steps per overhead configuration")
    args = p.parse_args(argv)
    # --small runs 3 epochs of 20 steps: the kill points must fall inside them.
    for name, full, small in (
        ("steps", 300, 60),
        ("save_every", 100, 20),
        ("kill_in_save", 200, 40),
        ("kill_at", 250, 50),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(
                "error: no CUDA device here; this check needs a GPU (--device cpu --small to smoke-test)",
                file=sys.stderr,
            )
            return 2
        gpu = torch.cuda.get_device_name(0)
    else:
        gpu = "none (CPU)"

    work = args.workdir or tempfile.mkdtemp(prefix="ckptsdk-gpu-check-")
    os.makedirs(work, exist_ok=True)
    ref_root, run_root = os.path.join(work, "uninterrupted"), os.path.join(work, "killed")
    env = child_env()
    t0 = time.monotonic()
    lines: list[str] = []

    def attempt(number: int, root: str, kill: tuple[str, int] | None) -> dict:
        out = os.path.join(work, f"{os.path.basename(root)}-{number}.json")
        att = run_attempt(number, _command(root, out, args), env=env, kill=kill, local_root=root, timeout=args.timeout)
        tail = " | ".join(att.lines[-6:])
        if kill is not None:
            if not att.killed:
                raise SystemExit(f"attempt {number} ended (exit {att.returncode}) before its kill: {tail}")
            lines.append(
                f"attempt {number}: SIGKILLed {'in the save of' if kill[0] == 'saving' else 'after'} "
                f"step {kill[1]} after {att.seconds:.1f} s" + (f": {att.save_state}" if att.save_state else "")
            )
            return {}
        if att.returncode != 0:
            raise SystemExit(f"attempt {number} failed (exit {att.returncode}): {tail}")
        figures = _figures(out)
        lines.append(f"attempt {number}: finished, resumed from step {figures['start_step']} after {att.seconds:.1f} s")
        return figures

    try:
        ref = attempt(1, ref_root, None)
        lines.clear()
        attempt(1, run_root, ("saving", args.kill_in_save))
        attempt(2, run_root, ("step", args.kill_at))
        last = attempt(3, run_root, None)
        report = audit(run_root)
        ref_step, ref_state = final_state(ref_root)
        run_step, run_state = final_state(run_root)
        diffs = compare_states(ref_state, run_state) if ref_step == run_step else [f"steps {ref_step} vs {run_step}"]
        import ckptsdk

        mgr = ckptsdk.CheckpointManager(run_root, read_only=True)
        size = max(c.size for c in mgr.list())
        mgr.close()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    saves = ref["save_seconds"] + last["save_seconds"]
    steps = ref["final_step"]
    loss = report.scalars.get("loss")
    print(f"GPU check: {gpu}, full preset, {steps} steps, save every {args.save_every}")
    print("\n".join(f"  {ln}" for ln in lines))
    print(
        f"  step time (uninterrupted, incl. saves and one evaluation): "
        f"{1000 * ref['train_seconds'] / max(1, steps):.1f} ms"
    )
    print(
        f"  checkpoint: {size / 2**20:.1f} MiB; save {statistics.mean(saves):.3f} s mean, "
        f"{max(saves):.3f} s max over {len(saves)}"
    )
    print(
        f"  restore (read + verify + load): {last['restore_seconds']:.3f} s; lease taken over in "
        f"{last['lease_seconds']:.1f} s (ttl {args.lease_ttl:g} s)"
    )
    print(
        f"  audit: {report.verdict}; attempts {len(report.attempts)}; steps run twice "
        f"{report.overlap_steps}; max |loss diff| "
        f"{loss.max_abs_diff if loss is not None and report.overlap_steps else 'n/a'}"
    )
    print(
        f"  final weights and optimizer state vs uninterrupted: "
        f"{'EQUAL byte for byte' if not diffs else f'{len(diffs)} differences, e.g. {diffs[:3]}'}"
    )
    print(f"  total {time.monotonic() - t0:.0f} s")
    if not args.no_overhead:
        _overhead(args)
    return 0 if (not diffs and report.verdict == "bit-exact") else 1


def _overhead(args: argparse.Namespace) -> None:
    """The training-overhead benchmark on this device, at full width with AMP (or small on CPU)."""
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_overhead",
        "--device",
        args.device,
        "--steps",
        str(args.overhead_steps),
    ]
    if args.small:
        cmd += ["--width", "8", "--batch-size", "16", "--steps", "20"]
    else:
        cmd += ["--width", "64", "--batch-size", "256"] + (["--amp"] if args.device.startswith("cuda") else [])
    print("\ntraining overhead: " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=False, timeout=max(600.0, args.timeout * 3))
    # The real question (issue 23): a save every 10 steps of the real AMP step, at 0/20/50 ms per
    # storage call: overhead, stall, calls and bytes per save, saves replaced/skipped.
    gpu_like = [sys.executable, "-m", "benchmarks.bench_overhead", "--step", "gpu-like", "--device", args.device]
    if args.small:
        gpu_like += ["--steps", "20", "--reps", "1"]
    else:
        gpu_like += ["--batch-size", "256", "--steps", "100", "--reps", "3"]
        gpu_like += ["--amp"] if args.device.startswith("cuda") else []
    print("\nsave every 10 steps at 0/20/50 ms per call: " + " ".join(gpu_like[1:]), flush=True)
    subprocess.run(gpu_like, check=False, timeout=max(600.0, args.timeout * 3))


if __name__ == "__main__":
    sys.exit(main())
