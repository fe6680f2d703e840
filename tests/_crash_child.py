"""Child processes for the backend crash and race tests (run as ``python -m tests._crash_child``).

``write URL KEY FILE0 FILE1``: publish the two contents (memory-mapped from the files, so startup
is instant) at KEY, alternating, until killed (the parent SIGKILLs it at a random moment). ``race URL``: for each ``ROUND START`` line on stdin, wait until
the wall clock reads START, ``create`` ``race/ROUND`` and print one JSON line saying whether it won.
Test logic (what to assert) lives in the test files.
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
MAX_WRITES = 500  # bounded even if the parent forgets to kill us


def content(which: int, size: int) -> bytearray:
    """Content ``which`` (0 or 1), of different sizes so a prefix of either matches neither.

    Random 1 MiB blocks, each stamped with its index, so a block out of place changes the digest
    too; built by joining (fast) rather than drawing 100 MB of random numbers.
    """
    size -= which * 12345
    block = 1 << 20
    data = bytearray(random.Random(1000 + which).randbytes(block)) * (size // block + 1)
    for i in range(len(data) // block):
        struct.pack_into("<Q", data, i * block, i)
    del data[size:]
    return data


def _chunks(data: mmap.mmap) -> Iterator[memoryview]:
    view = memoryview(data)
    for start in range(0, len(view), CHUNK):
        yield view[start:start + CHUNK]


def write_forever(url: str, key: str, sources: list[str]) -> None:
    backend = open_backend(url)
    contents = []
    for path in sources:
        with open(path, "rb") as f:
            contents.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    print("ready", flush=True)
    for i in range(MAX_WRITES):
        backend.write(key, _chunks(contents[i % 2]))
        print(f"published {i}", flush=True)


def race(url: str) -> None:
    backend = open_backend(url)
    me = f"pid-{os.getpid()}"
    print("ready", flush=True)
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
        print(json.dumps({"round": int(round_no), "who": me, "outcome": outcome,
                          "began": began, "ended": time.time()}), flush=True)


def main(argv: list[str]) -> None:
    if argv[0] == "write":
        write_forever(argv[1], argv[2], argv[3:5])
    elif argv[0] == "race":
        race(argv[1])
    else:
        raise SystemExit(f"usage: python -m tests._crash_child write URL KEY FILE0 FILE1 | race URL (got {argv})")


if __name__ == "__main__":
    main(sys.argv[1:])
