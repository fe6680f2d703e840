"""``ckptsdk ls``, ``show``, ``verify`` and ``du``: what a root holds, read-only.

Each prints a human table, or one JSON document with ``--json``; none takes the writer lease.
Which checkpoint is valid, why it is kept, the best one and the re-hash of its files are the
library's (:class:`ckptsdk.checkpoint.reading.reader.CheckpointReader`, the keep rules); this module only
formats them, and resolves a ``URL@STEP`` / ``URL@best:METRIC`` selector to a step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptsdk.cli.admin import add_rule_flags, rules_from_args, rules_in_force
from ckptsdk.cli.common import (
    EXIT_OK,
    Failed,
    UsageError,
    emit_json,
    human_size,
    reader,
    require_root,
    short_time,
    storage_options,
    table,
)
from ckptsdk.errors import CorruptCheckpointError, NoValidCheckpointError, ObjectNotFound

if TYPE_CHECKING:
    from ckptsdk.checkpoint.reading.catalog import CheckpointInfo

__all__ = ["cmd_du", "cmd_ls", "cmd_show", "cmd_verify", "register", "resolve_selector"]

BEST = "best:"


def resolve_selector(url: str, options: dict[str, Any]) -> tuple[str, int | None]:
    """Split ``URL@STEP`` or ``URL@best:METRIC[:min|max]`` into the root and the step it names.

    ``@best:`` is resolved from the committed manifests, as ``mgr.best`` does (NaN/inf never
    best, a zombie's orphans never candidates; mode by default ``min`` for a name ending in
    ``loss``). A URL without a selector names no step (None: the newest valid checkpoint).

    Raises:
        UsageError: ``@best:`` without a metric, or a mode other than min/max.
        NoValidCheckpointError: no restorable checkpoint holds a finite value of the metric.
    """
    head, sep, tail = url.rpartition("@")
    if sep and tail.isdigit():
        return head, int(tail)
    if not (sep and tail.startswith(BEST)):
        return url, None
    metric, _, mode = tail[len(BEST) :].partition(":")
    if not metric or mode not in ("", "min", "max"):
        raise UsageError(f"{url!r}: write URL@best:METRIC or URL@best:METRIC:min|max (e.g. run@best:val_loss)")
    from ckptsdk.manager import CheckpointManager  # imports torch: only when a selector needs it

    mgr = CheckpointManager(head, read_only=True, storage_options=options)
    require_root(mgr.backend, head)
    info = mgr.best(metric, mode or None)  # type: ignore[arg-type]  # checked above
    if info is None:
        raise NoValidCheckpointError(
            f"no restorable checkpoint under {head} holds a finite {metric!r} (NaN/inf are never best); "
            f"`ckptsdk ls {head} --json` shows each checkpoint's metrics",
            url=head,
        )
    return head, info.step


def _select(args: argparse.Namespace) -> None:
    """``show``/``verify`` take ``URL@STEP`` and ``URL@best:METRIC`` as ``export`` does: one
    address syntax. ``args.url`` becomes the root, ``args.step`` the step it names.

    Raises:
        UsageError: a selector and ``--step``/``--all`` that say different things.
    """
    root, step = resolve_selector(args.url, storage_options(args.storage_option))
    if step is None:
        return
    if getattr(args, "all", False):
        raise UsageError(f"{args.url!r} names one checkpoint and --all every one: give one of them")
    if args.step is not None and args.step != step:
        raise UsageError(f"{args.url!r} names step {step} and --step {args.step}: give one of them")
    args.url, args.step = root, step


def _info_dict(info: CheckpointInfo) -> dict[str, Any]:
    m = info.manifest
    return {
        "step": info.step,
        "key": info.key,
        "lease_epoch": info.epoch,
        "attempt": info.attempt,
        "train_epoch": m.position.epoch if m is not None else None,
        "batch_idx": m.position.batch_idx if m is not None else None,
        "size": info.size,
        "shared_size": sum(f.size for f in m.shared) if m is not None else 0,
        "committed": info.committed,
        "valid": info.valid,
        "orphan": info.orphan,
        "anchor": info.anchor,
        "copies": list(info.copies),
        "reason": info.reason,
        "created_at": str(m.created_at) if m is not None else None,
        "metrics": dict(m.metrics) if m is not None else {},
    }


def _status(info: CheckpointInfo) -> str:
    if info.valid:
        # What the listing checked (only `verify` re-hashes the bytes); an anchor is a takeover's
        # re-commit of its resume point; copies: the other folders of the step.
        copies = len(info.copies)
        extra = [
            x
            for x in (
                "anchor" if info.anchor else "",
                f"+{copies} cop{'y' if copies == 1 else 'ies'}" if copies else "",
            )
            if x
        ]
        return "sizes ok" + (f" ({', '.join(extra)})" if extra else "")
    return info.reason or "invalid"


def _kept_by(info: CheckpointInfo, kept: dict[int, tuple[str, ...]]) -> str:
    if not info.valid:
        return "-"
    if info.step not in kept:
        return "no rule: gc deletes it"
    from ckptsdk.checkpoint.retention import NOT_JUDGED

    why = list(dict.fromkeys(kept[info.step]))
    # A rule this command cannot judge keeps every step: name it only where nothing else does.
    judged = [w for w in why if not w.endswith(f": {NOT_JUDGED}")]
    return ", ".join(judged or why)


def cmd_ls(args: argparse.Namespace) -> int:
    rules_from_args(args)  # a bad flag is a usage error before anything is read
    mgr = reader(args)
    require_root(mgr.backend, args.url)
    infos = mgr.list()
    # What CheckpointManager.kept/rules answer, without the manager's torch import.
    from ckptsdk.checkpoint.pruning.rotation import Rotation
    from ckptsdk.checkpoint.pruning.rotation import kept as kept_steps
    from ckptsdk.checkpoint.reading.catalog import scan

    cat = scan(mgr.backend)
    in_force = rules_in_force(args, cat)
    for note in in_force.notes:
        sys.stderr.write(f"ckptsdk: {note}\n")
    rotation = Rotation(mgr.backend, keep_last=in_force.keep_last, keep_every=None)
    kept = kept_steps(cat, rotation.retention_rules(in_force.keep_last, in_force.rules), settle=rotation.late)
    rows = [{**_info_dict(i), "kept_by": list(kept.get(i.step, ())) if i.valid else []} for i in infos]
    said = in_force.said()
    if args.json:
        emit_json(
            {
                "command": "ls",
                "url": args.url,
                "rules": said,
                "rules_from": in_force.source,
                "notes": in_force.notes,
                "checkpoints": rows,
            }
        )
        return EXIT_OK
    if not rows:
        print(f"no checkpoints under {args.url}")
        return EXIT_OK
    sharing = any(r["shared_size"] for r in rows)  # a column only where some checkpoint refers to shared files
    cells = [
        [
            r["step"],
            r["train_epoch"],
            human_size(r["size"]),
            *([human_size(r["shared_size"]) if r["shared_size"] else "-"] if sharing else []),
            f"e{r['lease_epoch']}/a{r['attempt'] if r['attempt'] is not None else '?'}",
            short_time(r["created_at"]),
            _status(i),
            _kept_by(i, kept),
        ]
        for r, i in zip(rows, infos, strict=True)
    ]
    heads = ["STEP", "EPOCH", "SIZE", *(["SHARED"] if sharing else []), "WRITER", "CREATED", "STATUS", "KEPT BY"]
    print(table(cells, heads))
    valid = sum(1 for r in rows if r["valid"])
    print(
        f"\n{len(rows)} steps under {args.url} (one row per step, the highest writer's), {valid} "
        "restorable by their manifest and file sizes (WRITER: lease epoch/attempt); "
        "`ckptsdk verify URL --all` re-hashes the bytes"
    )
    if sharing:
        print("SIZE: the folder's own files; SHARED: the shared files it refers to (`ckptsdk du` counts each once)")
    print(f"KEPT BY: the keep rules {said} ({in_force.origin()}), judged from the manifests as gc judges them")
    return EXIT_OK


def _tensor_rows(mgr: Any, key: str) -> list[dict[str, Any]]:
    """Tensor name, dtype, shape and byte size from a tensor file's header (bounded, checked)."""
    from ckptsdk.format.files.tensorfile import read_header  # the one header parser; no torch

    rows = [
        {"name": e.name, "dtype": e.code, "shape": e.shape, "bytes": e.nbytes} for e in read_header(mgr.backend, key)
    ]
    return sorted(rows, key=lambda r: r["name"])


