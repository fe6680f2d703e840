"""benchmarks/bench_reference.py runs, and its figures mean what its report says (issue 48).

Not a speed test: the smoke run (tiny bases, no sleep) runs as a user runs it, through
bench_incremental's ``--reference`` entry, in its own process; the test checks what holds whatever
the machine's speed: every restore bit-exact, store mode's root holding the base and reference
mode's not, and the bit-exact check seeing a one-ulp change in a frozen tensor or a moment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.bench_reference import Job, _equal

REPO = Path(__file__).resolve().parents[2]


def _bump(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(float("inf")))


def test_the_bit_exact_check_catches_one_changed_element() -> None:
    a, b = Job(4, 2), Job(4, 2)
    a.step(1, 0.0)
    b.step(1, 0.0)
    assert _equal(a.state.state_dict()["objects"], b.state.state_dict()["objects"])
    _bump(b.base[0].weight)  # the frozen base
    assert not _equal(a.state.state_dict()["objects"], b.state.state_dict()["objects"])
    b.base[0].weight.data.copy_(a.base[0].weight)
    _bump(next(iter(b.opt.state.values()))["exp_avg"])
    assert not _equal(a.state.state_dict()["objects"], b.state.state_dict()["objects"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_smoke_run_restores_bit_exact_and_reference_mode_stores_no_base(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_incremental", "--reference", "--smoke", "--json-out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    base = 8 << 20  # SMOKE's base_mib
    for name in ("store-8", "reference-8", "trainer-8", "store-4", "reference-4"):
        (run,) = figures[name]
        assert run["bit_exact"], name
        assert len(run["pauses"]) == 3 and run["bytes_per_save"] > 0, name
    assert figures["store-8"][0]["footprint"] >= base  # the base is stored once, in shared/
    assert figures["reference-8"][0]["footprint"] < base // 4  # recorded by digest: adapters only
    # What a save writes after the first is the adapters and their moments in both ckptsdk modes.
    assert figures["reference-8"][0]["bytes_per_save"] < base // 4
    assert "reference footprint / base" in proc.stdout and "digest proof" in proc.stdout
