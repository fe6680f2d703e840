"""The commit-msg hook (scripts/check_commit_msg.py): subjects of at most 72 characters, and a body."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_commit_msg.py"

_spec = importlib.util.spec_from_file_location("check_commit_msg", SCRIPT)
assert _spec is not None and _spec.loader is not None
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

GOOD = "options: one spelling per option\n\nThe flat keywords outside the README's loop are deprecated.\n"


@pytest.mark.parametrize(
    "message",
    [
        GOOD,
        "x" * 72 + "\n\nwhy\n",
        GOOD + "\n# Please enter the commit message for your changes.\n# On branch main\n",
        "# a comment git leaves out\n" + GOOD,
        GOOD + "# ------------------------ >8 ------------------------\ndiff --git a/x b/x\n",
        "Merge branch 'lead' into main\n",
        "fixup! options: one spelling per option\n",
        "squash! options: one spelling per option\n",
        'Revert "options: one spelling per option"\n\nThis reverts commit 0123456789abcdef.\n',
    ],
)
def test_accepted(message: str) -> None:
    assert check.problems(message) == []


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ("x" * 73 + "\n\nwhy\n", "73 characters, more than 72"),
        ("options: one spelling per option\n", "no body"),
        ("options: one spelling per option\n\n\n", "no body"),
        ("options: one spelling per option\n# only a comment below\n", "no body"),
        ("options: one spelling\nper option, a subject on two lines\n", "second line must be blank"),
        ("", "empty"),
        ("# only comments\n", "empty"),
    ],
)
def test_refused(message: str, says: str) -> None:
    found = check.problems(message)
    assert len(found) == 1 and says in found[0], found


def test_the_hook_runs_as_pre_commit_runs_it(tmp_path: Path) -> None:
    """The entry of the commit-msg hook in .pre-commit-config.yaml, with the message file appended."""
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    assert "commit-msg" in config["default_install_hook_types"]
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    hook = hooks["commit-msg"]
    assert hook["stages"] == ["commit-msg"] and hook["language"] == "system"
    entry = hook["entry"].replace("python3", sys.executable, 1)
    for text, code in ((GOOD, 0), ("a subject and nothing else\n", 1)):
        message = tmp_path / "COMMIT_EDITMSG"
        message.write_text(text, encoding="utf-8")
        run = subprocess.run(
            f"{entry} {message}", shell=True, cwd=REPO, capture_output=True, text=True, timeout=60, check=False
        )
        assert run.returncode == code, run.stderr
        assert ("no body" in run.stderr) == bool(code)


def test_the_setup_comment_names_the_commit_msg_install() -> None:
    assert "pre-commit install --hook-type commit-msg" in (REPO / ".pre-commit-config.yaml").read_text()


def test_the_scripts_docstring_examples_hold() -> None:
    import doctest

    assert doctest.testmod(check).failed == 0
