"""A tiny deterministic training state per step, and a digest of everything a restore brings back.

Shared by the fault suite (tests/test_faults_*.py) and its fresh-process verifier: ``python -m
tests.support._fault_state verify ROOT...`` restores each root read-only and prints one JSON line per root
(the restored step and digest, and the digest of every valid checkpoint), which the test compares
with ``expected(step)``. Nothing here asserts; the tests do.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys

import numpy as np
import torch

from ckptsdk import CheckpointManager, TrainState
from ckptsdk.errors import CorruptCheckpointError, ManifestError


def make_state(step: int) -> TrainState:
    """Model, SGD with momentum and the global RNGs, all a function of ``step`` (0: a blank)."""
    torch.manual_seed(10_000 + step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if step:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()  # momentum buffers exist and depend on the step
    random.seed(step)
    np.random.seed(step)
    torch.manual_seed(step)
    return TrainState(model=model, optimizer=opt)


def digest(state: TrainState) -> str:
    """sha256 of the model, the optimizer (buffers and hyper-parameters) and the global RNGs."""
    h = hashlib.sha256()
    model, opt = state.objects["model"], state.objects["optimizer"]
    for name, t in model.state_dict().items():
        h.update(name.encode() + t.numpy().tobytes())
    sd = opt.state_dict()
    for idx in sorted(sd["state"]):
        for k, v in sorted(sd["state"][idx].items()):
            h.update(f"{idx}/{k}".encode() + (v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()))
    h.update(json.dumps(sd["param_groups"], sort_keys=True, default=str).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    np_state = np.random.get_state(legacy=False)
    h.update(
        np_state["state"]["key"].tobytes()
        + repr((np_state["state"]["pos"], np_state["has_gauss"], np_state["gauss"])).encode()
    )
    h.update(repr(random.getstate()).encode())
    return h.hexdigest()


def expected(step: int) -> str:
    """The digest a restore of ``step`` must produce."""
    return digest(make_state(step))


def observe(root: str) -> dict:
    """Restore ``root`` read-only into a blank state: the step, its digest, and the digest of
    every checkpoint that loads (listed valid, and passing every check when read)."""
    mgr = CheckpointManager(root, read_only=True)
    state = make_state(0)
    point = mgr.restore(state)
    out = {"root": root, "step": point.step if point else None, "digest": digest(state) if point else None, "valid": {}}
    for info in mgr.list():
        if info.valid:  # listed as valid; digests and contents are checked by loading it
            blank = make_state(0)
            try:
                blank.load_state_dict(mgr.load(info.step))
            except (CorruptCheckpointError, ManifestError):
                continue
            out["valid"][str(info.step)] = digest(blank)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] != ["verify"]:
        sys.exit("usage: python -m tests.support._fault_state verify ROOT...")
    for root in sys.argv[2:]:
        print(json.dumps(observe(root)), flush=True)
