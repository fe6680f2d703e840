"""Time from a fresh process's start to its first resumed training step, after a SIGKILL. Not a test.

For each row and repetition, on a fresh root: a writer process (``_resume_child.py writer``: the
CIFAR ResNet-18 job on synthetic data, ``CheckpointManager(url)`` with default lease options, a
blocking save every ``--every`` steps) trains until it reports a committed checkpoint, and is then
SIGKILLed. A fresh process (``_resume_child.py resume``) then imports torch and ckptsdk, builds the
job, opens the manager (takes the lease), restores and runs one training step. Its time runs from
just before its ``Popen`` (``time.monotonic`` here) to its report that the step is done (its own
``time.monotonic``: the same clock). Rows:

  local           a local-disk root, same host
  drive-same-vm   drive://run on a simulated Drive mount (a folder as CKPTSDK_DRIVE_ROOT), same VM
  drive-other-vm  ``ckptsdk.testing.drive_sim.DriveSim``: two VM folders synced after --sync-delay;
                  the writer runs on vm1 in UTS and PID namespaces of its own (``unshare``, hostname
                  vm1-writer: another machine), the newcomer on vm2, started once the writer's last
                  changes have reached vm2 (the sync delay is not timed)
  gcs             the patched GCS emulator on 127.0.0.1
  s3              the patched moto S3 server on 127.0.0.1
  fresh-drive     a new drive://run, no writer before: process start to first training step
  torch           the anchor: ``torch.save`` every --every steps (temp name + ``os.replace``),
                  SIGKILL, then import, ``torch.load``, ``load_state_dict``, one step

Targets: a same-host restart (local, drive-same-vm, gcs, s3: the dead writer ran on this host)
at most 1.5x the torch row + 1 s; Drive from another VM at most 60 s. Code whose lease waits out
a ttl takes minutes here (b404d82: 60 s local and GCS, 300 s + a 60 s settle on Drive): that is
what this measures; ``--rows`` skips the slow rows. Every wait is bounded by ``--timeout``.

    python -m benchmarks.bench_resume                                  # every row, 2 reps
    python -m benchmarks.bench_resume --rows local torch --reps 3
    git worktree add /tmp/ckpt-before b404d82                         # an older commit's code,
    python -m benchmarks.bench_resume --code /tmp/ckpt-before --label before   # timed by this run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "benchmarks" / "_resume_child.py"

ROWS: dict[str, str] = {
    "local": "local disk, same host",
    "drive-same-vm": "Drive (simulated), same VM",
    "drive-other-vm": "Drive (simulated), other VM",
    "gcs": "GCS emulator",
    "s3": "S3 (moto server)",
    "fresh-drive": "fresh Drive root, no writer",
    "torch": "torch.save/torch.load (anchor)",
}
SAME_HOST = ("local", "drive-same-vm", "gcs", "s3")
OTHER_VM_LIMIT_S = 60.0
PHASES = ("import", "build", "open", "restore", "step")  # what the resuming child reports, in order
EXIT_WAIT_S = 120.0  # the newcomer's close after its step (untimed)
OTHER_HOST = "vm1-writer"


@dataclass(frozen=True)
class Settings:
    """What every row's children run with."""

    code: str | None = None  # a checkout whose ckptsdk the children import (None: this one)
    width: int = 64  # ResNet-18 proper: 89 MB of model and momentum
    batch_size: int = 8
    every: int = 2
    timeout: float = 900.0
    sync_delay: float = 2.0


@dataclass
class Outcome:
    """One repetition of one row: cumulative seconds from Popen at each phase, or an error."""

    at: dict[str, float] = field(default_factory=dict)
    committed: int = 0  # the writer's committed step when it was killed (0: no writer)
    restored: int = 0
    error: str = ""
    note: str = ""

    @property
    def total(self) -> float | None:
        return None if self.error else self.at.get("step")


@dataclass
class Place:
    """Where a row's processes run: the URL, each one's environment, the writer's wrapper."""

    url: str
    writer_env: dict[str, str] = field(default_factory=dict)
    newcomer_env: dict[str, str] = field(default_factory=dict)
    wrap: list[str] = field(default_factory=list)
    writer: bool = True
    torch: bool = False
    sim: Any = None


class RowFailed(Exception):
    """A child failed, exited early or did not report in time: the repetition has no figure."""


