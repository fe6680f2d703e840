"""The lineage invariants hold over many writer schedules, on every kind of root (issue 9).

Runs ``tests.support.lineage_machine.LineageMachine`` (the invariants 0-5 are in its docstring) under
hypothesis on simulated Drive (changes within the settle time, and minutes late), local disk and
memory, and checks the schedules reached the situations that make the invariants mean something.
The example budget comes from tests/support/hypothesis_profiles.py (``--hypothesis-profile=deep`` for more).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from hypothesis.stateful import run_state_machine_as_test

from tests.support.hypothesis_profiles import lineage_settings
from tests.support.lineage_machine import STATS, DriveLateLineage, LineageMachine, LocalLineage, MemoryLineage

#: Every machine's schedules write and delete the frozen base's shared files (issue 47).
SHARED = ("shared files written", "shared files deleted")


def _run(machine: type[LineageMachine], scale: float, needed: tuple[str, ...]) -> None:
    needed += SHARED
    STATS.pop(machine.__name__, None)
    run_state_machine_as_test(machine, settings=lineage_settings(scale))
    stats = STATS.get(machine.__name__, Counter())
    print(f"\n{machine.__name__}: " + ", ".join(f"{k}: {v}" for k, v in sorted(stats.items())))
    # The schedules must reach the interesting situations, or the invariants prove little.
    for what in needed:
        assert stats[what] > 0, f"no schedule of {machine.__name__} had {what!r}: {dict(stats)}"


def test_lineage_drive_within_settle() -> None:
    """Drive whose changes arrive within the settle time: invariants 0-5."""
    _run(LineageMachine, 0.3, ("takeovers", "save refused (fenced)"))


def test_lineage_drive_late() -> None:
    """Drive whose changes arrive minutes late: invariants 0-4 hold by ranks and lineage alone,
    also in schedules where two writers share an epoch."""
    _run(
        DriveLateLineage,
        0.35,
        (
            "takeovers",
            "save refused (fenced)",
            "commits by a superseded writer",
            "restore with orphans present",
            "epoch shared by two writers (distinct ranks)",
        ),
    )


def test_lineage_local(tmp_path: Path) -> None:
    LocalLineage.tmp_root = tmp_path
    _run(LocalLineage, 0.2, ("takeovers", "save refused (fenced)"))


def test_lineage_memory() -> None:
    _run(MemoryLineage, 0.15, ("takeovers", "save refused (fenced)"))
