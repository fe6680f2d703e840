"""The walls inside the rooms: sizes that follow concerns, no circles, no private names borrowed.

``test_layers`` holds the floor plan (which subpackage may import which). Here, inside it: no
folder holds more modules than a reader can take in at a glance, no two modules import each other
in a circle (``TYPE_CHECKING`` imports aside: they never run), no module imports another's private
name (a name used across modules is part of its home's interface: give it a public name), and the
complexity and argument counts ruff measures stay at or under today's ceilings, which only go down
(STYLE.md: keep functions small; pass a record whole rather than unpacking it).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.project.test_layers import import_cycles

REPO = Path(__file__).resolve().parents[2]
CODE = ("ckptsdk", "adapters", "benchmarks")

#: The most modules (``__init__`` aside) one folder of the package holds.
MAX_MODULES_PER_ROOM = 14

#: Findings of ``ruff check --select C901,PLR0913`` (thresholds: pyproject's [tool.ruff.lint.mccabe]
#: and [tool.ruff.lint.pylint]) over the shipped code. Ceilings only go down: when you simplify a
#: function below the threshold, lower its number here in the same commit.
CEILINGS = {"C901": 18, "PLR0913": 49}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files() -> list[Path]:
    return [p for top in CODE for p in sorted((REPO / top).rglob("*.py"))]


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(module imported, names taken from it, whether it runs) for every import in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, list[str], bool]] = []

    def walk(node: ast.AST, runs: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                assert isinstance(child, ast.If)
                for c in child.body:
                    walk_one(c, False)
                for c in child.orelse:
                    walk_one(c, runs)
            else:
                walk_one(child, runs)

    def walk_one(node: ast.AST, runs: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, [], runs) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, [alias.name for alias in node.names], runs))
        else:
            walk(node, runs)

    walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), True)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for target, taken, runs in _imports(path):
            if not runs:
                continue
            # `from package import submodule` imports that submodule (the package's __init__ too,
            # but it runs first and needs nothing back): the edge is to the submodule.
            submodules = [f"{target}.{n}" for n in taken if f"{target}.{n}" in modules]
            for candidate in submodules or [target]:
                if candidate in modules and candidate != name:
                    edges.add(candidate)
        graph[name] = edges
    return graph


def test_no_room_holds_more_than_fourteen_modules() -> None:
    crowded = {}
    for folder in sorted({p.parent for p in (REPO / "ckptsdk").rglob("*.py")}):
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if folder != REPO / "ckptsdk" and len(modules) > MAX_MODULES_PER_ROOM:
            crowded[str(folder.relative_to(REPO))] = len(modules)
    assert crowded == {}, f"split these folders by concern (at most {MAX_MODULES_PER_ROOM} modules): {crowded}"


def test_no_two_modules_import_each_other_in_a_circle() -> None:
    assert import_cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_modules_private_name() -> None:
    ours = {_module_name(p) for p in _files()}
    borrowed = [
        f"{path.relative_to(REPO)}: from {target} import {name}"
        for path in _files()
        for target, taken, _ in _imports(path)
        if target in ours
        for name in taken
        if name.startswith("_") and not name.startswith("__")
    ]
    assert borrowed == [], "make these public in their home module (or move them where they are used)"


@pytest.mark.timeout(120)
def test_complexity_and_argument_counts_stay_under_their_ceilings() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", ",".join(CEILINGS)]
        + ["--output-format", "json", "--exit-zero", *CODE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    counts = dict.fromkeys(CEILINGS, 0)
    for finding in json.loads(proc.stdout):
        counts[finding["code"]] += 1
    over = {code: (n, CEILINGS[code]) for code, n in counts.items() if n > CEILINGS[code]}
    assert over == {}, f"(found, ceiling) per rule; simplify the new findings: {over}"
