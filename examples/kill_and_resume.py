"""The demo: SIGKILL a training run at random steps, resume it each time, prove nothing changed.

    python -m examples.kill_and_resume            # offline, a few minutes on 2 CPU cores

Trains the quick preset on synthetic CIFAR-10 twice, as child processes: once uninterrupted, and
once killed K times (one kill lands inside a checkpoint save) and resumed after each kill. Then it
prints the resume audit (attempts, steps run twice, max |loss diff|) and whether the final weights
and optimizer state equal the uninterrupted run's, byte for byte; the exit code is non-zero if not.
Only the command line and the printing live here; the harness (child processes, kills, the
state comparison) is ``adapters.cifar10.kill_resume``, shared with gpu_check.py and the tests.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from adapters.cifar10.kill_resume import (
    REPO,
    Attempt,
    audit,
    child_command,
    child_env,
    compare_states,
    final_state,
    plan_kills,
    run_attempt,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="how many times to SIGKILL the run (K)")
    p.add_argument("--seed", type=int, default=None, help="seed of the kill points (default: random)")
    p.add_argument("--epochs", type=int, default=None, help="epochs of the quick preset (default 5)")
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=3.0,
        help="lease ttl of the children. A resume on this machine takes a killed writer's "
        "lease at once, whatever the ttl; it matters across machines only (by default 15 s on "
        "local disk, GCS and S3, 45 s on Drive)",
    )
    p.add_argument("--workdir", default=None, help="where the two checkpoint roots go (default: a temp dir, removed)")
    p.add_argument("--plot", default=None, help="also write the audit's loss plot to this PNG")
    p.add_argument("--quiet", action="store_true", help="do not echo the children's lines")
    args = p.parse_args(argv)

    from adapters.cifar10.train import PRESETS, describe_audit

    cfg = PRESETS["quick"].replace(epochs=args.epochs)
    spe = cfg.n_train // cfg.batch_size
    total = cfg.epochs * spe
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    plan = plan_kills(
        total_steps=total, save_every=cfg.save_every, steps_per_epoch=spe, count=args.kills, rng=random.Random(seed)
    )
    extra = ["--epochs", str(cfg.epochs)]
    work = args.workdir or tempfile.mkdtemp(prefix="ckptsdk-demo-")
    ref_root, run_root = os.path.join(work, "uninterrupted"), os.path.join(work, "killed")
    for root in (ref_root, run_root):
        if os.path.exists(root):
            print(f"error: {root} exists; pick an empty --workdir", file=sys.stderr)
            return 2
    echo = None if args.quiet else print
    print(
        f"quick preset: {total} steps ({spe} per epoch, checkpoint every {cfg.save_every} steps and at "
        f"each epoch end); kill seed {seed}; kill plan: "
        + ", ".join(f"{'during the save at' if e == 'saving' else 'at'} step {s}" for e, s in plan)
    )
    t0 = time.monotonic()
    env = child_env()
    # The uninterrupted reference runs alongside, on the other core.
    os.makedirs(work, exist_ok=True)
    ref_log = open(os.path.join(work, "uninterrupted.log"), "w+")  # a file: a pipe nobody reads could fill
    ref = subprocess.Popen(
        child_command(ref_root, lease_ttl=args.lease_ttl, extra=extra),
        cwd=REPO,
        env=env,
        stdout=ref_log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    attempts: list[Attempt] = []
    try:
        for number, kill in enumerate([*plan, None], start=1):
            att = run_attempt(
                number,
                child_command(run_root, lease_ttl=args.lease_ttl, extra=extra),
                env=env,
                kill=kill,
                local_root=run_root,
                echo=echo,
            )
            attempts.append(att)
            if kill is not None and not att.killed:
                print(
                    f"error: attempt {number} ended (exit {att.returncode}) before its kill point; "
                    f"last lines: {att.lines[-5:]}",
                    file=sys.stderr,
                )
                return 2
            how = (
                f"SIGKILLed at step {att.killed_at}"
                if kill and kill[0] == "step"
                else f"SIGKILLed during the save of step {att.killed_at}: {att.save_state}"
                if kill
                else f"finished (exit {att.returncode})"
            )
            print(f"attempt {number}: {how} after {att.seconds:.1f} s")
        if attempts[-1].returncode not in (0, 1):
            print(
                f"error: the last attempt failed (exit {attempts[-1].returncode}): {attempts[-1].lines[-5:]}",
                file=sys.stderr,
            )
            return 2
        ref.wait(timeout=900)
        if ref.returncode not in (0, 1):
            ref_log.seek(0)
            print(f"error: the uninterrupted run failed:\n{ref_log.read()[-2000:]}", file=sys.stderr)
            return 2
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.wait()
        ref_log.close()

    report = audit(run_root, series=bool(args.plot))
    loss = report.scalars.get("loss")
    ref_step, ref_state = final_state(ref_root)
    run_step, run_state = final_state(run_root)
    diffs = compare_states(ref_state, run_state) if ref_step == run_step else [f"steps {ref_step} vs {run_step}"]
    print()
    print(f"audit: {describe_audit(report)}")
    print(
        f"  attempts: {len(report.attempts)}; steps run twice: {report.overlap_steps}; "
        f"max |loss diff|: {loss.max_abs_diff if loss is not None and report.overlap_steps else 'n/a'}"
    )
    if args.plot:
        from ckptsdk.runlog.plot import plot_audit

        print(f"  loss plot: {plot_audit(report, args.plot)}")
    if diffs:
        print(
            f"final weights DIFFER from the uninterrupted run's at step {run_step}: {len(diffs)} "
            f"differences, e.g. {diffs[:3]}"
        )
    else:
        print(f"final weights and optimizer state at step {run_step} EQUAL the uninterrupted run's, byte for byte")
    print(f"total {time.monotonic() - t0:.0f} s")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not diffs and report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
