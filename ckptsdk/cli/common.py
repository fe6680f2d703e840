"""What every ``ckptsdk`` command shares: opening the root, the two CLI-only errors, output.

Tables, sizes, times and the one JSON document a ``--json`` command prints. Commands live in
the sibling modules; checkpoint logic lives in the library, never here. Nothing here imports
torch or numpy: the everyday commands (``ls``, ``show``, ``audit``, ``du``, ``lease``, ``gc``) run
without them (tests/cli/test_cli_imports.py holds it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ckptsdk.errors import NoCheckpointRootError
from ckptsdk.format.document import parse_utc

if TYPE_CHECKING:  # a backend may import fsspec: commands import them when they run
    from ckptsdk.backends.base import Backend
    from ckptsdk.checkpoint.reading.reader import CheckpointReader

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CHECKPOINT",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "Failed",
    "UsageError",
    "backend",
    "emit_json",
    "fmt_float",
    "human_size",
    "parse_wall",
    "reader",
    "require_root",
    "short_time",
    "storage_options",
    "table",
]


# The exit codes (the package docstring says when each happens; README.md lists them).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STORAGE = 3
EXIT_CHECKPOINT = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader left


class Failed(Exception):
    """A check that ran and failed (exit 1); the report was already printed."""


class UsageError(Exception):
    """A bad combination of arguments that argparse cannot express (exit 2)."""


def storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` pairs as fsspec options (JSON values typed, else strings)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        try:  # numbers, booleans and JSON objects pass typed; anything else stays a string
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def reader(args: argparse.Namespace) -> CheckpointReader:
    """What a ``read_only`` manager of ``args.url`` is (never the lease), without torch.

    :class:`~ckptsdk.CheckpointManager` would import torch for its saving half: seconds at
    every ``ckptsdk ls`` after a reconnect, for nothing a read-only command uses.
    """
    from ckptsdk.checkpoint.reading.reader import CheckpointReader

    out = CheckpointReader(backend(args))
    out.url = args.url  # messages name the root as the user typed it, as the manager's do
    return out


def backend(args: argparse.Namespace) -> Backend:
    """The store of ``args.url``, opened without torch."""
    from ckptsdk.backends import open_backend

    return open_backend(args.url, **storage_options(args.storage_option))


def require_root(store: Backend, url: str) -> None:
    """Exit 4 on a URL where nothing is stored: a typo must not read as "no checkpoints", exit 0."""
    from ckptsdk.lease.acquire import LEASE_KEY

    if store.exists(LEASE_KEY) or store.list(""):
        return
    head, sep, tail = url.rpartition("@")
    if sep and (tail.isdigit() or tail.startswith("best:")):
        # URL@STEP names one checkpoint: show, verify and export take it; the rest take a root.
        raise UsageError(
            f"{url!r} names one checkpoint of the root {head!r}: `ckptsdk show`, `verify` and `export` take "
            f"URL@STEP; this command takes the root: ckptsdk COMMAND {head}"
        )
    raise NoCheckpointRootError(
        f"no checkpoint root at {url}: nothing is stored there (no {LEASE_KEY}, no checkpoint); check the URL", url=url
    )


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def fmt_float(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.6g}"


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    raise TypeError(f"not JSON-able: {type(obj).__name__}")


def _clean(obj: Any) -> Any:
    """Make floats strict JSON (nan/inf as the strings JSON parsers print), recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def emit_json(doc: dict[str, Any]) -> None:
    """Print ``doc`` as the one JSON document on stdout (strict JSON: no NaN literals)."""
    sys.stdout.write(json.dumps(_clean(doc), indent=2, allow_nan=False, default=_json_default) + "\n")


def parse_wall(text: str | None) -> datetime | None:
    """A stored UTC time (document.py's rule), or None when absent or unreadable."""
    if not text:
        return None
    try:
        return parse_utc(text)
    except ValueError:
        return None


def short_time(text: str | None) -> str:
    dt = parse_wall(text)
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if dt else (text or "-")
