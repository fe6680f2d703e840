"""benchmarks/bench_save_cpu.py times what it says: every part of ``save()`` it names is reached.

Not a speed test. A rename inside the save path would leave a wrapper on a method ``save()`` no
longer calls, and the benchmark would print a part as costing nothing; each part must be timed
once per save, and the parts must fit inside the save's own total.
"""

from __future__ import annotations

import pytest

from benchmarks import bench_save_cpu, gpu_like
from ckptsdk import TrainState


@pytest.mark.timeout(120)
def test_every_part_is_timed_once_per_save_within_the_total(monkeypatch):
    monkeypatch.setattr(gpu_like, "GPU_STEP_S", 0.0)  # the sleep is the GPU's: not what is timed
    original = TrainState.state_dict
    acc = bench_save_cpu.run(3)
    assert TrainState.state_dict is original  # the wrappers are taken off again
    for _, _, label in bench_save_cpu.PARTS:
        assert len(acc[label]) == 3, label
    totals = acc["save() in all"]
    assert len(totals) == 3
    for i, total in enumerate(totals):
        assert sum(acc[label][i] for _, _, label in bench_save_cpu.PARTS) <= total
