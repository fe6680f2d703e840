"""Storage footprint: what a run with kills and restarts leaves behind, and Drive's trash per mode.

Part 1, per backend (local disk, a Drive folder, GCS and S3 on the patched servers at 127.0.0.1): a
40-save run by real processes, 5 of them SIGKILLed at a random moment inside a save and 3 closed
and reopened cleanly; prints the bytes held at the end against keep_last x checkpoint size, and
the bytes each restart wrote before training on (the anchor). Part 2: the story's schedule
(7,800 steps, a save every 100, keep_last=3) on the simulated Drive mount in both retention
modes, counting what the files' changes would send to Drive's trash (ckptsdk/testing/drive_sim.py), scaled
to the story's 89.5 MB checkpoint. Not a test: it prints numbers; nothing fails on a target.

    python -m benchmarks.footprint [--no-gcs] [--no-s3] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.footprint_child import read_line as _line  # noqa: E402
from benchmarks.footprint_child import state  # noqa: E402
from ckptsdk import CheckpointManager, LeaseOptions, Retention  # noqa: E402
from ckptsdk.backends import open_backend  # noqa: E402
from ckptsdk.checkpoint.pruning.usage import usage  # noqa: E402
from ckptsdk.format.layout import TENSORS  # noqa: E402
from ckptsdk.manager import Simulation  # noqa: E402
from ckptsdk.testing.drive_sim import DriveSim  # noqa: E402

KEEP_LAST = 3
SAVES = 40
# One attempt per entry: how it ends. 5 kills inside a save, 3 clean close+reopen, then the end.
SCHEDULE = ["kill", "clean", "kill", "kill", "clean", "kill", "clean", "kill", "end"]
STORY_CKPT_BYTES = 89.5e6  # the story's ResNet-18 training state


def _held(backend: Any, root: Path | None) -> int:
    """Every byte the store holds under the root (objects, and temp files on disk)."""
    if root is not None:
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != ".ckptsdk-lock")
    return sum(o.size for o in backend.list(""))


# Drive's leftover grace, shrunk to this run's time scale (1 h by default): each attempt starts
# after the previous one's leftovers have aged past it, as they would between real restarts.
GRACE_S = 0.2


def kill_run(
    kind: str, url: str, env: dict[str, str], root: Path | None, mode: str | None, seed: int = 0
) -> dict[str, Any]:
    """The 40-save run of part 1 on one backend; returns its numbers."""
    rng = random.Random(seed)
    child_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    zygote = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.footprint_child",
            "zygote",
            url,
            str(KEEP_LAST),
            str(GRACE_S),
            mode or "default",
        ],
        cwd=REPO,
        env=child_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        bufsize=0,
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    saved = 0
    restarts: list[dict[str, Any]] = []
    save_s: list[float] = []
    try:
        assert _line(zygote, 120) == "zygote-ready"
        for i, ending in enumerate(SCHEDULE):
            clean_budget = max(1, (SAVES - saved) // max(1, SCHEDULE[i:].count("clean") + SCHEDULE[i:].count("end")))
            if ending == "end":
                clean_budget = max(1, SAVES - saved)
            cmd = "go 0" if ending == "kill" else f"final {clean_budget}"
            time.sleep(GRACE_S + 0.1)
            zygote.stdin.write(f"{cmd}\n".encode())
            pid = int(_line(zygote, 60).split()[1])
            _tag, step, wrote = _line(zygote, 300).split()
            if i:
                restarts.append({"after": SCHEDULE[i - 1], "resumed_step": int(step), "bytes_written": int(wrote)})
            started = time.monotonic()
            if ending == "kill":
                line = _line(zygote, 300)
                assert line.startswith("saved"), line
                saved += 1
                save_s.append(time.monotonic() - started)
                time.sleep(rng.uniform(0.0, 1.2 * max(save_s)))
                os.kill(pid, signal.SIGKILL)
            while not (line := _line(zygote, 300)).startswith("reaped"):
                saved += line.startswith("saved")
    finally:
        zygote.kill()
        zygote.wait(timeout=30)
        zygote.stdin.close()
        zygote.stdout.close()
    backend = open_backend(url)
    u = usage(backend)
    rows = [c for c in CheckpointManager(backend, read_only=True).list() if c.valid]
    ckpt = rows[-1].size
    return {
        "kind": kind,
        "mode": mode or "default",
        "saves": saved,
        "kills": SCHEDULE.count("kill"),
        "clean_restarts": SCHEDULE[:-1].count("clean"),
        "steps_kept": [c.step for c in rows],
        "checkpoint_bytes": ckpt,
        "keep_last_x_size": KEEP_LAST * ckpt,
        "held_checkpoint_folders": u.total,
        "held_everything": _held(backend, root),
        "uncommitted_bytes": u.uncommitted,
        "restarts": restarts,
        "trash_bytes_ledger": u.trash_bytes,
    }


def story_trash(tmp: Path, mode: str, *, steps: int = 7800, every: int = 100, size: int = 362) -> dict[str, Any]:
    """Part 2: one writer, the story's schedule, on a simulated Drive; what goes to the trash."""
    sim = DriveSim(tmp / f"story-{mode}", vms=("vm1",))
    backend = sim.backend("vm1", "run")
    sim.account()  # the starting point
    s = state(size)
    with CheckpointManager(
        backend,
        retention=Retention(keep_last=KEEP_LAST, mode=mode),
        lease_options=LeaseOptions(ttl=600, settle=0),
        _simulation=Simulation(heartbeat=False),
    ) as mgr:
        mgr.restore(s)
        for step in range(every, steps + 1, every):
            mgr.save(s, step=step)
            sim.account()
        ckpt = mgr.list()[-1].manifest.files[0].size
    sim.account()
    scale = STORY_CKPT_BYTES / ckpt
    tensor_trash = sim.trashed_by_name.get(TENSORS, 0)
    return {
        "mode": mode,
        "saves": steps // every,
        "tensor_file_bytes": ckpt,
        "trashed_files": sim.trashed_files,
        "trashed_bytes": sim.trashed_bytes,
        "revision_bytes": sim.revision_bytes,
        "moved_files": sim.moved_files,
        "replaced_bytes": sim.replaced_bytes,
        "trashed_tensor_file_bytes": tensor_trash,
        # Tensor files scale with the checkpoint; manifests, lease and logs do not.
        "trashed_bytes_at_89_5_MB": round(tensor_trash * scale + sim.trashed_bytes - tensor_trash),
        "revision_bytes_at_89_5_MB": round(sim.revision_bytes * scale),
        "sdk_reported_trash_bytes": mgr._rotation.trashed_bytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-gcs", action="store_true", help="skip the GCS emulator")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 server")
    p.add_argument("--json-out", help="also write the numbers as JSON here")
    args = p.parse_args()
    out: dict[str, Any] = {"load_average": os.getloadavg(), "runs": [], "story": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-footprint-") as tmpdir:
        tmp = Path(tmpdir)
        drive_root = tmp / "drive"
        drive_root.mkdir()
        os.environ["CKPTSDK_DRIVE_ROOT"] = str(drive_root)
        targets: list[tuple[str, str, dict[str, str], Path | None, str | None]] = [
            ("local", str(tmp / "local"), {}, tmp / "local", None),
            ("drive", "drive://recycle", {"CKPTSDK_DRIVE_ROOT": str(drive_root)}, drive_root / "recycle", "recycle"),
            ("drive", "drive://delete", {"CKPTSDK_DRIVE_ROOT": str(drive_root)}, drive_root / "delete", "delete"),
        ]
        emulator = None
        if not args.no_gcs:
            from ckptsdk.testing.gcs_emulator import start_emulator

            emulator = start_emulator()
            bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
            emulator.make_bucket(bucket)
            os.environ.update(emulator.env)
            targets.append(("gcs", emulator.url(bucket, "run"), dict(emulator.env), None, None))
        s3 = None
        if not args.no_s3:
            from ckptsdk.testing.s3_server import start_s3_server

            s3 = start_s3_server()
            bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
            s3.make_bucket(bucket)
            os.environ.update(s3.env)
            targets.append(("s3", s3.url(bucket, "run"), dict(s3.env), None, None))
        try:
            for kind, url, env, root, mode in targets:
                r = kill_run(kind, url, env, root, mode)
                out["runs"].append(r)
                mib = 1 << 20
                print(
                    f"{kind:5} {r['mode']:8} {r['saves']} saves, {r['kills']} kills, {r['clean_restarts']} clean "
                    f"restarts; kept steps {r['steps_kept']}"
                )
                print(
                    f"      held at the end: {r['held_checkpoint_folders'] / mib:.2f} MiB in checkpoint folders, "
                    f"{r['held_everything'] / mib:.2f} MiB in all; keep_last x checkpoint = "
                    f"{r['keep_last_x_size'] / mib:.2f} MiB (checkpoint {r['checkpoint_bytes'] / mib:.2f} MiB); "
                    f"uncommitted {r['uncommitted_bytes']} B"
                )
                per = ", ".join(f"{x['after']}->{x['bytes_written'] / mib:.2f}" for x in r["restarts"])
                print(f"      bytes written by each restart's restore (MiB, after kill/clean): {per}")
                if r["trash_bytes_ledger"] is not None:
                    print(f"      Drive trash (the SDK's ledger): {r['trash_bytes_ledger'] / mib:.2f} MiB")
        finally:
            if emulator is not None:
                emulator.stop()
            if s3 is not None:
                s3.stop()
        for mode in ("delete", "recycle"):
            t = story_trash(tmp, mode)
            out["story"].append(t)
            print(
                f"story on simulated Drive, mode {mode:7}: {t['saves']} saves; to the trash {t['trashed_files']} "
                f"files, {t['trashed_bytes'] / 1e6:.2f} MB ({t['trashed_tensor_file_bytes'] / 1e6:.2f} MB of tensor "
                f"files; = {t['trashed_bytes_at_89_5_MB'] / 1e9:.2f} GB with the story's 89.5 MB checkpoint); "
                f"rewritten in place {t['revision_bytes'] / 1e6:.2f} MB "
                f"(= {t['revision_bytes_at_89_5_MB'] / 1e9:.2f} GB, "
                f"kept as old revisions: quota cost undocumented); renamed {t['moved_files']} files"
            )
    print(f"load average at start: {out['load_average']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
