"""The error tree drawn in ``ckptsdk/errors.py``'s docstring is the tree of its classes.

Every ``CkptError`` subclass in the module is drawn exactly once, under its real parent, with the
builtins it also inherits in parentheses; nothing is drawn that does not exist. A new error, or a
changed base, fails here until the drawing says so too.
"""

from __future__ import annotations

import builtins
import inspect
import re
from dataclasses import dataclass
from types import ModuleType

import pytest

from ckptsdk import errors

# One drawn line: tree glyphs, a class name, optional "(Builtin, Builtin)", then its description.
_ENTRY = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>[A-Z]\w*)(?:\s*\((?P<bases>[^)]*)\))?(?:\s{2,}\S.*)?$")


@dataclass(frozen=True)
class Drawn:
    """One class as the drawing shows it."""

    name: str
    parent: str | None
    builtins: tuple[str, ...]
    line: int


def _drawing(doc: str) -> list[Drawn]:
    """The tree in ``doc``: the block of lines from the first bare class name to the first blank line."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if _ENTRY.match(line) and "CkptError" in line)
    drawn: list[Drawn] = []
    stack: list[tuple[int, str]] = []  # (column of the name, name) of the open ancestors
    for offset, line in enumerate(lines[start:]):
        if not line.strip():
            break
        m = _ENTRY.match(line)
        assert m is not None, f"errors.py docstring line {start + offset + 1} is not a tree entry: {line!r}"
        column = len(m.group("indent"))
        while stack and stack[-1][0] >= column:
            stack.pop()
        bases = tuple(b.strip() for b in (m.group("bases") or "").split(",") if b.strip())
        drawn.append(Drawn(m.group("name"), stack[-1][1] if stack else None, bases, start + offset + 1))
        stack.append((column, m.group("name")))
    return drawn


def _classes(module: ModuleType) -> dict[str, type[BaseException]]:
    return {
        name: cls
        for name, cls in vars(module).items()
        if inspect.isclass(cls) and issubclass(cls, module.CkptError) and cls.__module__ == module.__name__
    }


def _mismatches(doc: str, module: ModuleType) -> list[str]:
    """What the drawing in ``doc`` gets wrong about ``module``'s classes (empty: it is right)."""
    drawn = _drawing(doc)
    classes = _classes(module)
    problems: list[str] = []
    names = [d.name for d in drawn]
    problems += [f"{n} is drawn {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    problems += [f"{n} is drawn but is not a CkptError class in errors.py" for n in names if n not in classes]
    problems += [f"{n} is not drawn" for n in sorted(classes) if n not in names]
    for d in drawn:
        cls = classes.get(d.name)
        if cls is None:
            continue
        ours = [b.__name__ for b in cls.__bases__ if issubclass(b, module.CkptError)]
        builtins = tuple(b.__name__ for b in cls.__bases__ if not issubclass(b, module.CkptError))
        real_parent = ours[0] if ours else None
        if cls is module.CkptError:
            real_parent, builtins = None, tuple(b for b in builtins if b != "Exception")
        if len(ours) > 1:
            problems.append(f"{d.name} has two ckptsdk parents {ours}; a tree cannot draw that")
        if d.parent != real_parent:
            problems.append(f"line {d.line}: {d.name} is drawn under {d.parent} but its parent is {real_parent}")
        if d.builtins != builtins:
            problems.append(
                f"line {d.line}: {d.name} is drawn with builtins {d.builtins or '()'} but inherits {builtins or '()'}"
            )
    return problems


def test_the_drawing_in_errors_py_matches_the_classes() -> None:
    assert errors.__doc__
    problems = _mismatches(errors.__doc__, errors)
    assert not problems, "ckptsdk/errors.py: fix the drawing in the docstring (or the class):\n" + "\n".join(problems)


def test_every_class_is_drawn_and_the_drawing_is_complete() -> None:
    assert errors.__doc__
    assert {d.name for d in _drawing(errors.__doc__)} == set(_classes(errors))
    assert len(_classes(errors)) >= 25  # the parser read the whole tree, not its first line


_OLD_DRAWING = """
    CkptError                                  anything
     ├── ConfigError (ValueError)              a bad URL
     │    ├── UnknownSchemeError                a scheme
     │    └── MissingDependencyError (ImportError)  an extra
     ├── BackendError (OSError)                storage failed
     │    └── ObjectNotFound                        the key does not exist
     └── Ghost                                 never defined
"""


def test_a_wrong_drawing_is_caught() -> None:
    """The check's teeth: the drawing as it was before (a wrong parent), a missing builtin, a ghost."""
    problems = "\n".join(_mismatches(_OLD_DRAWING, errors))
    assert "MissingDependencyError is drawn under ConfigError but its parent is CkptError" in problems
    assert "ObjectNotFound is drawn with builtins () but inherits ('FileNotFoundError',)" in problems
    assert "Ghost is drawn but is not a CkptError class" in problems
    assert "LeaseError is not drawn" in problems


@pytest.mark.parametrize("name", ["MissingDependencyError", "ObjectNotFound", "StateMismatchError", "ConfigError"])
def test_users_can_catch_the_builtin_the_drawing_promises(name: str) -> None:
    drawn = {d.name: d for d in _drawing(errors.__doc__ or "")}[name]
    cls = getattr(errors, name)
    assert drawn.builtins
    for builtin in drawn.builtins:
        assert issubclass(cls, getattr(builtins, builtin)), f"{name} is drawn as a {builtin} but is not one"
