"""Build the API reference from the docstrings: ``python scripts/api_docs.py [OUT_DIR]`` (default docs/api).

Every module of ``ckptsdk`` (but ``__main__``, which would run the CLI) is rendered by pdoc as
Google-style docstrings, into static HTML. Any warning while rendering (a type annotation pdoc
cannot read, a broken cross-reference) fails the build, so the reference never silently loses a
page; tests/project/test_api_docs.py runs this. The HTML is a build output: do not commit it.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Modules never rendered: importing them has effects (`python -m ckptsdk` runs the CLI).
SKIP = {"ckptsdk.__main__"}


def modules() -> list[str]:
    """Every ckptsdk module name, the package first, sorted."""
    package = importlib.import_module("ckptsdk")
    found = [info.name for info in pkgutil.walk_packages(package.__path__, prefix="ckptsdk.") if info.name not in SKIP]
    return ["ckptsdk", *sorted(found)]


def specs(names: list[str]) -> list[str]:
    """The fewest module names to hand pdoc so that it renders each of ``names`` exactly once.

    pdoc walks into a package's submodules by itself, except those a package's ``__all__``
    leaves out (``ckptsdk.backends.local``); naming a module it walks to anyway is a warning.
    """
    import pdoc.extract

    chosen: list[str] = []
    covered: set[str] = set()
    for name in names:  # parents before their children
        if name not in covered:
            chosen.append(name)
            covered.update(pdoc.extract.walk_specs([name]))
    return chosen


def build(out: Path, names: list[str] | None = None) -> list[str]:
    """Render the reference of ``names`` (default: every ckptsdk module) into ``out``.

    Returns:
        Every warning raised while rendering, one line each (empty: a clean build).
    """
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="google", footer_text="ckptsdk API reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*specs(modules() if names is None else names), output_directory=out)
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=REPO / "docs" / "api", help="output folder")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))  # this clone's ckptsdk, as scripts/venv.sh's PYTHONPATH does
    problems = build(args.out)
    for line in problems:
        print(f"api_docs: {line}", file=sys.stderr)
    if problems:
        print(f"api_docs: {len(problems)} warning(s); the reference is incomplete", file=sys.stderr)
        return 1
    print(f"api_docs: {len(modules())} modules -> {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
