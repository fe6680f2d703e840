"""The shape of the house, as data: the layer order of ``ckptsdk``, and the rules of the root.

Every import of every module under ``ckptsdk/`` (module level, inside functions, under
``TYPE_CHECKING``, relative or absolute, ``importlib.import_module("ckptsdk...")`` with a literal
name, module names in lazy tables) must point to its own layer or one below it; subpackages must
not import each other in a circle. Also: the root holds at most ten modules, no code reaches a
backend's optional operations with ``getattr``, and nothing shipped (notebooks included) imports
``tests``. What a layer may contain is DESIGN.md's business. No line count per module: a module's
size follows its concern (../STYLE.md), never a cap that cuts a class across files.
"""

from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ckptsdk"

#: The layer order, lowest first. A unit is a subpackage of ckptsdk or a root module (without .py);
#: a unit may import its own tier and those listed before it, never one listed after it.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "_version"),  # the error tree and the one __version__: importable from anywhere
    ("backends",),  # storage, knowing nothing of checkpoints
    ("format",),  # what is written, knowing nothing of storage policies
    # Process-level helpers that know no storage: RNG states (checked by the reader), and the
    # SIGTERM/SIGINT flag the manager polls.
    ("rng", "preemption"),
    ("data",),
    ("loader",),  # ckptsdk.DataLoader: a position in the TrainState (torch only, no storage)
    ("lease",),
    ("runlog",),
    ("checkpoint",),
    ("keep",),  # ckptsdk.keep: the keep rules under the short names a job types
    ("state",),
    ("options",),  # CheckpointManager's option groups (Retention, LeaseOptions, SaveOptions)
    ("manager",),
    ("distributed",),
    ("porting",),
    ("integrations", "cli", "testing"),
    ("__init__", "__main__"),  # the curated public surface and `python -m ckptsdk`
]
TIER = {unit: i for i, tier in enumerate(LAYERS) for unit in tier}

#: Code a user installs or runs from this repository; none of it may import the test suite.
SHIPPED = ("ckptsdk", "adapters", "benchmarks", "examples", "scripts")

MAX_ROOT_MODULES = 10


