"""Child of tests/stories/test_faults_enospc.py: saves onto a nearly full, size-limited filesystem.

``python -m tests.support._fault_enospc DIR`` runs inside a private mount namespace in which DIR is a
small tmpfs. For each trial it prepares a root with steps 1 and 2, fills the filesystem with a
ballast file until only ``free`` bytes are left (0, 4 KiB, 8 KiB, ...), tries to save step 3
(sync or async), records what was raised, and removes the ballast. Then one fresh process
restores every root (tests.support._fault_state verify) and the child prints one JSON document:
``{"trials": [{"root", "free", "blocking", "raised"}...], "reports": [...]}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ckptsdk import CheckpointManager, LeaseOptions
from ckptsdk.errors import CkptError
from ckptsdk.manager import Simulation
from tests.support._fault_state import make_state

FREE_STEPS = range(0, 96 * 1024, 4096)


def _free(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _ballast(path: str, leave: int) -> None:
    folder = os.path.dirname(path)
    with open(path, "wb") as f:
        while _free(folder) > leave:
            f.write(b"\0" * min(1 << 20, max(4096, _free(folder) - leave)))
            f.flush()
            os.fsync(f.fileno())


def main(top: str) -> None:
    trials = []
    for i, free in enumerate(FREE_STEPS):
        root = os.path.join(top, f"root-{i}")
        blocking = i % 2 == 0
        with CheckpointManager(root, keep_last=3, _simulation=Simulation(heartbeat=False)) as mgr:
            mgr.restore(make_state(0))
            for step in (1, 2):
                mgr.save(make_state(step), step=step)
        ballast = os.path.join(top, "ballast")
        _ballast(ballast, free)
        raised = None
        try:
            with CheckpointManager(
                root, keep_last=3, _simulation=Simulation(heartbeat=False), lease_options=LeaseOptions(ttl=1.0)
            ) as mgr:
                mgr.restore(make_state(0))
                mgr.save(make_state(3), step=3, blocking=blocking)
                mgr.wait()
        except CkptError as exc:  # anything else (a raw OSError) fails the test with its traceback
            raised = f"{type(exc).__name__}: {exc}"
        os.unlink(ballast)
        trials.append({"root": root, "free": free, "blocking": blocking, "raised": raised})
    out = subprocess.run(
        [sys.executable, "-m", "tests.support._fault_state", "verify", *(t["root"] for t in trials)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    print(json.dumps({"trials": trials, "reports": [json.loads(line) for line in out.stdout.splitlines()]}))


if __name__ == "__main__":
    main(sys.argv[1])