def cmd_show(args: argparse.Namespace) -> int:
    from ckptsdk.format.layout import TENSORS

    _select(args)
    mgr = reader(args)
    require_root(mgr.backend, args.url)  # a mistyped URL says so, as `ls` does, not "no valid checkpoint"
    info = mgr.pick(args.step)
    manifest = info.manifest
    assert manifest is not None  # pick() returns only checkpoints whose manifest reads
    tensors: list[dict[str, Any]] = []
    tensor_error = None
    if any(f.name == TENSORS for f in manifest.files):
        try:
            tensors = _tensor_rows(mgr, f"{info.key}/{TENSORS}")
        except (ObjectNotFound, CorruptCheckpointError) as exc:
            # Still show the manifest: it is what tells the user what should have been there.
            tensor_error = f"{exc}; `ckptsdk verify {args.url}@{manifest.step}` checks it"
    m = json.loads(manifest.to_json())
    if args.json:
        emit_json(
            {
                "command": "show",
                "url": args.url,
                "key": info.key,
                "manifest": m,
                "tensors": tensors,
                "tensor_file_error": tensor_error,
            }
        )
        return EXIT_OK
    w, pos = m["writer"], m["position"]
    print(f"checkpoint {args.url}/{info.key}")
    print(f"  step        {m['step']}   (epoch {pos.get('epoch')}, batch {pos.get('batch_idx')})")
    print(f"  created     {m['created_at']}")
    print(
        f"  writer      run {w['run_id']}, attempt {w['attempt']}, lease epoch {w['lease_epoch']}, "
        f"host {w['host']} pid {w['pid']}, resumed from {w.get('resumed_from_step')}"
    )
    env = m.get("environment") or {}
    if env:
        print("  environment " + ", ".join(f"{k} {v}" for k, v in env.items()))
    if m.get("metrics"):
        print("  metrics     " + ", ".join(f"{k}={v}" for k, v in m["metrics"].items()))
    if m.get("tags"):
        print("  tags        " + ", ".join(f"{k}={v}" for k, v in m["tags"].items()))
    print("\nfiles")
    print(
        table(
            [[f["name"], human_size(f["size"]), f"{f['algorithm']}:{f['digest']}"] for f in m["files"]],
            ["NAME", "SIZE", "DIGEST"],
        )
    )
    if tensor_error:
        print(f"\ntensors: unreadable: {tensor_error}")
    if tensors:
        total = sum(t["bytes"] for t in tensors)
        print(f"\ntensors ({len(tensors)}, {human_size(total)})")
        print(
            table(
                [[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", t["bytes"]] for t in tensors],
                ["NAME", "DTYPE", "SHAPE", "BYTES"],
            )
        )
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    _select(args)
    mgr = reader(args)
    require_root(mgr.backend, args.url)
    infos = mgr.list()
    if args.all:
        targets = list(infos)
    elif args.step is not None:
        targets = [i for i in infos if i.step == args.step]
        if not targets:
            raise NoValidCheckpointError(
                f"no checkpoint of step {args.step} under {args.url}; `ckptsdk ls {args.url}` lists the steps",
                url=args.url,
            )
    else:
        # The newest restorable checkpoint is re-hashed; every other committed one is still
        # checked cheaply (manifest readable, files present with their sizes) by the listing.
        newest = max((i for i in infos if i.valid), key=lambda i: (i.step, i.epoch), default=None)
        targets = [newest] if newest is not None else []
        targets += [i for i in infos if i is not newest and i.committed and not i.valid and not i.orphan]
    results = []
    for info in sorted(targets, key=lambda i: (i.step, i.epoch)):
        verdict = mgr.check(info)
        results.append(
            {
                "step": info.step,
                "key": info.key,
                "lease_epoch": info.epoch,
                "status": verdict.status,
                "rehashed": verdict.rehashed,
                "reason": verdict.reason,
                "unchecked": verdict.unchecked,
            }
        )
    bad = [r for r in results if r["status"] == "CORRUPT"]
    if args.json:
        emit_json({"command": "verify", "url": args.url, "ok": not bad, "checked": results})
    elif not results:
        print(f"no committed checkpoints under {args.url}: nothing to verify")
    else:
        print(
            table(
                [
                    [
                        r["step"],
                        r["key"],
                        r["status"],
                        "yes" if r["rehashed"] else "no",
                        "; ".join(str(x) for x in (r["reason"], r["unchecked"]) if x),
                    ]
                    for r in results
                ],
                ["STEP", "FOLDER", "STATUS", "REHASHED", "DETAIL"],
            )
        )
        print()
        if bad:
            # gc judges by the keep rules and the listing (sizes), never by re-hashing every
            # byte: a digest-corrupt checkpoint goes when the rules let it go, as any other.
            print(
                f"{len(bad)} corrupt checkpoint(s) under {args.url}: restore() skips them and uses the "
                "newest valid one. They stay until the keep rules let them go (rotation at the next saves, "
                f"or `ckptsdk gc {args.url}`: it judges by the rules, not by digests); nothing restores them"
            )
        else:
            gone = sum(1 for r in results if r["status"] == "gone")
            intact = f"all {len(results) - gone} checked checkpoint(s) intact"
            print(intact + (f"; {gone} rotated away while verifying (not damage)" if gone else ""))
    if bad:
        raise Failed()
    return EXIT_OK


def cmd_du(args: argparse.Namespace) -> int:
    from ckptsdk.checkpoint.pruning import usage
    from ckptsdk.cli.common import backend

    u = usage.usage(backend(args))
    if args.json:
        emit_json({"command": "du", "url": args.url, **usage.as_dict(u)})
    else:
        print(usage.render(u, args.url))
    return EXIT_OK


def _takes_selector(sp: argparse.ArgumentParser) -> None:
    for action in sp._actions:  # the URL positional ``add`` made: say that it takes a selector
        if action.dest == "url":
            action.metavar = "URL[@STEP]"
            action.help = "checkpoint root, optionally @STEP or @best:METRIC[:min|max] (as export takes)"


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add these commands to the parser (``add(name, help)`` makes a subcommand taking URL)."""
    sp = add("ls", "list checkpoints: step, epoch, size, writer (lease epoch/attempt), valid or why not, kept by")
    add_rule_flags(sp)
    sp.set_defaults(fn=cmd_ls)
    sp = add("show", "show a checkpoint's manifest and tensor table (newest valid one by default)")
    _takes_selector(sp)
    sp.add_argument("--step", type=int, help="which step, as URL@STEP (default: the newest valid checkpoint)")
    sp.set_defaults(fn=cmd_show)
    sp = add("verify", "re-hash checkpoint files against their manifests; exit 1 on any corruption")
    _takes_selector(sp)
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--all", action="store_true", help="re-hash every committed checkpoint (default: the newest)")
    group.add_argument("--step", type=int, help="re-hash the checkpoint(s) of this step, as URL@STEP")
    sp.set_defaults(fn=cmd_verify)
    add("du", "bytes held: committed, anchor, duplicate, uncommitted, orphaned; Drive trash estimate").set_defaults(
        fn=cmd_du
    )
