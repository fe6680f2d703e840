"""``ckptsdk lease`` and ``gc``: the two commands that can change a root (``--break``, deletes).

``lease`` shows the writer lease and, confirmed, breaks it; ``gc`` removes what the keep rules
and the lineage let go (``--dry-run`` only lists it). The keep rules ``gc`` and ``ls`` judge by
live here too: the writer's, as the root's newest checkpoint records them, or the flags instead
(:func:`rules_in_force`). The rules themselves are :mod:`ckptsdk.lease.acquire`'s and
:mod:`ckptsdk.checkpoint.retention`'s; this module parses, calls and formats.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
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
    from ckptsdk.checkpoint.reading.catalog import Catalog
    from ckptsdk.checkpoint.retention import Rule
    from ckptsdk.lease.acquire import LeaseRecord

__all__ = [
    "MANAGER_KEEP_LAST",
    "InForce",
    "add_rule_flags",
    "cmd_gc",
    "cmd_lease",
    "register",
    "rules_from_args",
    "rules_in_force",
]

#: ``gc``'s default ``--keep-last``: CheckpointManager's default keep_last (a test holds them equal).
MANAGER_KEEP_LAST = 3


def add_rule_flags(sp: argparse.ArgumentParser) -> None:
    """The keep-rule flags of ``gc`` and ``ls``: rules as ``CheckpointManager`` takes them, instead of the writer's."""
    sp.add_argument(
        "--keep-last",
        type=int,
        help=f"checkpoints to keep (with any rule flag: default {MANAGER_KEEP_LAST}; without any: the rules the writer "
        "recorded in the root)",
    )
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


@dataclass(frozen=True)
class InForce:
    """The keep rules a command judges by (``keep_last`` plus ``rules``), and where they come from.

    Attributes:
        keep_last: the latest-N rule.
        rules: the others; an :class:`~ckptsdk.checkpoint.retention.Unjudged` one keeps everything.
        source: ``"writer"`` (recorded in ``key``'s manifest), ``"flags"``, ``"unrecorded"`` (the
            writer's are not recorded: nothing is let go) or ``"default"`` (nothing committed
            yet, or ``--force`` over an unrecorded root: the manager's default).
        key: the checkpoint folder whose manifest records the writer's rules, if one does.
        writer: the writer's recorded rules, to judge with (None: not recorded).
        notes: what the user must be told (on stderr), one line each.
    """

    keep_last: int
    rules: list[Rule]
    source: str
    key: str | None = None
    writer: list[Rule] | None = None
    notes: list[str] = field(default_factory=list)

    def said(self) -> str:
        """The rules judged by, as a user writes them."""
        from ckptsdk.checkpoint.retention import describe_rules, keep_last

        return describe_rules([keep_last(self.keep_last), *self.rules])

    def origin(self) -> str:
        """Where the rules come from, for the human output."""
        return {
            "writer": f"the writer's, recorded in {self.key}/manifest.json",
            "flags": "given as flags",
            "unrecorded": "the writer's are not recorded: nothing is let go by retention",
            "default": "the manager's default",
        }[self.source]


_HOW = "pass the writer's rules as flags (--keep-last N, --keep-every K, --keep-best K --metric NAME...)"


def rules_in_force(args: argparse.Namespace, cat: Catalog, *, force: bool = False) -> InForce:
    """The keep rules ``gc`` / ``ls`` judge ``cat`` by: the flags if any, else the writer's.

    The writer's are those the governing checkpoint's manifest records
    (:func:`ckptsdk.checkpoint.pruning.recorded.governing`). What cannot be judged here never lets
    anything go: a custom rule (a predicate) keeps every checkpoint, and so does a root whose
    manifests record no rules (written before they were recorded), unless ``force``: then the
    custom rules are left out, or the manager's default ``keep_last=3`` applies.

    Raises:
        UsageError: the flags are inconsistent (:func:`rules_from_args`).
    """
    from ckptsdk.checkpoint import retention
    from ckptsdk.checkpoint.pruning.recorded import UNRECORDED, split_keep_last, writer_rules

    keep_last, flagged = rules_from_args(args)
    source, writer = writer_rules(cat)
    record = source.manifest.keep if source is not None and source.manifest is not None else None
    key = source.key if source is not None else None
    if keep_last is not None or flagged:
        n = keep_last or MANAGER_KEEP_LAST
        given = [retention.keep_last(n), *flagged]
        notes = []
        if record is not None and writer is not None and not retention.same_rules(retention.record(given), record):
            notes.append(
                f"the rules given ({retention.describe_rules(given)}) differ from the writer's "
                f"({retention.describe_rules(writer)}, recorded in {key}): judging by the rules given"
            )
        return InForce(n, flagged, "flags", key, writer, notes)
    if writer is None:
        if source is None:  # nothing committed: nothing to judge, nothing to say
            return InForce(MANAGER_KEEP_LAST, [], "default")
        if force:
            note = f"--force: the writer's keep rules are not recorded under {args.url}; judging by keep_last=3"
            return InForce(MANAGER_KEEP_LAST, [], "default", key, None, [note])
        note = (
            f"the writer's keep rules are not recorded under {args.url} (its newest checkpoint, {key}, "
            f"format 1.1 or older, from before they were recorded): no checkpoint is let go by retention; {_HOW}, "
            "or `gc --force` to apply the manager's default keep_last=3"
        )
        return InForce(MANAGER_KEEP_LAST, [retention.Unjudged(UNRECORDED)], "unrecorded", key, None, [note])
    n, rest = split_keep_last(writer)
    custom = [r for r in rest if isinstance(r, retention.Unjudged)]
    if not custom:
        return InForce(n, rest, "writer", key, writer)
    names = ", ".join(r.what for r in custom)
    if force:
        note = f"--force: judging without the writer's {names}: it may keep what is deleted"
        return InForce(n, [r for r in rest if r not in custom], "writer", key, writer, [note])
    note = (
        f"the writer's keep rules include {names}, which only the writer can judge: no checkpoint is "
        f"let go by retention; {_HOW}, or `gc --force` to judge without it"
    )
    return InForce(n, rest, "writer", key, writer, [note])


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


