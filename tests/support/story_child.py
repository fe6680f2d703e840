"""The parent side of tests/support/_story_writer.py: start one of its modes, read its events, wait on them.

The child's command line and its JSON-lines event file are its protocol; this module is where the
tests that run it (tests/lease/test_lease.py, tests/stories/test_lease_story.py) speak it. Each
child writes its stderr next to its events (``EVENTS.log``), quoted when a wait fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests.support.waiting import poll_until

REPO = Path(__file__).resolve().parents[2]

Event = dict[str, Any]


def elsewhere(host: str, cmd: list[str]) -> list[str]:
    """``cmd`` run as if on another machine named ``host``: its own hostname and pid namespace
    (``unshare --uts --pid --fork --mount-proc``, as root). Killing the returned process (the
    ``unshare``) kills everything inside; :func:`inner_pid` finds the command itself."""
    return [
        "unshare",
        "--uts",
        "--pid",
        "--mount-proc",
        "--kill-child=SIGKILL",
        "sh",
        "-c",
        # Not exec: the command must not be the namespace's init (pid 1 ignores signals it has no
        # handler for, SIGKILL from inside included), and its exit status passes through sh.
        'hostname "$0" && "$@"',
        host,
        *cmd,
    ]


def can_unshare() -> bool:
    """Whether this machine lets the tests make "another machine" (root and namespaces)."""
    try:
        probe = subprocess.run(elsewhere("probe", ["true"]), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def inner_pid(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """The host pid of the command an :func:`elsewhere` process runs (unshare, then sh, then it)."""

    def children(pid: int) -> list[int]:
        try:
            return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            return []

    def child() -> int | None:
        shells = children(proc.pid)
        commands = children(shells[0]) if shells else []
        return commands[0] if commands else None

    pid = poll_until(child, timeout)
    if pid is None:
        raise AssertionError(f"the process {proc.pid} started nothing inside its namespace within {timeout} s")
    return pid


def spawn(
    mode: str,
    url: str,
    events: Path,
    *args: str,
    options: Mapping[str, Any],
    env: Mapping[str, str],
    host: str | None = None,
) -> subprocess.Popen[bytes]:
    """``python -m tests.support._story_writer MODE URL --events EVENTS --options JSON *args``.

    ``options`` are the storage options (sent as JSON), ``env`` the variables the root needs on
    top of this process's (a Drive root, an emulator's address). ``host``: run it as another
    machine of that name (:func:`elsewhere`).
    """
    cmd = [
        sys.executable,
        "-m",
        "tests.support._story_writer",
        mode,
        url,
        "--events",
        str(events),
        "--options",
        json.dumps(dict(options)),
        *args,
    ]
    if host is not None:
        cmd = elsewhere(host, cmd)
    child_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    with open(events.with_suffix(".log"), "wb") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=subprocess.DEVNULL, stderr=log)


def read_events(path: Path) -> list[Event]:
    """Every event the child wrote so far (none before it opened the file)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def child_log(path: Path) -> str:
    """The last 4,000 characters of the child's stderr, for failure messages."""
    p = path.with_suffix(".log")
    return p.read_text()[-4000:] if p.exists() else ""


def wait_events(
    path: Path, proc: subprocess.Popen[bytes], timeout: float, pred: Callable[[list[Event]], Any], what: str
) -> list[Event]:
    """The events once ``pred(events)`` holds; fail at once if the child reports an error or exits."""

    def seen() -> list[Event] | None:
        exited = proc.poll() is not None  # before reading: an event written just before exiting counts
        evs = read_events(path)
        if pred(evs):
            return evs
        errors = [e for e in evs if e["event"] == "error"]
        if errors:
            raise AssertionError(f"{path.name}: {errors[0]}\n{child_log(path)}")
        if exited:
            raise AssertionError(f"{path.name} exited {proc.returncode} before {what}\n{child_log(path)}")
        return None

    found = poll_until(seen, timeout)
    if found is None:
        raise AssertionError(f"{path.name}: no {what} within {timeout} s\n{child_log(path)}")
    return found


def wait_event(path: Path, proc: subprocess.Popen[bytes], name: str, timeout: float) -> Event:
    """The first event called ``name``, waited for as :func:`wait_events` waits."""
    evs = wait_events(path, proc, timeout, lambda evs: any(e["event"] == name for e in evs), repr(name))
    return next(e for e in evs if e["event"] == name)
