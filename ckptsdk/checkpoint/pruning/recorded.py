"""The writer's keep rules as the root records them, for every judge that is not the writer.

Each manifest records its writer's rules (its ``keep`` field, format 1.2). A judge that is not
that writer (``ckptsdk gc`` / ``ls``, a read-only ``CheckpointManager``'s ``gc()`` / ``kept()``)
must reach the writer's decision, never a default of its own: a default ``keep_last=3`` would
delete the best checkpoints a ``keep_best`` rule keeps. What cannot be judged here (a predicate,
recorded by name only; a root written before the rules were recorded) lets nothing go. The
wording of the CLI's notes is cli/admin.py's; the rules themselves are retention.py's. Here too:
:class:`KeepDecisions`, behind ``CheckpointManager``'s ``gc()``, ``kept()`` and ``rules()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ckptsdk.checkpoint import retention
from ckptsdk.checkpoint.pruning.rotation import GcReport, Rotation
from ckptsdk.checkpoint.pruning.rotation import kept as _kept
from ckptsdk.checkpoint.reading.catalog import Catalog, CheckpointInfo
from ckptsdk.checkpoint.retention import Rule, describe_rules

__all__ = ["KeepDecisions", "governing", "judge_rules", "split_keep_last", "writer_rules"]

logger = logging.getLogger(__name__)

#: The rule that stands for a writer's rules a root does not record.
UNRECORDED = "the writer's rules, not recorded"


def governing(cat: Catalog) -> CheckpointInfo | None:
    """The checkpoint whose recorded keep rules govern the root: the newest committed one whose
    manifest reads, the highest writer's among copies of a step, never a zombie's orphan.

    A takeover's anchor (re-committed at its restore) carries the new writer's rules; until then
    the previous writer's checkpoints (and rules) are the newest. A checkpoint still uploading (its
    files short) counts: its manifest, checksum-verified, says what its writer keeps.
    """
    found = [c for c in cat.checkpoints if c.committed and not c.orphan and c.manifest is not None]
    return max(found, key=lambda c: (c.step, c.rank), default=None)


def writer_rules(cat: Catalog) -> tuple[CheckpointInfo | None, list[Rule] | None]:
    """(the governing checkpoint, its writer's rules); rules None where its manifest records none."""
    source = governing(cat)
    record = source.manifest.keep if source is not None and source.manifest is not None else None
    return source, (retention.rules_of(record) if record is not None else None)


def split_keep_last(rules: Sequence[Rule]) -> tuple[int, list[Rule]]:
    """(the first latest-N count, the other rules); 1 when none (the newest is kept anyway)."""
    first = next((r for r in rules if isinstance(r, retention.KeepLast)), None)
    return (first.n if first is not None else 1), [r for r in rules if r is not first]


def judge_rules(
    cat: Catalog, keep_last: int | None, keep: Sequence[Rule] | None, *, url: str
) -> tuple[int | None, Sequence[Rule] | None]:
    """The rules a judge given none of its own applies to ``cat``: the writer's, as recorded.

    Rules given (``keep_last`` or ``keep``) are returned as they are. Else the governing
    checkpoint's recorded rules; a custom rule among them, or a root that records none, keeps
    every checkpoint (an :class:`~ckptsdk.checkpoint.retention.Unjudged` rule) and a warning says
    how to judge anyway. Nothing committed: (None, None), the defaults (there is nothing to judge).
    """
    if keep_last is not None or keep is not None:
        return keep_last, keep
    source, rules = writer_rules(cat)
    if source is None:
        return None, None
    how = "pass the writer's rules (gc(keep_last=..., keep=[...]))"
    if rules is None:
        logger.warning(
            "the writer's keep rules are not recorded under %s (its newest checkpoint, %s, is format 1.1 or "
            "older): no checkpoint is let go by retention; %s",
            url,
            source.key,
            how,
        )
        return 1, [retention.Unjudged(UNRECORDED)]
    n, rest = split_keep_last(rules)
    custom = [r.what for r in rest if isinstance(r, retention.Unjudged)]
    if custom:
        logger.warning(
            "the writer's keep rules under %s include %s, which only the writer can judge: no checkpoint is "
            "let go by retention; %s",
            url,
            ", ".join(custom),
            how,
        )
    return n, rest


class KeepDecisions:
    """``CheckpointManager``'s keep decisions: by the rules given to a call, else the writer's own
    (a writer), else the writer's as the root records them (a reader opened with no rules).

    Args:
        url: the root (for messages).
        rotation: the manager's rotation (its rules, gc).
        scan: lists the root (the manager's, which lets its own save finish first).
        by_record: judge by the rules the root records (a read-only manager given no keep rule).
    """

    def __init__(self, url: str, rotation: Rotation, scan: Callable[[], Catalog], *, by_record: bool) -> None:
        self.url = url
        self._rotation = rotation
        self._scan = scan
        self._by_record = by_record

    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep: Sequence[Rule] | None = None,
        dry_run: bool = False,
        grace: float = 3600.0,
    ) -> GcReport:
        """Remove orphans of superseded writers, torn checkpoints and rotated-out checkpoints.

        See :meth:`ckptsdk.checkpoint.pruning.rotation.Rotation.gc`: works without the lease, keeps what
        the rules keep (this manager's, or ``keep_last`` / ``keep`` instead), sweeps temp files
        older than ``grace`` seconds.
        """
        cat = self._scan()
        keep_last, keep = self._judged_by(cat, keep_last, keep)
        return self._rotation.gc(cat, keep_last=keep_last, rules=keep, dry_run=dry_run, grace=grace)

    def kept(self, *, keep_last: int | None = None, keep: Sequence[Rule] | None = None) -> dict[int, tuple[str, ...]]:
        """Each step the keep rules keep, with why (``latest``, ``best val_loss #1``, ``resume point``).

        Decided from the committed manifests as rotation and :meth:`gc` decide; a step missing
        here is one they let go. ``keep_last`` / ``keep``: instead of this manager's, as for gc.
        """
        cat = self._scan()
        rules = self._rotation.retention_rules(*self._judged_by(cat, keep_last, keep))
        return _kept(cat, rules, settle=self._rotation.late)

    def rules(self, *, keep_last: int | None = None, keep: Sequence[Rule] | None = None) -> str:
        """The keep rules in force, as written (``keep_last=3, keep_best=2 by val_loss (min)``)."""
        judged = self._judged_by(self._scan(), keep_last, keep) if self._by_record else (keep_last, keep)
        return describe_rules(self._rotation.retention_rules(*judged))

    def _judged_by(
        self, cat: Catalog, keep_last: int | None, keep: Sequence[Rule] | None
    ) -> tuple[int | None, Sequence[Rule] | None]:
        """The rules gc()/kept() judge by: the ones given; else this writer's; else (a reader given
        none) the writer's as recorded in the root, never a default that could delete what they keep."""
        return judge_rules(cat, keep_last, keep, url=self.url) if self._by_record else (keep_last, keep)