def _say(notes: list[str]) -> None:
    for note in notes:
        sys.stderr.write(f"ckptsdk: {note}\n")


def cmd_gc(args: argparse.Namespace) -> int:
    rules_from_args(args)  # a bad flag is a usage error before anything is read
    from ckptsdk.checkpoint import retention
    from ckptsdk.checkpoint.pruning.recorded import split_keep_last
    from ckptsdk.checkpoint.pruning.rotation import Rotation, kept
    from ckptsdk.checkpoint.reading.catalog import scan

    mgr = reader(args)
    require_root(mgr.backend, args.url)
    cat = scan(mgr.backend)
    in_force = rules_in_force(args, cat, force=args.force)
    # What CheckpointManager.gc runs, without the manager's torch import. The retention mode
    # only words a Drive warning here: gc deletes, it never recycles.
    rotation = Rotation(mgr.backend, keep_last=in_force.keep_last, keep_every=None)
    options: dict[str, Any] = {} if args.grace is None else {"grace": args.grace}
    report = rotation.gc(cat, keep_last=in_force.keep_last, rules=in_force.rules, dry_run=args.dry_run, **options)
    deleted, reasons, sizes = list(report.deleted), dict(report.reasons), dict(report.sizes)
    notes = list(in_force.notes)
    if in_force.source == "flags" and in_force.writer is not None:
        # What the flags let go that the writer's own rules keep: say which, by name.
        n, rest = split_keep_last(in_force.writer)
        writer_keeps = kept(cat, [retention.keep_last(n), *rest], settle=rotation.late)
        lost = [c.key for c in cat.checkpoints if c.key in reasons and c.valid and c.step in writer_keeps]
        if lost:
            verb = "would delete" if args.dry_run else "deleted"
            notes.append(f"gc {verb} {len(lost)} checkpoint(s) the writer's rules keep: {', '.join(lost)}")
    if report.spared:
        notes.append(
            f"gc leaves {len(report.spared)} checkpoint(s) written by a newer ckptsdk alone, and every shared "
            f"file they may use: {', '.join(sorted(report.spared))}; upgrade ckptsdk to judge them"
        )
    _say(notes)
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
                "spared": report.spared,
                "rules": in_force.said(),
                "rules_from": in_force.source,
                "notes": notes,
            }
        )
        return EXIT_OK
    verb = "would delete" if args.dry_run else "deleted"
    judged = f"keep rules: {in_force.said()} ({in_force.origin()})"
    if not deleted:
        print(f"nothing to delete under {args.url}\n{judged}")
        return EXIT_OK
    print(table([[k, human_size(sizes.get(k)), reasons.get(k, "")] for k in deleted], ["KEY", "SIZE", "WHY"]))
    print(f"\n{verb} {len(deleted)} item(s) under {args.url}" + (" (dry run: nothing deleted)" if args.dry_run else ""))
    print(judged)
    if report.trash_bytes is not None:
        from ckptsdk.checkpoint.pruning import usage

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
    sp = add(
        "gc",
        "delete what the writer's keep rules (recorded in the root) or the rule flags let go, orphans of "
        "superseded writers and crashed leftovers",
    )
    add_rule_flags(sp)
    sp.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    sp.add_argument(
        "--force",
        action="store_true",
        help="judge by what can be judged here: the writer's rules without its custom ones (predicates), "
        f"or keep_last={MANAGER_KEEP_LAST} where the root records no rules",
    )
    sp.add_argument("--grace", type=float, help="seconds a crashed write's leftovers must be old to go")
    sp.set_defaults(fn=cmd_gc)
