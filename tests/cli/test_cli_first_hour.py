"""The ``ckptsdk`` command as a new user meets it (issue 13).

Cases run in-process (``cli.main(argv)``) unless only a real process proves them: the exit status
of the console script and of ``python -m ckptsdk`` without stdin, and a reader closing the pipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptsdk
from ckptsdk import LeaseOptions, cli

REPO = Path(ckptsdk.__file__).resolve().parents[1]


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(
        [sys.executable, "-m", "ckptsdk", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``cli.main`` in this process: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _console_script() -> str:
    """The ``[project.scripts]`` entry of pyproject.toml (``module:function``), as pip installs it."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["ckptsdk"]


def _root(tmp_path: Path) -> str:
    """A root with two checkpoints and a step log, written by the library."""
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    state = ckptsdk.TrainState(model=model)
    with ckptsdk.CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        for step in (1, 2):
            mgr.log_step(step, loss=float(step))
            mgr.save(state, step=step)
    return url


@pytest.mark.parametrize("command", ["ls", "audit", "verify", "gc"])
def test_a_root_that_does_not_exist_is_exit_4_not_an_empty_listing(command, tmp_path, capsys):
    missing = str(tmp_path / "no" / "such" / "path")
    code, out, err = run(capsys, command, missing)
    assert code == cli.EXIT_CHECKPOINT == 4
    assert (
        err == f"ckptsdk: error: no checkpoint root at {missing}: nothing is stored there (no "
        "LEASE.json, no checkpoint); check the URL\n"
    )
    assert out == "" and not os.path.exists(missing)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["console script", "python -m ckptsdk"])
def test_the_exit_code_is_the_process_status_without_stdin(how, tmp_path):
    """What a shell sees: the console script pip installs (pyproject's entry point) and
    ``python -m ckptsdk`` exit with main()'s code, and need no stdin (``lease`` imports no torch:
    the cheapest command with a failure to report)."""
    module, _, function = _console_script().partition(":")
    code = f"import sys; from {module} import {function}; sys.exit({function}())"
    argv = [sys.executable, "-c", code] if how == "console script" else [sys.executable, "-m", "ckptsdk"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [*argv, "lease", str(tmp_path), "--break"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == cli.EXIT_USAGE == 2, proc.stderr
    assert proc.stderr.startswith("ckptsdk: error: --break takes over the lease") and proc.stdout == ""


@pytest.mark.timeout(120)
def test_a_reader_that_closes_the_pipe_stops_the_command_quietly(tmp_path):
    url = _root(tmp_path)
    proc = _cli("audit", url, "--json")
    proc.stdout.close()  # `| head -0`: the reader is gone before anything was written
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == cli.EXIT_BROKEN_PIPE == 141
    assert err == ""  # no "Broken pipe; check the path", no "Exception ignored"


def test_ls_says_what_it_checked_and_verify_finds_the_flipped_byte(tmp_path, capsys):
    url = _root(tmp_path)
    backend = ckptsdk.open_backend(url)
    key = next(o.key for o in backend.list("") if o.key.endswith("tensors.safetensors"))
    data = bytearray(backend.read(key))
    data[-1] ^= 0xFF  # same size, wrong bytes
    backend.write(key, bytes(data))
    code, out, err = run(capsys, "ls", url)
    assert code == 0 and err == ""
    table, summary = out.split("\n\n")
    assert table.splitlines()[1].split()[-3:] == ["sizes", "ok", "latest"] and "valid" not in table
    assert "restorable by their manifest and file sizes" in summary and "verify URL --all" in summary
    code, out, err = run(capsys, "verify", url, "--all")
    assert code == cli.EXIT_FAILED and "CORRUPT" in out


def test_the_readme_lists_every_exit_code_the_command_has():
    import re

    readme = (REPO / "README.md").read_text()
    table = {int(n) for n in re.findall(r"^\| (\d+) \|", readme, flags=re.M)}
    codes = {v for k, v in vars(cli).items() if k.startswith("EXIT_")}
    assert table == codes == {0, 1, 2, 3, 4, 130, 141}