@dataclass(frozen=True)
class Import:
    """One import statement: where it is, and the ckptsdk module it names."""

    path: Path
    line: int
    target: str

    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str | None = None) -> list[Import]:
    """Every module ``path`` imports (any depth in the file), with relative names made absolute.

    ``module`` is the dotted name of ``path`` (default: from its place in the repository).
    """
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from ckptsdk import x` / `from . import x` may name a submodule: count each name.
            if target in {"ckptsdk", package} or not node.module:
                found += [Import(path, node.lineno, f"{target}.{alias.name}") for alias in node.names]
            else:
                found.append(Import(path, node.lineno, target))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(path, node.lineno, node.args[0].value))
        elif isinstance(node, ast.Dict | ast.Tuple | ast.List | ast.Set):
            # A lazy table (scheme -> "ckptsdk.backends.cloud.gcs") imports by name later: count it.
            items = [*node.keys, *node.values] if isinstance(node, ast.Dict) else node.elts
            found += [
                Import(path, item.lineno, item.value)
                for item in items
                if isinstance(item, ast.Constant) and isinstance(item.value, str) and _is_module(item.value)
            ]
    return found


def _is_module(name: str) -> bool:
    """Whether ``name`` is a dotted ckptsdk module that exists in this repository."""
    if not re.fullmatch(r"ckptsdk(\.[A-Za-z_]\w*)+", name):
        return False
    base = REPO.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _unit(module: str) -> str | None:
    """The layer unit of a ckptsdk module name (``ckptsdk.lease.record`` -> ``lease``), else None."""
    parts = module.split(".")
    if parts[0] != "ckptsdk":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _edges() -> dict[tuple[str, str], list[Import]]:
    """(importing unit, imported unit) -> the imports that make the edge, across units only."""
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for path in _package_files():
        src = _unit(_module_name(path))
        assert src is not None
        for imp in _imports(path):
            dst = _unit(imp.target)
            if dst is not None and dst != src:
                edges[(src, dst)].append(imp)
    return edges


def test_every_unit_has_a_place_in_the_layers() -> None:
    units = {_unit(_module_name(p)) for p in _package_files()}
    missing = sorted(u for u in units if u not in TIER)
    assert not missing, (
        f"ckptsdk/{missing} is not in LAYERS (tests/project/test_layers.py): add it to the tier it belongs to, "
        "so its imports are checked"
    )
    stale = sorted(u for u in TIER if u not in units)
    assert not stale, f"LAYERS names {stale}, which no longer exist under ckptsdk/: remove them"


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{imp.where()}: {src} (tier {TIER[src]}) imports {imp.target} ({dst}, tier {TIER[dst]}, above it)"
        for (src, dst), imps in sorted(_edges().items())
        if src in TIER and dst in TIER and TIER[dst] > TIER[src]
        for imp in imps
    ]
    assert not upward, "upward imports (move the import, or the thing imported, down a layer):\n" + "\n".join(upward)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_subpackages() -> None:
    edges = _edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst in edges:
        graph[src].add(dst)
    report = []
    for component in import_cycles(graph):
        inside = [
            f"  {imp.where()}: {src} imports {imp.target} ({dst})"
            for (src, dst), imps in sorted(edges.items())
            if src in component and dst in component
            for imp in imps
        ]
        report.append(f"cycle between {component}:\n" + "\n".join(inside))
    assert not report, "import cycles (break one edge by moving what it imports down):\n" + "\n".join(report)


def test_the_checker_sees_lazy_relative_and_dynamic_imports(tmp_path: Path) -> None:
    """The parser's teeth: a lazy, a relative and an import_module import are each found."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib\n"
        "def f():\n"
        "    from ..manager import CheckpointManager\n"
        "    from . import record\n"
        "    import ckptsdk.cli\n"
        "    return importlib.import_module('ckptsdk.state')\n"
        "TABLE = {'gs': ('ckptsdk.runlog.writer', 'RunLog'), 'x': ('ckptsdk.not_a_module', 'X')}\n",
        encoding="utf-8",
    )
    targets = {(imp.line, imp.target) for imp in _imports(probe, "ckptsdk.lease.probe")}
    assert {(3, "ckptsdk.manager"), (4, "ckptsdk.lease.record"), (5, "ckptsdk.cli"), (6, "ckptsdk.state")} <= targets
    assert (7, "ckptsdk.runlog.writer") in targets  # a lazy table's module name
    assert not any(t == "ckptsdk.not_a_module" for _, t in targets)  # a string that names no module
    assert {_unit(t) for _, t in targets} >= {"manager", "lease", "cli", "state"}


def test_cycle_finder_finds_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_root_holds_at_most_ten_modules() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, (
        f"ckptsdk/ holds {len(root)} modules ({root}), more than {MAX_ROOT_MODULES}: "
        "put the new one in the subpackage of its layer"
    )


# getattr/hasattr naming an optional backend operation: those go through
# ckptsdk.backends.base.copier()/rewriter() (typed sub-protocols), so mypy checks every call.
_CAPABILITY_BY_NAME = re.compile(r"\b(?:getattr|hasattr)\(\s*[^,()]+,\s*[\"'](?:copy|move|overwrite)[\"']")


def test_no_getattr_for_backend_capabilities() -> None:
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in _package_files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _CAPABILITY_BY_NAME.search(line)
    ]
    assert not found, (
        "optional backend operations reached by name (use ckptsdk.backends.base.copier()/rewriter()):\n"
        + "\n".join(found)
    )


@pytest.mark.parametrize(
    "line", ["getattr(backend, 'copy', None)", 'hasattr(self.backend, "overwrite")', "getattr(b,'move')"]
)
def test_capability_pattern_has_teeth(line: str) -> None:
    assert _CAPABILITY_BY_NAME.search(line)


def _notebook_imports(path: Path, tmp: Path) -> list[Import]:
    """The imports of a notebook's code cells (shell ``!`` and ``%`` magic lines left out)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found: list[Import] = []
    for n, cell in enumerate(c for c in cells if c.get("cell_type") == "code"):
        source = "".join(cell.get("source", []))
        code = "\n".join("" if line.lstrip().startswith(("!", "%")) else line for line in source.splitlines())
        script = tmp / f"{path.stem}-cell{n}.py"
        script.write_text(code, encoding="utf-8")
        found += [Import(path, imp.line, imp.target) for imp in _imports(script, f"{path.stem}.cell{n}")]
    return found


def test_nothing_shipped_imports_tests(tmp_path: Path) -> None:
    notebooks = sorted(p for top in SHIPPED if (REPO / top).is_dir() for p in (REPO / top).rglob("*.ipynb"))
    assert notebooks, "no notebook found: the check below would read only .py files"
    scripts = sorted(p for top in SHIPPED if (REPO / top).is_dir() for p in (REPO / top).rglob("*.py"))
    imports = [imp for p in scripts for imp in _imports(p)]
    imports += [imp for nb in notebooks for imp in _notebook_imports(nb, tmp_path)]
    found = [
        f"{imp.where()}: imports {imp.target}"
        for imp in imports
        if imp.target == "tests" or imp.target.startswith("tests.")
    ]
    assert not found, (
        "shipped code imports the test suite (move what it needs into ckptsdk.testing or the shipped "
        "module itself):\n" + "\n".join(found)
    )


#: Public top-level names that several modules define on purpose, each with why. Anything else
#: defined twice is a rule with two homes (the two copies will drift): import it from one.
SAME_NAME_ON_PURPOSE = {
    "main": "each command-line entry point is its module's main()",
    "register": "each cli/ module registers its own subcommands",
    "FORMAT": "the format string of the document each module writes (checkpoint, dcp)",
    "scan": "posix.scan lists a folder; checkpoint.catalog.scan reads a checkpoint root",
}


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") and n not in {"logger", "__all__"}}


def test_each_public_name_is_defined_in_one_module() -> None:
    homes: dict[str, list[str]] = defaultdict(list)
    for path in _package_files():
        for name in _top_level_names(path):
            homes[name].append(str(path.relative_to(REPO)))
    twice = sorted(
        f"{name}: {', '.join(paths)}"
        for name, paths in homes.items()
        if len(paths) > 1 and name not in SAME_NAME_ON_PURPOSE
    )
    assert not twice, (
        "public names defined in more than one module (keep one home and import it, or, if they are "
        "different things, rename one or add it to SAME_NAME_ON_PURPOSE with why):\n" + "\n".join(twice)
    )
    stale = sorted(n for n in SAME_NAME_ON_PURPOSE if len(homes.get(n, [])) < 2)
    assert not stale, f"SAME_NAME_ON_PURPOSE lists {stale}, now defined once or not at all: remove them"
