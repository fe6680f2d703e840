"""The lineage machine's checks have teeth: with a lineage rule broken on purpose, it fails.

Each test sabotages one rule (monkeypatched for that test only) and expects ``StoryFailure``
naming the invariant it breaks, with the schedule told as a story. Without these, a machine whose
checks never fire would pass test_lineage_invariants.py as easily as a correct library.
"""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from tests.support.hypothesis_profiles import lineage_settings
from tests.support.lineage_machine import DriveLateLineage, LineageMachine, StoryFailure


def _expect_story_failure(machine: type[LineageMachine], pattern: str) -> None:
    from hypothesis import Phase, settings

    quick = settings(lineage_settings(), max_examples=200, derandomize=True, phases=[Phase.generate])
    with pytest.raises(StoryFailure, match=pattern) as info:
        run_state_machine_as_test(machine, settings=quick)
    assert "--- the schedule" in str(info.value) and "sees: vm1[" in str(info.value)


def test_the_machine_catches_restoring_orphans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the catalog never marks a superseded writer's checkpoints as orphans."""
    from ckptsdk.checkpoint.reading import catalog

    monkeypatch.setattr(catalog, "superseded_by", lambda step, rank, points: None)
    _expect_story_failure(DriveLateLineage, r"\[[14]\]")


def test_the_machine_catches_a_writer_that_ignores_newer_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: a writer never fences itself on seeing a newer lease, lineage record or folder
    (``fence_if_newer`` gets a rank tuple and does nothing)."""
    from ckptsdk.checkpoint.writing.writer import WriterSession
    from ckptsdk.lease.acquire import Lease

    monkeypatch.setattr(WriterSession, "fence_if_newer", lambda self, seen: None)
    monkeypatch.setattr(Lease, "_judge", lambda self, data, ours: None)
    monkeypatch.setattr(Lease, "fence", lambda self, reason, newer_epoch=None: None)
    _expect_story_failure(DriveLateLineage, r"\[[234]\]")


def test_the_machine_catches_writers_sharing_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the simulated Drive claims compare-and-swap, so writers drop the nonce tag from
    their names (the world before de3dc83): two writers of one epoch then share a rank. The lie
    also makes the catalog trust LEASE.json's epoch (a zombie's late write puts an older one back
    here), so a genuine lineage record may be ignored as stray first: [4] (see catalog.py)."""
    import dataclasses

    from tests.support import drive_deterministic_sim as sim_drive

    monkeypatch.setattr(
        sim_drive.SimDriveBackend,
        "capabilities",
        dataclasses.replace(sim_drive.DRIVE_CAPABILITIES, compare_and_swap=True),
    )
    _expect_story_failure(DriveLateLineage, r"\[[04]\]")
