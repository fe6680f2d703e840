"""``ckptsdk lease`` and ``gc``: the two commands that can change a root (``--break``, deletes).

``lease`` shows the writer lease and, confirmed, breaks it; ``gc`` removes what the keep rules
and the lineage let go (``--dry-run`` only lists it); the keep-rule flags ``ls`` shares live here.
The rules themselves are :mod:`ckptsdk.lease.acquire`'s and :mod:`ckptsdk.checkpoint.retention`'s;
this module parses, calls and formats.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ckptsdk.cli.common import (
    EXIT_OK,
    UsageError,
    backend,
    emit_json,
    human_size,
    parse_wall,
    reader,
    require_root,
    table,
)
from ckptsdk.errors import LeaseError

if TYPE_CHECKING:
    from ckptsdk.checkpoint.retention import Rule
    from ckptsdk.lease.acquire import LeaseRecord

__all__ = ["MANAGER_KEEP_LAST", "add_rule_flags", "cmd_gc", "cmd_lease", "register", "rules_from_args"]

#: ``gc``'s default ``--keep-last``: CheckpointManager's default keep_last (a test holds them equal).
MANAGER_KEEP_LAST = 3


def add_rule_flags(sp: argparse.ArgumentParser) -> None:
    """The keep-rule flags of ``gc`` and ``ls``: the writer's rules, as ``CheckpointManager`` takes them."""
    sp.add_argument("--keep-last", type=int, help=f"checkpoints to keep (default: the manager's, {MANAGER_KEEP_LAST})")
    sp.add_argument("--keep-every", type=int, metavar="K", help="also keep every step that is a multiple of K")
    sp.add_argument(
        "--keep-every-seconds",
        type=float,
        metavar="T",
        help="also keep checkpoints T seconds apart, by their manifests' times",
    )
    sp.add_argument("--keep-best", type=int, metavar="K", help="also keep the K best by --metric")
    sp.add_argument("--metric", help="the metric --keep-best ranks (a name the saves passed in metrics)")
    sp.add_argument(
        "--mode",
        choices=("min", "max"),
        help="which way --metric is better (default: min for a name ending in 'loss', else max)",
    )


