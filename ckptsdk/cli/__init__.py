"""The ``ckptsdk`` command: inspect, verify, audit and tidy a checkpoint root from a shell.

``ckptsdk {ls,show,verify,du} URL`` (checkpoints.py), ``audit`` (attempts.py), ``lease`` and
``gc`` (admin.py), ``ckptsdk import FILE.pt URL`` and ``ckptsdk export URL[@STEP] OUT.safetensors``
(porting.py); each prints a human table, or one JSON document on stdout with ``--json``.
Read-only commands never take the writer lease. This package only parses arguments, calls the
library and formats what it returns; checkpoint logic belongs elsewhere.

Exit codes:
    0  success (for ``audit`` without ``--strict``: whatever the verdict)
    1  a check failed: ``verify`` found a torn or corrupt checkpoint; ``audit --strict`` DIVERGED
    2  usage: bad arguments or options, unknown URL scheme, missing optional dependency
    3  storage or lease: the store is unreachable or failed, the lease is unreadable or held
    4  checkpoint: no checkpoint root at the URL, no such checkpoint, none valid, an unreadable
       manifest
  130  interrupted (Ctrl-C)
  141  stdout was closed by its reader (``| head``): stopped quietly, like other Unix tools
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

from ckptsdk.cli import admin, attempts, checkpoints, porting
from ckptsdk.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_CHECKPOINT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
    Failed,
    UsageError,
    emit_json,
)
from ckptsdk.errors import (
    BackendError,
    CheckpointError,
    CkptError,
    ConfigError,
    LeaseError,
    MissingDependencyError,
)

logger = logging.getLogger(__name__)

__all__ = [
    "main",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_STORAGE",
    "EXIT_CHECKPOINT",
    "EXIT_INTERRUPTED",
    "EXIT_BROKEN_PIPE",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptsdk",
        description="Inspect, verify, audit and tidy a ckptsdk checkpoint root (a path, drive://REL, gs://BUCKET/PREFIX).",
        epilog="exit codes: 0 ok, 1 a check failed (verify, audit --strict), 2 usage, 3 storage or lease, "
        "4 no checkpoint root or no such/valid checkpoint, 130 interrupted, 141 reader closed the pipe. "
        "gs:// uses the ambient credentials or "
        "STORAGE_EMULATOR_HOST; add --storage-option KEY=VALUE for gcsfs.",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug) to stderr")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("url", metavar="URL", help="checkpoint root")
        sp.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
        sp.add_argument(
            "--storage-option",
            action="append",
            metavar="KEY=VALUE",
            help="fsspec/gcsfs storage option (repeatable), e.g. token=anon",
        )
        return sp

    checkpoints.register(add)  # ls, show, verify, du
    attempts.register(add)  # audit
    admin.register(add)  # lease, gc
    porting.register(sub)  # import, export
    return p


def _exit_code(exc: CkptError) -> int:
    if isinstance(exc, (ConfigError, MissingDependencyError)):
        return EXIT_USAGE
    if isinstance(exc, (BackendError, LeaseError)):
        return EXIT_STORAGE
    if isinstance(exc, CheckpointError):
        return EXIT_CHECKPOINT
    return EXIT_FAILED


def _fail(args: argparse.Namespace, code: int, kind: str, message: str) -> int:
    message = " ".join(message.split())  # one line, whatever the library wrote
    sys.stderr.write(f"ckptsdk: error: {message}\n")
    if args.json:
        emit_json(
            {"command": args.command, "url": args.url, "error": {"type": kind, "message": message, "exit_code": code}}
        )
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckptsdk`` command line; returns the exit code (see the module docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 on bad usage, as argparse does
    logging.basicConfig(
        level=logging.DEBUG if args.verbose >= 2 else logging.INFO if args.verbose else logging.WARNING,
        format="ckptsdk: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    started = time.monotonic()
    try:
        code = int(args.fn(args))
        sys.stdout.flush()  # here, so that a closed pipe is handled below and not at exit
    except BrokenPipeError:
        # `ckptsdk audit URL | head -1`: the reader has what it wanted. Stop quietly, as Unix
        # tools do, and keep the interpreter's exit flush from failing on the closed pipe too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Failed:
        code = EXIT_FAILED
    except UsageError as exc:
        code = _fail(args, EXIT_USAGE, "UsageError", str(exc))
    except CkptError as exc:
        code = _fail(args, _exit_code(exc), type(exc).__name__, str(exc))
    except OSError as exc:  # e.g. the --plot file cannot be written
        code = _fail(args, EXIT_STORAGE, type(exc).__name__, f"{exc}; check the path and its permissions")
    except KeyboardInterrupt:
        sys.stderr.write("ckptsdk: interrupted\n")
        code = EXIT_INTERRUPTED
    logger.debug("%s took %.2f s", args.command, time.monotonic() - started)
    return code
