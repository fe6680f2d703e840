"""The simulation the lineage machine runs on (tests/support/drive_deterministic_sim.py) behaves as Drive does.

Per-VM views, changes that reach other VMs late and out of order, last writer wins, and
create/replace that check only the writer's own view: the properties the lineage invariants
(test_lineage_invariants.py) and regressions rely on.
"""

from __future__ import annotations

import pytest

from ckptsdk.errors import PreconditionFailed
from tests.support.drive_deterministic_sim import SimDrive


def test_sim_drive_reorders_and_resolves_last_writer_wins() -> None:
    x_uploads = iter([80.0, 10.0, 0.0, 0.0, 0.0])  # a's first write of x uploads slowest

    def delay(hop: str, key: str) -> float:
        if hop != "up":
            return 5.0
        fixed = {"tensors": 100.0, "manifest": 0.0}.get(key.split("/")[-1])
        return fixed if fixed is not None else next(x_uploads)

    sim = SimDrive(delay=delay)
    sim.add_vm("a")
    sim.add_vm("b")
    a, b = sim.backend("a"), sim.backend("b")
    a.write("ck/tensors", b"T")
    a.write("ck/manifest", b"M")
    assert a.read("ck/manifest") == b"M" and not b.exists("ck/manifest")  # at once on a only
    sim.advance_to(sim.now + 6)
    assert b.exists("ck/manifest") and not b.exists("ck/tensors")  # manifest first: torn on b
    sim.advance_to(sim.now + 100)
    assert b.read("ck/tensors") == b"T"
    # Both VMs write x; a's older write arrives last and is dropped (last writer wins).
    a.write("x", b"old")  # reaches the cloud in 80 s
    sim.advance_to(sim.now + 1)
    b.write("x", b"new")  # newer, reaches the cloud in 10 s: before a's
    sim.advance_to(sim.now + 30)
    assert a.read("x") == b"new"
    sim.advance_to(sim.now + 200)  # a's older write arrives last and is dropped everywhere
    assert a.read("x") == b"new" and b.read("x") == b"new" and sim.converged_cloud()["x"].data == b"new"
    # create/replace check only the writer's own view.
    a.delete("x")
    assert b.exists("x")
    with pytest.raises(PreconditionFailed):
        b.create("x", b"again")
    a.create("x", b"a's")  # a no longer sees x: its create succeeds although b's copy exists
    sim.advance_to(sim.now + 200)
    assert b.read("x") == b"a's"
    sim.add_vm("c")  # a VM mounting later starts from the cloud
    assert sim.backend("c").read("ck/manifest") == b"M"
