"""The everyday commands never import torch or numpy: ``ckptsdk ls`` after every reconnect is instant.

Each command runs in a fresh interpreter (``cli.main`` in a child process) on a real 3-checkpoint
root, and the child reports which heavy modules it ended up importing. How long the commands take
is a benchmark figure (the closing note of issue 28 gives it), never asserted here.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptsdk import SaveOptions
from ckptsdk.cli.admin import MANAGER_KEEP_LAST
from ckptsdk.format import skeleton
from ckptsdk.manager import CheckpointManager
from ckptsdk.state import TrainState

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy")

# The child: run one command, then print which heavy modules it imported as its last line.
CHILD = """
import json, sys
from ckptsdk.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # --help
    code = exc.code
print(json.dumps({"exit": code, "heavy": sorted(m for m in HEAVY if m in sys.modules)}))
""".replace("HEAVY", repr(HEAVY))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """Three committed checkpoints of a real model and optimizer (numpy and torch RNG states in)."""
    path = tmp_path_factory.mktemp("cli-imports") / "root"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(str(path), keep_last=3, save_options=SaveOptions(on_signal=False)) as mgr:
        for step in (1, 2, 3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            mgr.save(TrainState(model=model, optimizer=opt), step=step, metrics={"loss": 1.0 / step})
    return str(path)


def run(*argv: str) -> tuple[dict, subprocess.CompletedProcess[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{root}"],
        ["ls", "{root}", "--json"],
        ["show", "{root}"],
        ["show", "{root}", "--step", "2", "--json"],
        ["audit", "{root}"],
        ["du", "{root}"],
        ["lease", "{root}"],
        ["gc", "{root}", "--dry-run"],
        ["verify", "{root}", "--all"],
        ["--help"],
        ["ls", "--help"],
    ],
    ids=lambda a: " ".join(a).replace("{root}", "ROOT"),
)
def test_everyday_commands_import_neither_torch_nor_numpy(root, argv):
    report, proc = run(*(a.format(root=root) for a in argv))
    assert report["exit"] == 0, proc.stderr
    assert report["heavy"] == [], f"{argv} imported {report['heavy']}"


def test_the_commands_still_read_what_torch_wrote(root):
    """The torch-free paths are not a lesser view: the tensor table and the re-hash are there."""
    _, proc = run("show", root, "--json")
    doc = json.loads(proc.stdout.strip().rsplit("\n{", 1)[0])
    names = {t["name"]: t for t in doc["tensors"]}
    assert names["objects/model/weight"]["dtype"] == "F32"
    assert names["objects/model/weight"]["shape"] == [2, 4]
    assert names["objects/model/weight"]["bytes"] == 32
    assert doc["manifest"]["step"] == 3
    _, proc = run("verify", root, "--all", "--json")
    checked = json.loads(proc.stdout.strip().rsplit("\n{", 1)[0])["checked"]
    assert [(c["step"], c["status"], c["rehashed"]) for c in checked] == [
        (1, "ok", True),
        (2, "ok", True),
        (3, "ok", True),
    ]


def test_show_on_a_missing_root_says_what_ls_says(tmp_path):
    missing = str(tmp_path / "typo")
    ls_report, ls_proc = run("ls", missing)
    show_report, show_proc = run("show", missing)
    assert ls_report["exit"] == show_report["exit"] == 4
    assert "no checkpoint root at" in ls_proc.stderr and "check the URL" in ls_proc.stderr
    assert show_proc.stderr == ls_proc.stderr
    assert not (tmp_path / "typo").exists()  # reading created nothing


def test_gc_default_keep_last_is_the_managers():
    from ckptsdk.options import Retention

    # The flat keyword defaults to None ("not given"); the group holds the manager's default.
    assert inspect.signature(CheckpointManager).parameters["keep_last"].default is None
    assert MANAGER_KEEP_LAST == Retention().keep_last


def test_numpy_size_table_agrees_with_numpy():
    """The manifest parser's numpy dtype table (numpy-free) accepts exactly what this numpy does."""
    for order in "<>|=":
        for kind in "biufc":
            for size in range(0, 65):
                text = f"{order}{kind}{size}"
                try:
                    numpy_ok = np.dtype(text).kind in "biufc"
                except TypeError:
                    numpy_ok = False
                ours = bool(re.fullmatch(skeleton._NUMPY_DTYPE, text)) and skeleton._dtype_ok(text, None)
                assert ours == numpy_ok, text
