"""benchmarks/bench_resume.py measures a real resume: a writer SIGKILLed after a commit, a newcomer timed.

Not a speed test. The local row and the torch anchor run once on a narrow ResNet-18: each must
report every phase in order, restore the step the killed writer committed (not start over), and
come out in the table as a positive figure with its ratio to the anchor and its target verdict.
Slow: real training processes, a kill and a resume (about 20 s here; over a minute with a lease
that waits out the dead writer's ttl, as b404d82's did).
"""

from __future__ import annotations

import pytest

from benchmarks import bench_resume


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_row_and_anchor_resume_the_killed_writers_step(tmp_path):
    settings = bench_resume.Settings(width=8, batch_size=4, every=1, timeout=300.0)
    results, codes = bench_resume.run(["local", "torch"], 1, settings, base=str(tmp_path), progress=False)

    assert codes == {str(bench_resume.REPO)}  # the children ran this checkout's ckptsdk
    for row in ("local", "torch"):
        (outcome,) = results[row]
        assert outcome.error == "", outcome.error
        assert outcome.note == "", outcome.note
        assert outcome.committed >= 1
        assert outcome.restored >= outcome.committed
        marks = [outcome.at[p] for p in bench_resume.PHASES]
        assert 0 < marks[0] and marks == sorted(marks), marks

    summaries = {row: bench_resume.summarize(results[row]) for row in ("local", "torch")}
    assert all(s.median is not None and s.median > 0 for s in summaries.values())
    lines = bench_resume.format_table(summaries)
    local = next(line for line in lines if line.startswith(bench_resume.ROWS["local"]))
    local_s, torch_s = summaries["local"].median, summaries["torch"].median
    assert local_s is not None and torch_s is not None
    assert f"{local_s:.1f} (" in local  # the median, seconds
    assert f"{local_s / torch_s:.2f}" in local  # its ratio to the torch.load resume
    assert "1.5x torch + 1 s" in local and ("ok" in local or "MISSED" in local)
