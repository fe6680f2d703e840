"""Restore a root read-only under ``ulimit -v`` (RLIMIT_AS = current size + HEADROOM bytes).

Usage: ``python -m tests.support._alloc_child ROOT HEADROOM``. Prints one JSON line: the step
restored and the digest of the state, or the error's type, message and its size fields. The
limit is set after torch is imported, so it bounds what the restore allocates, nothing else.
"""

from __future__ import annotations

import json
import resource
import sys

from ckptsdk import CheckpointManager
from ckptsdk.errors import CkptError
from tests.support._fault_state import digest, make_state


def main(root: str, headroom: int) -> dict:
    with open("/proc/self/status", encoding="ascii") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))
    state = make_state(0)
    try:
        point = CheckpointManager(root, read_only=True).restore(state)
    except CkptError as exc:
        fields = {k: getattr(exc, k) for k in ("needed", "available", "key") if hasattr(exc, k)}
        return {"error": type(exc).__name__, "message": str(exc), **fields}
    return {"step": point.step if point else None, "digest": digest(state)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
