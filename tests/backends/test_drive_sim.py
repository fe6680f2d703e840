"""The Drive simulator's syncer survives a VM that changes a file while the syncer writes it.

The interleavings are forced, not waited for: ``os.replace`` in the simulator is wrapped so that
the VM's own change lands exactly in the window that killed the syncer under load (issue 28):
the file unlinked right after the rename, or its folder removed right before it.
"""

from __future__ import annotations

import os
import shutil
import threading

from ckptsdk.testing import drive_sim
from ckptsdk.testing.drive_sim import DriveSim

TIMEOUT = 60.0  # generous: a loaded machine slows the syncer, never the verdict


def _once(action):
    """An ``os.replace`` that runs ``action`` around the syncer's first rename (as the VM would).

    ``os`` is one module for everyone: the backends' own renames pass straight through.
    """
    real = os.replace
    fired = []

    def replace(src, dst):
        if not fired and threading.current_thread().name == "drive-sim-syncer":
            fired.append(dst)
            return action(real, src, dst)
        return real(src, dst)

    return replace, fired


def test_vm_unlinks_the_file_right_after_the_syncer_renames_it(tmp_path, monkeypatch):
    def unlink_after(real, src, dst):
        real(src, dst)
        os.unlink(dst)  # the VM deletes it the moment it appears

    replace, fired = _once(unlink_after)
    monkeypatch.setattr(drive_sim.os, "replace", replace)
    with DriveSim(tmp_path, delay=0.1, poll=0.02) as sim:
        sim.backend("vm1", "run").write("x", b"1")
        sim.wait_synced(timeout=TIMEOUT)  # raises if the syncer thread died
        assert fired and str(fired[0]).endswith(os.path.join("vm2", "run", "x"))
        # vm2's delete is the newest change: it won everywhere, nothing resurrected.
        assert not (sim.root("vm1") / "run" / "x").exists()
        assert not (sim.root("vm2") / "run" / "x").exists()


def test_vm_removes_the_folder_right_before_the_syncer_renames_into_it(tmp_path, monkeypatch):
    def remove_folder_before(real, src, dst):
        shutil.rmtree(os.path.dirname(dst))  # the VM removes the folder, the temp file with it
        return real(src, dst)

    replace, fired = _once(remove_folder_before)
    monkeypatch.setattr(drive_sim.os, "replace", replace)
    with DriveSim(tmp_path, delay=0.1, poll=0.02) as sim:
        b1 = sim.backend("vm1", "run")
        b1.write("sub/x", b"1")
        b1.write("sub/y", b"2")
        sim.wait_synced(timeout=TIMEOUT)  # raises if the syncer thread died
        assert fired
        # vm2 never had the arriving file, so removing the folder deleted nothing: it still lands,
        # both VMs end with the same files, and no temp file of the syncer is left behind.
        for vm in ("vm1", "vm2"):
            assert (sim.root(vm) / "run" / "sub" / "x").read_bytes() == b"1"
            assert (sim.root(vm) / "run" / "sub" / "y").read_bytes() == b"2"
        left = [p.name for p in sim.root("vm2").rglob("*")]
        assert not [n for n in left if n.startswith(".ckptsdk-sim.")], left
