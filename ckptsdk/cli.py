"""The ``ckptsdk`` command: inspect, verify, audit and tidy a checkpoint root from a shell.

``ckptsdk {ls,show,verify,audit,lease,gc,du} URL``, ``ckptsdk import FILE.pt URL`` and
``ckptsdk export URL[@STEP] OUT.safetensors`` (their logic is in legacy_import.py and export.py; du's
in usage.py); each prints a human table, or one JSON document on stdout with ``--json``. Read-only
commands never take the writer lease. This module only parses arguments, calls the library and
formats what it returns; checkpoint logic belongs elsewhere.

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
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from .errors import (
    BackendError,
    CheckpointError,
    CkptError,
    ConfigError,
    CorruptCheckpointError,
    LeaseError,
    ManifestError,
    MissingDependencyError,
    NoCheckpointRootError,
    ObjectNotFound,
)

logger = logging.getLogger(__name__)

__all__ = ["main", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_STORAGE", "EXIT_CHECKPOINT"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STORAGE = 3
EXIT_CHECKPOINT = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader left


class _Failed(Exception):
    """A check that ran and failed (exit 1); the report was already printed."""


class _UsageError(Exception):
    """A bad combination of arguments that argparse cannot express (exit 2)."""


# ---------------------------------------------------------------------------- helpers


def _storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise _UsageError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        try:  # numbers, booleans and JSON objects pass typed; anything else stays a string
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _manager(args: argparse.Namespace) -> Any:
    from .manager import CheckpointManager  # imports torch: only for commands that need it

    return CheckpointManager(args.url, read_only=True, storage_options=_storage_options(args.storage_option))


def _backend(args: argparse.Namespace) -> Any:
    from .backends import open_backend

    return open_backend(args.url, **_storage_options(args.storage_option))


def _require_root(backend: Any, url: str) -> None:
    """Exit 4 on a URL where nothing is stored: a typo must not read as "no checkpoints", exit 0."""
    from .lease import LEASE_KEY

    if backend.exists(LEASE_KEY) or backend.list(""):
        return
    raise NoCheckpointRootError(
        f"no checkpoint root at {url}: nothing is stored there (no {LEASE_KEY}, no checkpoint); "
        "check the URL", url=url)


def _human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # unreachable


def _fmt_float(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.6g}"


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, float):
        return str(obj)
    raise TypeError(f"not JSON-able: {type(obj).__name__}")


def _clean(obj: Any) -> Any:
    """Make floats strict-JSON (nan/inf as strings), recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _emit_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(_clean(doc), indent=2, allow_nan=False, default=_json_default) + "\n")


def _manifest_dict(manifest: Any) -> dict[str, Any] | None:
    if manifest is None:
        return None
    return json.loads(manifest.to_json()) if hasattr(manifest, "to_json") else manifest.model_dump(mode="json")


def _info_dict(info: Any) -> dict[str, Any]:
    m = info.manifest
    pos = getattr(m, "position", None)
    return {
        "step": info.step,
        "key": info.key,
        "lease_epoch": info.epoch,
        "attempt": getattr(info, "attempt", None),
        "train_epoch": getattr(pos, "epoch", None),
        "batch_idx": getattr(pos, "batch_idx", None),
        "size": info.size,
        "committed": getattr(info, "committed", m is not None),
        "valid": info.valid,
        "orphan": getattr(info, "orphan", False),
        "anchor": getattr(info, "anchor", False),
        "copies": list(getattr(info, "copies", ())),
        "reason": info.reason,
        "created_at": getattr(m, "created_at", None) and str(m.created_at),
        "metrics": dict(getattr(m, "metrics", {}) or {}),
    }


def _status(info: Any) -> str:
    if info.valid:
        # What the listing checked (only `verify` re-hashes the bytes); an anchor is a takeover's
        # re-commit of its resume point; copies: the other folders of the step.
        extra = [x for x in ("anchor" if getattr(info, "anchor", False) else "",
                             f"+{len(info.copies)} cop{'y' if len(info.copies) == 1 else 'ies'}"
                             if getattr(info, "copies", ()) else "") if x]
        return "sizes ok" + (f" ({', '.join(extra)})" if extra else "")
    return info.reason or "invalid"


