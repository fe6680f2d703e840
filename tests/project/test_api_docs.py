"""The API reference builds from the docstrings with no warning (scripts/api_docs.py, pdoc).

A warning means a page is wrong or missing (an annotation pdoc cannot read, a broken link), so
the build fails on any; each module of ckptsdk must get its page. Built into ``tmp_path``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "api_docs.py"


def _python(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("pdoc") is None:
        pytest.fail("pdoc is not installed; install the dev extra: pip install -e '.[dev]'")
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_reference_builds_without_a_warning_and_has_every_module(tmp_path: Path) -> None:
    out = tmp_path / "api"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], cwd=REPO, capture_output=True, text=True, timeout=380, check=False
    )
    assert proc.returncode == 0, f"scripts/api_docs.py failed:\n{proc.stdout}{proc.stderr}"
    names = _python(
        f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(SCRIPT.parent)!r}]; import api_docs; "
        "print('\\n'.join(api_docs.modules()))",
        timeout=120,
    ).stdout.split()
    assert "ckptsdk.backends.base" in names and "ckptsdk.__main__" not in names
    missing = [n for n in names if not (out / (n.replace(".", "/") + ".html")).is_file()]
    assert not missing, f"modules without a page: {missing}"
    page = (out / "ckptsdk" / "errors.html").read_text(encoding="utf-8")
    assert "MissingDependencyError" in page and "LeaseLostError" in page


def test_a_warning_fails_the_build(tmp_path: Path) -> None:
    """The check's teeth: an annotation pdoc cannot evaluate (``list`` shadowed by a method)."""
    (tmp_path / "probe_mod.py").write_text(
        '"""A module whose method annotation pdoc cannot read."""\n\n'
        "from __future__ import annotations\n\n\n"
        "class Store:\n"
        '    """A store."""\n\n'
        "    def list(self) -> list[int]:\n"
        '        """Keys."""\n'
        "        return []\n",
        encoding="utf-8",
    )
    proc = _python(
        f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(SCRIPT.parent)!r}]; import api_docs; "
        f"print('\\n'.join(api_docs.build(__import__('pathlib').Path({str(tmp_path / 'out')!r}), ['probe_mod'])))",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Error parsing type annotation list[int] for probe_mod.Store.list" in proc.stdout