def rules_from_args(args: argparse.Namespace) -> tuple[int | None, list[Rule]]:
    """``--keep-last`` and the other rules the flags ask for, checked.

    Raises:
        UsageError: a count below 1, ``--keep-best`` without ``--metric`` or the reverse.
    """
    from ckptsdk.checkpoint import retention

    for flag in ("keep_last", "keep_every", "keep_best"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            what = " (the newest checkpoint is always kept)" if flag == "keep_last" else ""
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1{what}, got {value}")
    if (args.keep_best is None) != (args.metric is None):
        raise UsageError("--keep-best K and --metric NAME go together (e.g. --keep-best 2 --metric val_loss)")
    if args.mode is not None and args.metric is None:
        raise UsageError("--mode says which way --metric is better: give --keep-best K --metric NAME with it")
    rules: list[Rule] = []
    if args.keep_every is not None:
        rules.append(retention.keep_every(args.keep_every))
    if args.keep_every_seconds is not None:
        if not args.keep_every_seconds > 0:
            raise UsageError(f"--keep-every-seconds must be > 0, got {args.keep_every_seconds}")
        rules.append(retention.keep_every_seconds(args.keep_every_seconds))
    if args.keep_best is not None:
        rules.append(retention.keep_best(args.metric, args.keep_best, args.mode))
    return args.keep_last, rules


def _lease_doc(record: LeaseRecord) -> dict[str, Any]:
    renewed = parse_wall(record.renewed_at)
    age = (datetime.now(UTC) - renewed).total_seconds() if renewed else None
    if record.released:
        state = "released"
    elif age is not None and age > record.ttl:
        state = "stale"
    else:
        state = "held"
    return {"record": json.loads(record.to_json()), "age_s": None if age is None else round(age, 1), "state": state}


def cmd_lease(args: argparse.Namespace) -> int:
    from ckptsdk.lease.acquire import Lease, read_lease

    if args.break_lease and not args.yes_i_am_sure:
        raise UsageError(
            "--break takes over the lease and fences its holder (a live writer then stops with "
            "LeaseLostError at its next save); add --yes-i-am-sure to do it"
        )
    store = backend(args)
    unreadable = None
    try:
        record = read_lease(store)
    except LeaseError as exc:  # garbage, empty, a newer format: only --break can get past it
        if not args.break_lease:
            raise
        record, unreadable = None, str(exc)
    broken: dict[str, Any] | None = None
    if args.break_lease and (unreadable or (record is not None and not record.released)):
        if not store.capabilities.immediately_consistent:
            sys.stderr.write(
                "ckptsdk: breaking the lease; on this store the takeover waits a settle "
                "time (about a minute) before it is confirmed\n"
            )
        lease = Lease(store, force=True, run_id=record.run_id if record is not None else None)
        lease.acquire()  # a new epoch: the old holder is fenced from its next renewal on
        lease.release()  # ...and the lease is left free for the next writer
        broken = (
            {"epoch": record.epoch, "holder": record.holder.model_dump(mode="json")}
            if record
            else {"epoch": None, "holder": {"host": "?", "pid": None}, "unreadable": unreadable}
        )
        record = read_lease(store)
    doc = {"command": "lease", "url": args.url, "lease": _lease_doc(record) if record else None, "broken": broken}
    if args.json:
        emit_json(doc)
        return EXIT_OK
    if broken is not None and unreadable:
        print(f"broke an unreadable lease ({unreadable}); the lease is free")
    elif broken is not None:
        print(
            f"broke the lease of host {broken['holder']['host']!r} pid {broken['holder']['pid']} (epoch "
            f"{broken['epoch']}); it is fenced and the lease is free"
        )
    elif args.break_lease:
        print("nothing to break: " + ("no lease" if record is None else "the lease is already released"))
    if record is None:
        print(f"no lease under {args.url}: no writer has opened this root")
        return EXIT_OK
    d = doc["lease"]
    assert d is not None
    age = d["age_s"]
    print(f"lease of {args.url}: {d['state']}")
    print(f"  holder    host {record.holder.host!r} pid {record.holder.pid}")
    print(f"  run       {record.run_id}, attempt {record.attempt}, epoch {record.epoch}")
    print(f"  acquired  {record.acquired_at} (holder's clock)")
    print(f"  renewed   {record.renewed_at} (holder's clock), {record.renewals} renewals, ttl {record.ttl:g} s")
    if age is not None:
        print(
            f"  age       {age:.0f} s since the last renewal, as this machine's clock reads it "
            "(clocks of two machines can disagree)"
        )
    if d["state"] == "stale":
        print(
            "  the holder looks dead; a new writer takes over after watching the lease for one ttl, "
            "or at once with `ckptsdk lease URL --break --yes-i-am-sure`"
        )
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    keep_last, rules = rules_from_args(args)
    from ckptsdk.checkpoint.catalog import scan
    from ckptsdk.checkpoint.rotation import Rotation

    mgr = reader(args)
    require_root(mgr.backend, args.url)
    # What CheckpointManager.gc runs, without the manager's torch import. The retention mode
    # only words a Drive warning here: gc deletes, it never recycles.
    rotation = Rotation(mgr.backend, keep_last=MANAGER_KEEP_LAST, keep_every=None)
    cat = scan(mgr.backend)
    if args.grace is not None:
        report = rotation.gc(cat, keep_last=keep_last, rules=rules, dry_run=args.dry_run, grace=args.grace)
    else:
        report = rotation.gc(cat, keep_last=keep_last, rules=rules, dry_run=args.dry_run)
    deleted, reasons, sizes = list(report.deleted), dict(report.reasons), dict(report.sizes)
    if args.json:
        emit_json(
            {
                "command": "gc",
                "url": args.url,
                "dry_run": args.dry_run,
                "deleted": deleted,
                "reasons": reasons,
                "sizes": sizes,
                "trash_bytes": report.trash_bytes,
            }
        )
        return EXIT_OK
    verb = "would delete" if args.dry_run else "deleted"
    if not deleted:
        print(f"nothing to delete under {args.url}")
        return EXIT_OK
    print(table([[k, human_size(sizes.get(k)), reasons.get(k, "")] for k in deleted], ["KEY", "SIZE", "WHY"]))
    print(f"\n{verb} {len(deleted)} item(s) under {args.url}" + (" (dry run: nothing deleted)" if args.dry_run else ""))
    if report.trash_bytes is not None:
        from ckptsdk.checkpoint import usage

        print(usage.trash_note(report.trash_bytes, mgr.backend))
    return EXIT_OK


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add these commands to the parser (``add(name, help)`` makes a subcommand taking URL)."""
    sp = add("lease", "show the writer lease: holder, epoch, age; --break to free it")
    sp.add_argument(
        "--break",
        dest="break_lease",
        action="store_true",
        help="take the lease over (fencing its holder) and release it",
    )
    sp.add_argument("--yes-i-am-sure", action="store_true", help="confirm --break")
    sp.set_defaults(fn=cmd_lease)
    sp = add("gc", "delete what no keep rule keeps, orphans of superseded writers and crashed leftovers")
    add_rule_flags(sp)
    sp.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    sp.add_argument("--grace", type=float, help="seconds a crashed write's leftovers must be old to go")
    sp.set_defaults(fn=cmd_gc)
