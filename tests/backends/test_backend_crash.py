"""Atomic publish under a real crash: a child writing ~100 MB objects is SIGKILLed at random moments.

After each kill the object must be absent (nothing published yet) or whole (one of the two known
contents, by digest), never partial; the crashed write's temp file must be recognisable, unlisted,
and removed by ``sweep``. Local disk and the Drive backend (on a local folder).
"""

from __future__ import annotations

import os
import random
import re
import select
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import xxhash

from ckptsdk.backends.local import TMP_PREFIX
from tests.support._crash_child import content

REPO = Path(__file__).resolve().parents[2]
SIZE = 100 * 10**6
TRIALS = 20
KEY = "ckpt/obj.bin"
# Kill within ~1.5 publish times after the child is ready (measured as we go: ~0.2 s idle, much
# more on a loaded disk), so the kills land before the first publish, mid-write, mid-fsync, around
# the rename and in the next write, without writing many more 100 MB objects than needed.
FIRST_GUESS_S = 0.3


@pytest.fixture(scope="module")
def contents(tmp_path_factory) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The two contents' files (the child maps them) and digest -> (which content, size)."""
    folder = tmp_path_factory.mktemp("contents")
    files, known = [], {}
    for which in (0, 1):
        data = content(which, SIZE)
        known[xxhash.xxh3_128_hexdigest(data)] = (which, len(data))
        files.append(str(folder / f"content-{which}"))
        with open(files[-1], "wb") as f:
            f.write(data)
    return files, known


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"child {proc.pid} printed nothing for {timeout} s")
    return proc.stdout.readline().decode().strip()


def _temp_files(root: str) -> list[str]:
    found = []
    for folder, _dirs, files in os.walk(root):
        found += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.startswith(TMP_PREFIX)]
    return sorted(found)


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~10 s per kind here; fsync of 100 MB crawls on a loaded disk
@pytest.mark.parametrize("kind", ["local", "drive"])
def test_sigkill_mid_write_leaves_old_or_new_never_partial(kind, make_backend_target, contents, tmp_path):
    files, known = contents
    target = make_backend_target(kind)
    backend = target.open()
    rng = random.Random({"local": 11, "drive": 12}[kind])
    env = {**os.environ, "PYTHONPATH": str(REPO), **target.env}
    temp_name = re.compile(rf"^ckpt/{re.escape(TMP_PREFIX)}obj\.bin\.(\d+)\.[0-9a-f]{{8}}$")
    seen: Counter[str] = Counter()
    publish_times: list[float] = []
    state: int | None = None  # which content the object holds (None: absent)
    with open(tmp_path / "zygote.err", "wb") as err:
        zygote = subprocess.Popen(
            [sys.executable, "-m", "tests.support._crash_child", "zygote", target.url, KEY, *files],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            bufsize=0,  # unbuffered: _read_line's select() must see every line still unread
        )
    try:
        assert _read_line(zygote, 120) == "zygote-ready", (tmp_path / "zygote.err").read_text()
        for trial in range(TRIALS):
            zygote.stdin.write(f"go {trial}\n".encode())  # start with the other content
            zygote.stdin.flush()
            ready = _read_line(zygote, 60).split()
            assert ready[0] == "ready", ready
            writer, t_ready = int(ready[1]), float(ready[2])
            published = []
            if trial % 3 == 2:
                # Every 3rd trial kills right after a publish, so both contents are seen whatever
                # the random kills below hit on a slow or a fast disk (a trial writes content
                # trial % 2 first: every 4th trial, always odd, only ever showed content 1).
                published.append(_read_line(zygote, 120).split())
            else:
                window = 1.5 * (statistics.median(publish_times) if publish_times else FIRST_GUESS_S)
                time.sleep(rng.uniform(0, window))
            os.kill(writer, signal.SIGKILL)
            while not (line := _read_line(zygote, 60).split())[0] == "reaped":
                published.append(line)
            assert line[1:] == [str(writer), str(-signal.SIGKILL)], line
            if published:
                publish_times.append(float(published[0][2]) - t_ready)
            # The object must hold what it held before this trial or what the writer published
            # (or was publishing when killed: the rename may land just before the kill).
            in_flight = (trial + len(published)) % 2
            allowed = {state, in_flight} if not published else {int(published[-1][1]), in_flight}
            state = _check_after_kill(backend, known, trial, writer, allowed, temp_name, seen)
    finally:
        zygote.stdin.close()
        try:
            zygote.wait(timeout=60)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait(timeout=30)
        zygote.stdout.close()
    assert zygote.returncode == 0, (tmp_path / "zygote.err").read_text()
    # The kills really landed in the middle of writes, and both contents were published.
    assert seen["leftover"] >= TRIALS // 4, seen
    assert seen["content-0"] >= 1 and seen["content-1"] >= 1, seen


def _check_after_kill(backend, known, trial, writer, allowed, temp_name, seen) -> int | None:
    """The object is absent or whole (one of ``allowed``: None = absent, 0/1 = content); the
    killed writer's temp file is recognisable and swept. Returns what the object holds."""
    listed = backend.list()
    assert [info.key for info in listed] in ([], [KEY])
    if listed:
        data = backend.read(KEY)
        digest = xxhash.xxh3_128_hexdigest(data)
        assert digest in known, f"trial {trial}: {len(data)} bytes match neither content: torn"
        which, size = known[digest]
        assert listed[0].size == size == len(data)
        seen[f"content-{which}"] += 1
        del data
    else:
        which = None
        seen["absent"] += 1
    assert which in allowed, f"trial {trial}: the object holds {which}, expected one of {allowed}"

    leftovers = _temp_files(backend.root)
    for name in leftovers:
        match = temp_name.match(name)
        assert match and int(match.group(1)) == writer, f"unrecognisable leftover {name}"
    assert len(leftovers) <= 1  # one write in flight at a time
    seen["leftover"] += len(leftovers)
    assert backend.sweep(0) == leftovers
    assert _temp_files(backend.root) == []
    assert [info.key for info in backend.list()] == [info.key for info in listed]
    return which
