"""Repository-wide pytest hooks: the doctests of ckptsdk/ where an optional package is missing.

``--doctest-modules`` (pyproject's addopts) imports every module under ckptsdk/. A module that
needs an optional extra (a framework integration, the gcs backend) cannot be imported without it:
its doctests are then skipped, saying which package is missing, unless ``CKPTSDK_REQUIRE_ALL=1``
(CI, where the dev extra installs everything), where the import error stays a collection error.
Test fixtures live in tests/conftest.py, not here.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_PACKAGE = Path(__file__).resolve().parent / "ckptsdk"


class _MissingExtra(pytest.File):
    """Stands in for the doctests of a module whose optional package is not installed."""

    reason = ""

    def collect(self) -> Iterator[Any]:
        pytest.skip(self.reason)
        yield  # pragma: no cover  (a generator, as pytest expects of collect)


def _missing_package(module: str) -> str | None:
    """The optional package ``module`` cannot import, else None (also None for any other error)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        cause: BaseException | None = exc
        while cause is not None:  # MissingDependencyError wraps the ModuleNotFoundError
            name = getattr(cause, "name", None)
            if isinstance(cause, ModuleNotFoundError) and name and not name.startswith("ckptsdk"):
                return name
            cause = cause.__cause__
    return None


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Iterator[Any]:
    collectors = yield
    if os.environ.get("CKPTSDK_REQUIRE_ALL") == "1" or file_path.suffix != ".py":
        return collectors
    try:
        relative = file_path.resolve().relative_to(_PACKAGE.parent)
    except ValueError:
        return collectors
    if relative.parts[0] != _PACKAGE.name or file_path.name == "__main__.py":
        return collectors
    module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
    missing = _missing_package(module)
    if missing is None:
        return collectors
    stand_in = _MissingExtra.from_parent(parent, path=file_path)
    stand_in.reason = f"doctests of {module}: optional package {missing} is not installed"
    return [c for c in collectors if type(c).__name__ != "DoctestModule"] + [stand_in]