class Child:
    """A child process in a session of its own; its stdout lines arrive through a reader thread."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True
        )
        self.code = ""
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").rstrip("\n"))
        self._lines.put(None)

    def expect(self, prefix: str, deadline: float) -> list[str]:
        """The next line starting with ``prefix``, split; RowFailed past ``deadline`` (monotonic)."""
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RowFailed(f"timed out: no {prefix!r} line within the timeout") from None
            if line is None:
                raise RowFailed(f"exited with {self.proc.wait()} before {prefix!r}: {self.stderr_tail()}")
            if line.startswith("error "):
                raise RowFailed(line)
            if line.startswith("code "):
                self.code = line[5:]
            if line.startswith(prefix):
                return line.split()

    def stderr_tail(self, n: int = 600) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace").replace("\n", " | ")

    def exited(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the child's whole session (an ``unshare`` wrapper and the writer inside)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._reader.join(timeout=60)  # EOF once every process holding the pipe is gone
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class Servers:
    """The object-store servers, started on first use and stopped at the end of the run."""

    def __init__(self) -> None:
        self._running: dict[str, Any] = {}

    def get(self, kind: str) -> Any:
        if kind not in self._running:
            if kind == "gcs":
                from ckptsdk.testing.gcs_emulator import start_emulator

                self._running[kind] = start_emulator()
            else:
                from ckptsdk.testing.s3_server import start_s3_server

                self._running[kind] = start_s3_server()
        return self._running[kind]

    def close(self) -> None:
        for server in self._running.values():
            server.stop()
        self._running.clear()


def child_env(settings: Settings, extra: dict[str, str]) -> dict[str, str]:
    """This environment, ``extra``, and ``--code``'s checkout first on PYTHONPATH (then this one)."""
    env = dict(os.environ, **extra)
    paths = [settings.code] if settings.code else []
    paths += [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # see /work/shared/GCS_TESTING.md
    return env


def child_cmd(role: str, place: Place, settings: Settings) -> list[str]:
    cmd = [sys.executable, str(CHILD), role, place.url, "--width", str(settings.width)]
    cmd += ["--batch-size", str(settings.batch_size), "--every", str(settings.every)]
    return cmd + (["--torch"] if place.torch else [])


@contextlib.contextmanager
def place_of(row: str, tmp: Path, servers: Servers, settings: Settings) -> Iterator[Place]:
    """A fresh root for ``row`` under ``tmp`` (a new bucket for the object stores)."""
    if row == "local":
        yield Place(str(tmp / "root"))
    elif row in ("drive-same-vm", "fresh-drive"):
        (tmp / "drive").mkdir()  # the mount: DriveBackend refuses a missing one
        env = {"CKPTSDK_DRIVE_ROOT": str(tmp / "drive")}
        yield Place("drive://run", env, env, writer=row == "drive-same-vm")
    elif row == "drive-other-vm":
        from ckptsdk.testing.drive_sim import DriveSim

        # The writer is another machine: its own hostname, and its pid means nothing here.
        wrap = ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c", 'hostname "$0" && exec "$@"']
        runtime = 3 * settings.timeout + 600  # the syncer's own bound, past every wait of the row
        with DriveSim(tmp / "sim", delay=settings.sync_delay, max_runtime=runtime) as sim:
            yield Place("drive://run", sim.env("vm1"), sim.env("vm2"), wrap=[*wrap, OTHER_HOST], sim=sim)
    elif row in ("gcs", "s3"):
        server = servers.get(row)
        bucket = f"resume-{uuid.uuid4().hex[:12]}"
        server.make_bucket(bucket)
        yield Place(server.url(bucket, "run"), dict(server.env), dict(server.env))
    elif row == "torch":
        yield Place(str(tmp / "ckpt.pt"), torch=True)
    else:
        raise ValueError(f"unknown row {row!r}; the rows are {', '.join(ROWS)}")


def kill_writer(place: Place, tmp: Path, settings: Settings) -> tuple[int, str]:
    """Run the writer until it reports a committed checkpoint, then SIGKILL it: (step, its code)."""
    child = Child(
        place.wrap + child_cmd("writer", place, settings), child_env(settings, place.writer_env), tmp / "writer.log"
    )
    try:
        parts = child.expect("committed ", time.monotonic() + settings.timeout)
    finally:
        child.kill()
    return int(parts[1]), child.code


def time_newcomer(place: Place, tmp: Path, settings: Settings, outcome: Outcome) -> str:
    """Start the resuming child and record when it reaches each phase; returns its code."""
    env = child_env(settings, place.newcomer_env)
    cmd = child_cmd("resume", place, settings)
    t0 = time.monotonic()
    child = Child(cmd, env, tmp / "newcomer.log")
    try:
        deadline = t0 + settings.timeout
        for phase in PHASES:
            parts = child.expect(f"at {phase} ", deadline)
            outcome.at[phase] = float(parts[2]) - t0
            if phase == "restore":
                outcome.restored = int(parts[3])
        if not child.exited(EXIT_WAIT_S):
            outcome.note = f"did not exit within {EXIT_WAIT_S:.0f} s of its step (killed)"
        elif child.proc.returncode:
            outcome.note = f"exit status {child.proc.returncode} after its step: {child.stderr_tail()}"
    finally:
        child.kill()
    return child.code


def one_rep(row: str, servers: Servers, settings: Settings, base: str | None) -> tuple[Outcome, str]:
    """One repetition of ``row`` on a fresh root: (its outcome, the ckptsdk the children ran)."""
    outcome, code = Outcome(), ""
    with tempfile.TemporaryDirectory(prefix=f"ckpt-resume-{row}-", dir=base) as tmp:
        try:
            with place_of(row, Path(tmp), servers, settings) as place:
                if place.writer:
                    outcome.committed, code = kill_writer(place, Path(tmp), settings)
                if place.sim is not None:
                    place.sim.wait_delivered(timeout=settings.timeout)
                code = time_newcomer(place, Path(tmp), settings, outcome) or code
        except (RowFailed, TimeoutError) as exc:
            outcome.error = str(exc)
    if not outcome.error and outcome.restored < outcome.committed:
        outcome.note = f"restored step {outcome.restored}, the writer had committed {outcome.committed}"
    return outcome, code


def run(
    rows: list[str], reps: int, settings: Settings, *, base: str | None = None, progress: bool = True
) -> tuple[dict[str, list[Outcome]], set[str]]:
    """Every row ``reps`` times, the rows' order rotated per repetition: (outcomes, codes run)."""
    from tqdm import tqdm

    results: dict[str, list[Outcome]] = {row: [] for row in rows}
    codes: set[str] = set()
    servers = Servers()
    try:
        with tqdm(total=reps * len(rows), disable=not progress, unit="row") as bar:
            for rep in range(reps):
                k = rep % len(rows)
                for row in rows[k:] + rows[:k]:
                    bar.set_description(f"rep {rep + 1} {row}")
                    outcome, code = one_rep(row, servers, settings, base)
                    results[row].append(outcome)
                    codes.update([code] if code else [])
                    bar.update()
    finally:
        servers.close()
    return results, codes


@dataclass(frozen=True)
class Summary:
    """One row's figures: seconds to the first step (median, min, max) and each phase's median."""

    n: int
    failed: list[str]
    median: float | None
    lo: float | None
    hi: float | None
    phases: dict[str, float]
    notes: list[str]


def summarize(outcomes: list[Outcome]) -> Summary:
    totals = [o.total for o in outcomes if o.total is not None]
    ok = [o for o in outcomes if not o.error]
    phases: dict[str, float] = {}
    prev = "start"
    for phase in PHASES:  # the time each phase took (cumulative marks, differenced)
        spans = [o.at[phase] - (o.at[prev] if prev != "start" else 0.0) for o in ok]
        if spans:
            phases[phase] = statistics.median(spans)
        prev = phase
    return Summary(
        n=len(outcomes),
        failed=[o.error for o in outcomes if o.error],
        median=statistics.median(totals) if totals else None,
        lo=min(totals) if totals else None,
        hi=max(totals) if totals else None,
        phases=phases,
        notes=[o.note for o in outcomes if o.note],
    )


def target(row: str, median: float | None, anchor: float | None) -> str:
    """The row's target and whether its median meets it."""
    if median is None:
        return "-"
    if row in SAME_HOST:
        if anchor is None:
            return "same host: needs the torch row"
        limit = 1.5 * anchor + 1.0
        return f"<= {limit:.1f} s (1.5x torch + 1 s): {'ok' if median <= limit else 'MISSED'}"
    if row == "drive-other-vm":
        return f"<= {OTHER_VM_LIMIT_S:.0f} s: {'ok' if median <= OTHER_VM_LIMIT_S else 'MISSED'}"
    return "-"


def format_table(summaries: dict[str, Summary]) -> list[str]:
    """The table's lines: one per row, then its failures and notes."""
    anchor = summaries["torch"].median if "torch" in summaries else None
    head = f"{'row':32s} {'median s (min-max)':>22s} {'x torch':>8s}  "
    head += " ".join(f"{p:>7s}" for p in PHASES) + "  target"
    lines = [head]
    for row, s in summaries.items():
        if s.median is None:
            figure, ratio = f"{'failed':>22s}", f"{'-':>8s}"
        else:
            figure = f"{s.median:8.1f} ({s.lo:6.1f}-{s.hi:6.1f})"
            ratio = f"{s.median / anchor:8.2f}" if anchor else f"{'-':>8s}"
        spans = " ".join(f"{s.phases[p]:7.1f}" if p in s.phases else f"{'-':>7s}" for p in PHASES)
        lines.append(f"{ROWS[row]:32s} {figure} {ratio}  {spans}  {target(row, s.median, anchor)}")
        lines += [f"    failed ({len(s.failed)}/{s.n}): {e}" for e in s.failed]
        lines += [f"    note: {n}" for n in s.notes]
    return lines


def code_label(code: str) -> str:
    """A checkout and its commit (``git rev-parse``), as far as git can tell."""
    try:
        rev = subprocess.run(
            ["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        rev = ""
    dirty = ""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        status = subprocess.run(
            ["git", "-C", code, "status", "--porcelain", "--", "ckptsdk"], capture_output=True, text=True, timeout=30
        )
        dirty = " + uncommitted changes in ckptsdk/" if status.stdout.strip() else ""
    return f"{code} ({rev or 'not a git checkout'}{dirty})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="rows to run (default: all)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each row (default 2)")
    ap.add_argument("--code", default=None, help="a checkout whose ckptsdk the children import (default: this one)")
    ap.add_argument("--label", default="", help="a tag printed with the results")
    ap.add_argument("--width", type=int, default=64, help="first-stage channels (64: ResNet-18 proper)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--every", type=int, default=2, help="the writer saves every this many steps (default 2)")
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on each wait for a child (default 900 s)")
    ap.add_argument("--sync-delay", type=float, default=2.0, help="DriveSim's delay between VMs (default 2 s)")
    ap.add_argument("--dir", default=None, help="where the roots go (default: the temp dir)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    code = os.path.abspath(args.code) if args.code else None
    if code and not os.path.isdir(os.path.join(code, "ckptsdk")):
        ap.error(f"--code {args.code}: no ckptsdk/ there (give a checkout's root)")
    settings = Settings(code, args.width, args.batch_size, args.every, args.timeout, args.sync_delay)
    rows = list(dict.fromkeys(args.rows))
    tag = f"[{args.label}] " if args.label else ""
    print(f"{tag}command: {shlex.join([sys.executable, '-m', 'benchmarks.bench_resume', *sys.argv[1:]])}")
    print(f"{tag}code under test: {code_label(code or str(REPO))}")
    load_start = os.getloadavg()
    print(f"{tag}load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}", flush=True)
    results, codes = run(rows, args.reps, settings, base=args.dir)
    load_end = os.getloadavg()
    summaries = {row: summarize(results[row]) for row in rows}
    print(
        f"{tag}process start -> first resumed training step, after SIGKILL of the writer; CIFAR ResNet-18 "
        f"width {settings.width}, batch {settings.batch_size}, a save every {settings.every} steps, "
        f"{args.reps} reps; phases: median seconds each"
    )
    print("\n".join(format_table(summaries)))
    print(f"{tag}ckptsdk imported by the children from: {', '.join(sorted(codes)) or '-'}")
    print(f"{tag}load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    if args.json_out:
        report = {
            "argv": sys.argv,
            "label": args.label,
            "settings": asdict(settings),
            "loadavg": {"start": load_start, "end": load_end},
            "codes": sorted(codes),
            "outcomes": {row: [asdict(o) for o in results[row]] for row in rows},
            "summary": {row: asdict(s) for row, s in summaries.items()},
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
