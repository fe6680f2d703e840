"""``ckptsdk audit``: did a resumed run continue the same run? Compares the steps attempts logged.

The comparison is :func:`ckptsdk.runlog.audit.audit`'s and the plot :mod:`ckptsdk.runlog.plot`'s; this module
parses, calls and formats (``--strict`` turns a DIVERGED or an unverified verdict into exit 1,
saying why: a run that proved nothing must not pass a script's check).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable

from ckptsdk.cli.common import EXIT_OK, Failed, UsageError, backend, emit_json, fmt_float, require_root, table

logger = logging.getLogger(__name__)

__all__ = ["cmd_audit", "register"]


def cmd_audit(args: argparse.Namespace) -> int:
    from ckptsdk.runlog.audit import audit

    if args.tolerance < 0 or not math.isfinite(args.tolerance):
        raise UsageError(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    store = backend(args)
    require_root(store, args.url)
    report = audit(store, tolerance=args.tolerance, series=bool(args.plot))  # series: the plot's points
    plot_path = None
    if args.plot:
        from ckptsdk.runlog.plot import plot_audit

        if report.series:
            plot_path = plot_audit(report, args.plot)
        else:
            logger.warning("nothing logged under %s/runlog/: no plot written", args.url)
    if args.json:
        doc = {
            "command": "audit",
            "url": args.url,
            "ok": report.ok,
            "verified": report.verified,
            "plot": plot_path,
            "report": json.loads(report.model_dump_json()),
        }
        emit_json(doc)
    else:
        print(f"audit of {args.url}: {report.verdict}")
        if report.attempts:
            print()
            print(
                table(
                    [
                        [
                            a.attempt,
                            a.lease_epoch,
                            a.host,
                            a.device,
                            a.steps,
                            a.first_step,
                            a.last_step,
                            a.resumed_from_step if a.resumed_from_step is not None else "start",
                            "yes" if a.closed else "no",
                        ]
                        for a in report.attempts
                    ],
                    ["ATTEMPT", "EPOCH", "HOST", "DEVICE", "STEPS", "FIRST", "LAST", "RESUMED FROM", "CLOSED"],
                )
            )
        print()
        if report.overlaps:
            for o in report.overlaps:
                print(
                    f"steps logged by attempts {', '.join(map(str, o.attempts))}: {o.first_step}..{o.last_step} "
                    f"({o.steps} steps)"
                )
            print()
            print(
                table(
                    [[n, fmt_float(d.max_abs_diff), d.at_step, d.compared_steps] for n, d in report.scalars.items()],
                    ["SCALAR", "MAX |DIFF|", "AT STEP", "COMPARED"],
                )
            )
            for name, n in report.data_compared.items():
                print(f"data digest {name}: compared at {n} step{'' if n == 1 else 's'}")
            if report.first_divergence is not None:
                d = report.first_divergence
                vals = ", ".join(f"attempt {a}: {v!r}" for a, v in d.values.items())
                kind = "the data differs" if d.in_data else "the values differ"
                print(f"\nfirst divergence: step {d.step}, {d.scalar} ({kind}): {vals}")
        else:
            print(f"unverified: {report.unverified_reason}")
        for w in report.warnings:
            print(f"warning: {w}")
        if plot_path:
            print(f"plot written to {plot_path}")
    if args.strict and not report.ok:
        logger.error("audit --strict: %s: the resumed run did not repeat the killed attempt's steps", report.verdict)
        raise Failed()
    if args.strict and not report.verified:
        logger.error("audit --strict: unverified, nothing was compared: %s", report.unverified_reason)
        raise Failed()
    return EXIT_OK


def register(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add this command to the parser (``add(name, help)`` makes a subcommand taking URL)."""
    sp = add("audit", "compare the steps logged by several attempts (did the resume continue the same run?)")
    sp.add_argument(
        "--strict", action="store_true", help="exit 1 when the verdict is DIVERGED or unverified (nothing compared)"
    )
    sp.add_argument("--tolerance", type=float, default=0.0, help="largest |difference| accepted (default 0: bit-exact)")
    sp.add_argument("--plot", metavar="FILE.png", help="draw loss over steps by attempt (needs the 'plot' extra)")
    sp.set_defaults(fn=cmd_audit)