def _read_safetensors_header(backend: Any, key: str) -> list[dict[str, Any]]:
    """Tensor name, dtype, shape and byte size from a tensor file's header (bounded, checked)."""
    from .tensorfile import read_header  # the one header parser (torch: only when showing tensors)

    rows = [{"name": e.name, "dtype": e.code, "shape": e.shape, "bytes": e.nbytes}
            for e in read_header(backend, key)]
    return sorted(rows, key=lambda r: r["name"])


def _short_time(text: str | None) -> str:
    dt = _parse_wall(text)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if dt else (text or "-")


def _parse_wall(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


# ---------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    mgr = _manager(args)
    _require_root(mgr.backend, args.url)
    infos = mgr.list()
    rows = [_info_dict(i) for i in infos]
    if args.json:
        _emit_json({"command": "ls", "url": args.url, "checkpoints": rows})
        return EXIT_OK
    if not rows:
        print(f"no checkpoints under {args.url}")
        return EXIT_OK
    table = [
        [r["step"], r["train_epoch"], _human_size(r["size"]),
         f"e{r['lease_epoch']}/a{r['attempt'] if r['attempt'] is not None else '?'}",
         _short_time(r["created_at"]), _status(i)]
        for r, i in zip(rows, infos, strict=True)
    ]
    print(_table(table, ["STEP", "EPOCH", "SIZE", "WRITER", "CREATED", "STATUS"]))
    valid = sum(1 for r in rows if r["valid"])
    print(f"\n{len(rows)} steps under {args.url} (one row per step, the highest writer's), {valid} "
          "restorable by their manifest and file sizes (WRITER: lease epoch/attempt); "
          "`ckptsdk verify URL --all` re-hashes the bytes")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    mgr = _manager(args)
    from .catalog import TENSORS

    manifest = mgr.load_manifest(args.step)
    info = next(
        (i for i in mgr.list() if i.manifest is not None and i.step == manifest.step
         and i.epoch == manifest.writer.lease_epoch),
        None,
    )
    key = info.key if info is not None else None
    tensors: list[dict[str, Any]] = []
    tensor_error = None
    if key is not None and any(f.name == TENSORS for f in manifest.files):
        try:
            tensors = _read_safetensors_header(mgr.backend, f"{key}/{TENSORS}")
        except (ObjectNotFound, CorruptCheckpointError) as exc:
            # Still show the manifest: it is what tells the user what should have been there.
            tensor_error = f"{exc}; `ckptsdk verify {args.url} --step {manifest.step}` checks it"
    doc = {
        "command": "show", "url": args.url, "key": key,
        "manifest": _manifest_dict(manifest), "tensors": tensors, "tensor_file_error": tensor_error,
    }
    if args.json:
        _emit_json(doc)
        return EXIT_OK
    m = doc["manifest"]
    w = m.get("writer", {})
    pos = m.get("position", {})
    print(f"checkpoint {args.url}/{key}")
    print(f"  step        {m.get('step')}   (epoch {pos.get('epoch')}, batch {pos.get('batch_idx')})")
    print(f"  created     {m.get('created_at')}")
    print(f"  writer      run {w.get('run_id')}, attempt {w.get('attempt')}, lease epoch {w.get('lease_epoch')}, "
          f"host {w.get('host')} pid {w.get('pid')}, resumed from {w.get('resumed_from_step')}")
    env = m.get("environment") or {}
    if env:
        print("  environment " + ", ".join(f"{k} {v}" for k, v in env.items()))
    if m.get("metrics"):
        print("  metrics     " + ", ".join(f"{k}={v}" for k, v in m["metrics"].items()))
    if m.get("tags"):
        print("  tags        " + ", ".join(f"{k}={v}" for k, v in m["tags"].items()))
    print("\nfiles")
    print(_table([[f["name"], _human_size(f["size"]), f"{f['algorithm']}:{f['digest']}"] for f in m.get("files", [])],
                 ["NAME", "SIZE", "DIGEST"]))
    if tensor_error:
        print(f"\ntensors: unreadable: {tensor_error}")
    if tensors:
        total = sum(t["bytes"] for t in tensors)
        print(f"\ntensors ({len(tensors)}, {_human_size(total)})")
        print(_table([[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", t["bytes"]] for t in tensors],
                     ["NAME", "DTYPE", "SHAPE", "BYTES"]))
    return EXIT_OK


def _verify_one(mgr: Any, info: Any) -> tuple[str, str | None]:
    """(status, reason) of one checkpoint folder, re-hashing its files when it is committed."""
    from .tensorfile import verify_file

    if not getattr(info, "committed", info.manifest is not None):
        return "uncommitted", info.reason  # not a checkpoint (yet): never a verification failure
    if info.manifest is None or (not info.valid and not getattr(info, "orphan", False)):
        return "CORRUPT", info.reason or "invalid"
    try:
        for entry in info.manifest.files:
            verify_file(mgr.backend, f"{info.key}/{entry.name}", size=entry.size, digest=entry.digest,
                        algorithm=entry.algorithm)
    except (CorruptCheckpointError, ManifestError) as exc:
        return "CORRUPT", str(exc)
    if getattr(info, "orphan", False):
        return "orphan", info.reason  # intact, never restored: `gc` removes it
    return "ok", None


def cmd_verify(args: argparse.Namespace) -> int:
    mgr = _manager(args)
    _require_root(mgr.backend, args.url)
    infos = mgr.list()
    if args.all:
        targets = list(infos)
    elif args.step is not None:
        targets = [i for i in infos if i.step == args.step]
        if not targets:
            from .errors import NoValidCheckpointError

            raise NoValidCheckpointError(
                f"no checkpoint of step {args.step} under {args.url}; `ckptsdk ls {args.url}` lists the steps",
                url=args.url,
            )
    else:
        # The newest restorable checkpoint is re-hashed; every other committed one is still
        # checked cheaply (manifest readable, files present with their sizes) by the listing.
        newest = max((i for i in infos if i.valid), key=lambda i: (i.step, i.epoch), default=None)
        targets = [newest] if newest is not None else []
        targets += [
            i for i in infos
            if i is not newest and getattr(i, "committed", True) and not i.valid and not getattr(i, "orphan", False)
        ]
    results = []
    for info in sorted(targets, key=lambda i: (i.step, i.epoch)):
        status, reason = _verify_one(mgr, info)
        hashed = status in ("ok", "orphan") or (status == "CORRUPT" and info.valid)
        results.append({"step": info.step, "key": info.key, "lease_epoch": info.epoch, "status": status,
                        "rehashed": hashed, "reason": reason})
    bad = [r for r in results if r["status"] == "CORRUPT"]
    if args.json:
        _emit_json({"command": "verify", "url": args.url, "ok": not bad, "checked": results})
    else:
        if not results:
            print(f"no committed checkpoints under {args.url}: nothing to verify")
        else:
            print(_table([[r["step"], r["key"], r["status"], "yes" if r["rehashed"] else "no", r["reason"] or ""]
                          for r in results], ["STEP", "FOLDER", "STATUS", "REHASHED", "DETAIL"]))
            print()
            if bad:
                print(f"{len(bad)} corrupt checkpoint(s) under {args.url}: restore() skips them and uses the "
                      "newest valid one; `ckptsdk gc URL` removes them")
            else:
                print(f"all {len(results)} checked checkpoint(s) intact")
    if bad:
        raise _Failed()
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    from .audit import audit

    if args.tolerance < 0 or not math.isfinite(args.tolerance):
        raise _UsageError(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    backend = _backend(args)
    _require_root(backend, args.url)
    report = audit(backend, tolerance=args.tolerance)
    plot_path = None
    if args.plot:
        from .plot import plot_audit

        if report.series:
            plot_path = plot_audit(report, args.plot)
        else:
            logger.warning("nothing logged under %s/runlog/: no plot written", args.url)
    if args.json:
        doc = {"command": "audit", "url": args.url, "ok": report.ok, "plot": plot_path,
               "report": json.loads(report.model_dump_json())}
        _emit_json(doc)
    else:
        print(f"audit of {args.url}: {report.verdict}")
        if report.attempts:
            print()
            print(_table(
                [[a.attempt, a.lease_epoch, a.host, a.device, a.steps, a.first_step, a.last_step,
                  a.resumed_from_step if a.resumed_from_step is not None else "start", "yes" if a.closed else "no"]
                 for a in report.attempts],
                ["ATTEMPT", "EPOCH", "HOST", "DEVICE", "STEPS", "FIRST", "LAST", "RESUMED FROM", "CLOSED"],
            ))
        print()
        if report.overlaps:
            for o in report.overlaps:
                print(f"steps logged by attempts {', '.join(map(str, o.attempts))}: {o.first_step}..{o.last_step} "
                      f"({o.steps} steps)")
            print()
            print(_table([[n, _fmt_float(d.max_abs_diff), d.at_step, d.compared_steps]
                          for n, d in report.scalars.items()],
                         ["SCALAR", "MAX |DIFF|", "AT STEP", "COMPARED"]))
            if report.first_divergence is not None:
                d = report.first_divergence
                vals = ", ".join(f"attempt {a}: {v!r}" for a, v in d.values.items())
                print(f"\nfirst divergence: step {d.step}, {d.scalar}: {vals}")
        else:
            print("no step was logged by more than one attempt: nothing to compare")
        for w in report.warnings:
            print(f"warning: {w}")
        if plot_path:
            print(f"plot written to {plot_path}")
    if args.strict and not report.ok:
        raise _Failed()
    return EXIT_OK


def _lease_doc(record: Any) -> dict[str, Any]:
    doc = json.loads(record.to_json()) if hasattr(record, "to_json") else record.model_dump(mode="json")
    renewed = _parse_wall(getattr(record, "renewed_at", None))
    age = (datetime.now(timezone.utc) - renewed).total_seconds() if renewed else None
    ttl = getattr(record, "ttl", None)
    if getattr(record, "released", False):
        state = "released"
    elif age is not None and ttl is not None and age > ttl:
        state = "stale"
    else:
        state = "held"
    return {"record": doc, "age_s": None if age is None else round(age, 1), "state": state}


def cmd_lease(args: argparse.Namespace) -> int:
    from .lease import Lease, read_lease

    if args.break_lease and not args.yes_i_am_sure:
        raise _UsageError(
            "--break takes over the lease and fences its holder (a live writer then stops with "
            "LeaseLostError at its next save); add --yes-i-am-sure to do it"
        )
    backend = _backend(args)
    unreadable = None
    try:
        record = read_lease(backend)
    except LeaseError as exc:  # garbage, empty, a newer format: only --break can get past it
        if not args.break_lease:
            raise
        record, unreadable = None, str(exc)
    broken: dict[str, Any] | None = None
    if args.break_lease and (unreadable or (record is not None and not record.released)):
        if not backend.capabilities.immediately_consistent:
            sys.stderr.write("ckptsdk: breaking the lease; on this store the takeover waits a settle "
                             "time (about a minute) before it is confirmed\n")
        lease = Lease(backend, force=True, run_id=record.run_id if record is not None else None)
        lease.acquire()  # a new epoch: the old holder is fenced from its next renewal on
        lease.release()  # ...and the lease is left free for the next writer
        broken = ({"epoch": record.epoch, "holder": record.holder.model_dump(mode="json")} if record
                  else {"epoch": None, "holder": {"host": "?", "pid": None}, "unreadable": unreadable})
        record = read_lease(backend)
    doc = {"command": "lease", "url": args.url, "lease": _lease_doc(record) if record else None, "broken": broken}
    if args.json:
        _emit_json(doc)
        return EXIT_OK
    if broken is not None and unreadable:
        print(f"broke an unreadable lease ({unreadable}); the lease is free")
    elif broken is not None:
        print(f"broke the lease of host {broken['holder']['host']!r} pid {broken['holder']['pid']} (epoch "
              f"{broken['epoch']}); it is fenced and the lease is free")
    elif args.break_lease:
        print("nothing to break: " + ("no lease" if record is None else "the lease is already released"))
    if record is None:
        print(f"no lease under {args.url}: no writer has opened this root")
        return EXIT_OK
    d = doc["lease"]
    age = d["age_s"]
    print(f"lease of {args.url}: {d['state']}")
    print(f"  holder    host {record.holder.host!r} pid {record.holder.pid}")
    print(f"  run       {record.run_id}, attempt {record.attempt}, epoch {record.epoch}")
    print(f"  acquired  {record.acquired_at} (holder's clock)")
    print(f"  renewed   {record.renewed_at} (holder's clock), {record.renewals} renewals, ttl {record.ttl:g} s")
    if age is not None:
        print(f"  age       {age:.0f} s since the last renewal, as this machine's clock reads it "
              "(clocks of two machines can disagree)")
    if d["state"] == "stale":
        print("  the holder looks dead; a new writer takes over after watching the lease for one ttl, "
              "or at once with `ckptsdk lease URL --break --yes-i-am-sure`")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    if args.keep_last is not None and args.keep_last < 1:
        raise _UsageError(f"--keep-last must be >= 1 (the newest checkpoint is always kept), got {args.keep_last}")
    mgr = _manager(args)
    _require_root(mgr.backend, args.url)
    kwargs: dict[str, Any] = {"keep_last": args.keep_last, "dry_run": args.dry_run}
    if args.grace is not None:
        kwargs["grace"] = args.grace
    report = mgr.gc(**kwargs)
    deleted = list(report.deleted)
    reasons = dict(getattr(report, "reasons", {}) or {})
    sizes, trash = dict(getattr(report, "sizes", {}) or {}), getattr(report, "trash_bytes", None)
    if args.json:
        _emit_json({"command": "gc", "url": args.url, "dry_run": args.dry_run, "deleted": deleted, "reasons": reasons,
                    "sizes": sizes, "trash_bytes": trash})
        return EXIT_OK
    verb = "would delete" if args.dry_run else "deleted"
    if not deleted:
        print(f"nothing to delete under {args.url}")
        return EXIT_OK
    print(_table([[k, _human_size(sizes.get(k)), reasons.get(k, "")] for k in deleted], ["KEY", "SIZE", "WHY"]))
    print(f"\n{verb} {len(deleted)} item(s) under {args.url}" + (" (dry run: nothing deleted)" if args.dry_run else ""))
    if trash is not None:
        from . import usage

        print(usage.trash_note(trash, _backend(args)))
    return EXIT_OK


def cmd_du(args: argparse.Namespace) -> int:
    from . import usage

    u = usage.usage(_backend(args))
    if args.json:
        _emit_json({"command": "du", "url": args.url, **usage.as_dict(u)})
    else:
        print(usage.render(u, args.url))
    return EXIT_OK


# ---------------------------------------------------------------------------- parser, main


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
        sp.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        help="fsspec/gcsfs storage option (repeatable), e.g. token=anon")
        return sp

    add("ls", "list checkpoints: step, epoch, size, writer (lease epoch/attempt), valid or why not").set_defaults(
        fn=cmd_ls)
    sp = add("show", "show a checkpoint's manifest and tensor table (newest valid one by default)")
    sp.add_argument("--step", type=int, help="which step (default: the newest valid checkpoint)")
    sp.set_defaults(fn=cmd_show)
    sp = add("verify", "re-hash checkpoint files against their manifests; exit 1 on any corruption")
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--all", action="store_true", help="re-hash every committed checkpoint (default: the newest)")
    group.add_argument("--step", type=int, help="re-hash the checkpoint(s) of this step")
    sp.set_defaults(fn=cmd_verify)
    sp = add("audit", "compare the steps logged by several attempts (did the resume continue the same run?)")
    sp.add_argument("--strict", action="store_true", help="exit 1 when the verdict is DIVERGED")
    sp.add_argument("--tolerance", type=float, default=0.0, help="largest |difference| accepted (default 0: bit-exact)")
    sp.add_argument("--plot", metavar="FILE.png", help="draw loss over steps by attempt (needs the 'plot' extra)")
    sp.set_defaults(fn=cmd_audit)
    sp = add("lease", "show the writer lease: holder, epoch, age; --break to free it")
    sp.add_argument("--break", dest="break_lease", action="store_true",
                    help="take the lease over (fencing its holder) and release it")
    sp.add_argument("--yes-i-am-sure", action="store_true", help="confirm --break")
    sp.set_defaults(fn=cmd_lease)
    sp = add("gc", "delete rotated-out checkpoints, orphans of superseded writers and crashed leftovers")
    sp.add_argument("--keep-last", type=int, help="checkpoints to keep (default: the manager's, 3)")
    sp.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    sp.add_argument("--grace", type=float, help="seconds a crashed write's leftovers must be old to go")
    sp.set_defaults(fn=cmd_gc)
    add("du", "bytes held: committed, anchor, duplicate, uncommitted, orphaned; Drive trash estimate").set_defaults(
        fn=cmd_du)
    _add_porting_commands(sub)
    return p


def _porting(module: str, name: str) -> Any:
    """A command whose logic lives in ckptsdk.legacy_import / ckptsdk.export, imported only when
    that command runs (so nothing else in the CLI ever imports the torch.load door)."""
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(f"ckptsdk.{module}"), name)(args))
    return run


def _add_porting_commands(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec/gcsfs storage option")
    sp = sub.add_parser("import", parents=[common], help="commit a torch.save checkpoint (.pt) as a new root's first "
                        "checkpoint, read with weights_only=True")
    sp.add_argument("file", metavar="FILE.pt")
    sp.add_argument("url", metavar="URL", help="a checkpoint root without checkpoints")
    sp.add_argument("--allow-numpy-rng", action="store_true",
                    help="accept the 4 numpy globals np.random.get_state() needs (nothing else)")
    sp.add_argument("--step", type=int, help="the step to record (default: the file's 'step'/'global_step')")
    sp.add_argument("--drop", action="append", metavar="KEY", help="leave this key of the file out (repeatable)")
    sp.add_argument("--force", action="store_true", help="break a live writer lease on URL")
    sp.set_defaults(fn=_porting("legacy_import", "cmd_import"))
    sp = sub.add_parser("export", parents=[common], help="write a checkpoint's model weights to one .safetensors file")
    sp.add_argument("url", metavar="URL[@STEP]", help="checkpoint root, optionally @STEP (default: newest valid)")
    sp.add_argument("out", metavar="OUT.safetensors")
    sp.add_argument("--object", metavar="PATH", help="where the state dict is in the tree (default: objects/model, "
                    "objects/model_0 or lightning/state_dict)")
    sp.add_argument("--tied", action="append", metavar="REMOVED=KEPT",
                    help="declare a tied weight: written once, recorded in the metadata as save_model does")
    sp.set_defaults(fn=_porting("export", "cmd_export"))


def _exit_code(exc: CkptError) -> int:
    if isinstance(exc, (ConfigError, MissingDependencyError)):
        return EXIT_USAGE
    if isinstance(exc, (BackendError, LeaseError)):
        return EXIT_STORAGE
    if isinstance(exc, CheckpointError):
        return EXIT_CHECKPOINT
    return EXIT_FAILED


def _fail(args: argparse.Namespace | None, code: int, kind: str, message: str) -> int:
    message = " ".join(message.split())  # one line, whatever the library wrote
    sys.stderr.write(f"ckptsdk: error: {message}\n")
    if args is not None and getattr(args, "json", False):
        _emit_json({"command": args.command, "url": args.url,
                    "error": {"type": kind, "message": message, "exit_code": code}})
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
        code = args.fn(args)
        sys.stdout.flush()  # here, so that a closed pipe is handled below and not at exit
    except BrokenPipeError:
        # `ckptsdk audit URL | head -1`: the reader has what it wanted. Stop quietly, as Unix
        # tools do, and keep the interpreter's exit flush from failing on the closed pipe too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except _Failed:
        code = EXIT_FAILED
    except _UsageError as exc:
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


if __name__ == "__main__":  # pragma: no cover - `python -m ckptsdk` goes through __main__.py
    sys.exit(main())
