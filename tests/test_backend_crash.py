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
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import xxhash

from ckptsdk.backends.local import TMP_PREFIX
from tests._crash_child import content

REPO = Path(__file__).resolve().parents[1]
SIZE = 100 * 10**6
TRIALS = 20
KEY = "ckpt/obj.bin"
# Kill within this many seconds after the child is ready: a 100 MB publish takes ~0.2 s here, so
# the kills land before the first publish, mid-write, mid-fsync, around the rename, between writes.
KILL_WINDOW_S = 0.8


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
@pytest.mark.timeout(900)  # ~20 s per kind on an idle machine; fsync of 100 MB crawls under load
@pytest.mark.parametrize("kind", ["local", "drive"])
def test_sigkill_mid_write_leaves_old_or_new_never_partial(kind, make_backend_target, contents, tmp_path):
    files, known = contents
    target = make_backend_target(kind)
    backend = target.open()
    rng = random.Random({"local": 11, "drive": 12}[kind])
    env = {**os.environ, "PYTHONPATH": str(REPO), **target.env}
    temp_name = re.compile(rf"^ckpt/{re.escape(TMP_PREFIX)}obj\.bin\.(\d+)\.[0-9a-f]{{8}}$")
    seen: Counter[str] = Counter()
    ever_published = False

    for trial in range(TRIALS):
        with open(tmp_path / f"child-{trial}.err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests._crash_child", "write", target.url, KEY, *files],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err,
            )
        try:
            assert _read_line(proc, 60) == "ready", (tmp_path / f"child-{trial}.err").read_text()
            time.sleep(rng.uniform(0, KILL_WINDOW_S))
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
            published = proc.stdout.read().decode().split()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            proc.stdout.close()
        ever_published = ever_published or "published" in published

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
            # Absent is allowed only while nothing was ever published.
            assert not ever_published, f"trial {trial}: the object vanished after a publish"
            seen["absent"] += 1

        leftovers = _temp_files(backend.root)
        for name in leftovers:
            match = temp_name.match(name)
            assert match and int(match.group(1)) == proc.pid, f"unrecognisable leftover {name}"
        assert len(leftovers) <= 1  # one write in flight at a time
        seen["leftover"] += len(leftovers)
        assert backend.sweep(0) == leftovers
        assert _temp_files(backend.root) == []
        assert [info.key for info in backend.list()] == [info.key for info in listed]

    # The kills really landed in the middle of writes, and both contents were published.
    assert seen["leftover"] >= TRIALS // 4, seen
    assert seen["content-0"] + seen["content-1"] >= TRIALS // 2, seen
