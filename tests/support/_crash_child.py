"""Child processes for the backend crash and race tests (run as ``python -m tests.support._crash_child``).

``zygote URL KEY FILE0 FILE1``: import ckptsdk and map the two contents once, then for each
``go N`` line on stdin fork a writer that publishes the contents at KEY, alternating and starting
with content N % 2, until the parent SIGKILLs it; the zygote reaps it and reports. (Forking skips the interpreter
start and the ``import ckptsdk`` of each trial, seconds on a loaded machine.) ``race URL``: for each
``ROUND START`` line on stdin, wait until the wall clock reads START, ``create`` ``race/ROUND``
and print one JSON line saying whether it won. What to assert lives in the test files.

Protocol lines (stdout): ``zygote-ready``; per ``go``: ``ready PID T``, ``published WHICH T``...,
``reaped PID STATUS`` (T: ``time.monotonic()``; STATUS: the negative signal number or exit code).
"""

from __future__ import annotations

import json
import mmap
import os
import random
import struct
import sys
import time
from collections.abc import Iterator

from ckptsdk.backends import open_backend
from ckptsdk.errors import PreconditionFailed

CHUNK = 8 << 20
MAX_WRITES = 500  # bounded even if the parent forgets to kill a writer


def content(which: int, size: int) -> bytearray:
    """Content ``which`` (0 or 1), of different sizes so a prefix of either matches neither.

    Random 1 MiB blocks, each stamped with its index, so a block out of place changes the digest
    too; built by repeating one block (fast) rather than drawing 100 MB of random numbers.
    """
    size -= which * 12345
    block = 1 << 20
    data = bytearray(random.Random(1000 + which).randbytes(block)) * (size // block + 1)
    for i in range(len(data) // block):
        struct.pack_into("<Q", data, i * block, i)
    del data[size:]
    return data


def _say(line: str) -> None:
    # os.write, not print: a forked writer must not share (and double-flush) the zygote's buffer.
    os.write(1, (line + "\n").encode())


def _chunks(data: mmap.mmap) -> Iterator[memoryview]:
    view = memoryview(data)
    for start in range(0, len(view), CHUNK):
        yield view[start : start + CHUNK]


def _write_forever(backend, key: str, contents: list[mmap.mmap], first: int) -> None:  # type: ignore[no-untyped-def]
    _say(f"ready {os.getpid()} {time.monotonic()}")
    for i in range(first, first + MAX_WRITES):
        backend.write(key, _chunks(contents[i % 2]))
        _say(f"published {i % 2} {time.monotonic()}")


def zygote(url: str, key: str, sources: list[str]) -> None:
    backend = open_backend(url)
    contents = []
    for path in sources:
        with open(path, "rb") as f:
            contents.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    sys.stdout.flush()
    _say("zygote-ready")
    for line in sys.stdin:
        command = line.split()
        if command[:1] != ["go"]:
            continue
        pid = os.fork()
        if pid == 0:
            try:
                _write_forever(backend, key, contents, int(command[1]))
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _say(f"reaped {pid} {code}")


def race(url: str) -> None:
    backend = open_backend(url)
    me = f"pid-{os.getpid()}"
    _say("ready")
    for line in sys.stdin:
        round_no, start = line.split()
        time.sleep(max(0.0, float(start) - time.time()))
        began = time.time()
        try:
            # Big enough (~200 KB) that both racers are still writing their temp files when the
            # other commits: the conflict is decided at link/rename, not by the early check.
            backend.create(f"race/{int(round_no):03d}", me.encode() * 16384)
            outcome = "won"
        except PreconditionFailed:
            outcome = "lost"
        _say(json.dumps({"round": int(round_no), "who": me, "outcome": outcome, "began": began, "ended": time.time()}))


def main(argv: list[str]) -> None:
    if argv[:1] == ["zygote"] and len(argv) == 5:
        zygote(argv[1], argv[2], argv[3:5])
    elif argv[:1] == ["race"] and len(argv) == 2:
        race(argv[1])
    else:
        raise SystemExit(
            f"usage: python -m tests.support._crash_child zygote URL KEY FILE0 FILE1 | race URL (got {argv})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
