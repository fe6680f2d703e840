"""The last steps of a run (issue 47, item 12): a loop that saves every N steps and stops between
two saves (96 steps, saved at 91) hears it from ``close()``; the README's loop ends with the save
that makes the last step the one ``export`` and a resume start from.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from ckptsdk import CheckpointManager, TrainState, cli

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 96, 7


def _run(root: Path, *, final_save: bool) -> torch.nn.Linear:
    """The README's loop, on a toy model; with or without its final save."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = TrainState(model=model, optimizer=opt)
    mgr = CheckpointManager(str(root), keep_last=2, save_every=EVERY)
    pos = mgr.restore(state)
    step = pos.step if pos else 0
    while step < STEPS:
        loss = model(torch.ones(1, 2)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        mgr.log_step(step, loss=loss.detach())
        if mgr.should_save(step):
            mgr.save(state, step=step)
    if final_save and step > (pos.step if pos else 0):
        mgr.save(state, step=step)
    mgr.close()
    return model


def test_close_says_which_steps_no_checkpoint_holds(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ckptsdk"):
        _run(tmp_path / "run", final_save=False)
    said = [r.getMessage() for r in caplog.records if "logged but not saved" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "the newest checkpoint is step 91; steps 92..96 were logged but not saved" in said[0]
    assert "mgr.save(state, step=96)" in said[0]


def test_the_readme_loop_saves_the_last_step(tmp_path, caplog):
    root = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="ckptsdk"):
        model = _run(root, final_save=True)
    assert "logged but not saved" not in caplog.text
    out = tmp_path / "w.safetensors"
    assert cli.main(["export", str(root), str(out)]) == cli.EXIT_OK
    exported = load_file(str(out))
    weight = next(v for k, v in exported.items() if k.endswith("weight"))
    assert torch.equal(weight, model.weight.detach())  # the weights of step 96, not of 91
    # A restart with nothing left to run: no step logged, nothing to say.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptsdk"):
        _run(root, final_save=True)
    assert "logged but not saved" not in caplog.text


def test_the_readme_loop_has_the_final_save():
    readme = (REPO / "README.md").read_text()
    loop = readme[readme.index("A complete loop") :]
    loop = loop[: loop.index("mgr.close()")]
    assert re.search(r"\nif step > \(pos\.step if pos else 0\):.*\n    mgr\.save\(state, step=step", loop), loop
