"""Reading a checkpoint root: which checkpoint a step names, its tree (verified), verify (ResumePoint: resume.py).

:class:`CheckpointReader` is the read half of :class:`~ckptsdk.CheckpointManager` (all a
``read_only`` manager does): the listing, the newest restorable checkpoint with fallback past
damage, the best one by a metric, and the one re-hash of a checkpoint's files that ``verify()``
and ``ckptsdk verify`` both use (:meth:`CheckpointReader.check`).
The lease, saving and restore's lineage live elsewhere.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, Protocol

from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading import catalog as _catalog
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo
from ckptsdk.checkpoint.reading.listing import VANISHED
from ckptsdk.checkpoint.reading.outline import Outline
from ckptsdk.checkpoint.reading.resume import MetricValue, ResumePoint, resume_point
from ckptsdk.checkpoint.retention import Candidate, Mode, best_order, default_mode
from ckptsdk.errors import (
    ConfigError,
    CorruptCheckpointError,
    ManifestError,
    NewerFormatError,
    NoValidCheckpointError,
    StateMismatchError,
)
from ckptsdk.format.files.hashedread import verify_file
from ckptsdk.format.layout import MANIFEST, TENSORS
from ckptsdk.format.manifest import FileEntry, Manifest, SharedFile

logger = logging.getLogger(__name__)

__all__ = ["CheckpointReader", "LiveTarget", "MetricValue", "ResumePoint", "Verdict", "resume_point"]

#: What :meth:`CheckpointReader.check` found in one checkpoint folder.
Status = Literal["ok", "orphan", "uncommitted", "gone", "CORRUPT"]


class LiveTarget(Protocol):
    """What a restore reads straight into (``TrainState`` is one): see :meth:`CheckpointReader.read_tree`."""

    def live_tensors(self) -> Mapping[str, Any]:
        """Tensor path -> a live CPU tensor (detached, floating point) to fill in place."""
        ...

    def tensors_at(self, paths: Collection[str]) -> Mapping[str, Any]:
        """Path -> the live tensor there (any device and dtype, never copied), for the ``paths``
        the live state holds: a checkpoint's referenced base is proven on these."""
        ...

    def check_fit(self, tree: Any, *, strict: bool = True) -> None:
        """Raise ``StateMismatchError`` unless ``tree`` (its structure; no value read yet) fits
        (``strict=False``: objects and module keys on one side only are left out)."""
        ...


@dataclass(frozen=True)
class Verdict:
    """One checkpoint folder after :meth:`CheckpointReader.check`.

    Attributes:
        status: ``"ok"``; ``"orphan"`` (intact, of a superseded writer: never restored, ``gc``
            removes it); ``"uncommitted"`` (a save in progress or killed: not a checkpoint, never
            a failure); ``"gone"`` (its manifest vanished while it was checked: a writer's rotation
            or ``gc`` deleted it, never a failure); ``"CORRUPT"`` (torn, unreadable manifest, or
            a file failing its digest).
        reason: why it is not ``"ok"`` (None when it is).
        rehashed: whether its bytes were read and hashed (a torn folder is judged by its listing).
        unchecked: what the re-hash could not check (tensors recorded by reference, whose bytes
            only a live base has), or None.
    """

    status: Status
    reason: str | None
    rehashed: bool
    unchecked: str | None = None


class CheckpointReader:
    """The checkpoints under one root, read-only: listing, picking, reading verified, verifying.

    Args:
        backend: the opened root.
        judge: who judges the root's lineage records, asked at each listing (None: a reader,
            which judges by ``LEASE.json`` as it is now; a writer judges by the lease it took
            over from).
        before_listing: called before each full listing (a writer lets its own save on the
            worker finish first, so the listing sees its rotation).

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> CheckpointReader(open_backend("memory://reader-doc")).latest() is None
        True
    """

    def __init__(
        self,
        backend: Backend,
        *,
        judge: Callable[[], _catalog.Judge | None] | None = None,
        before_listing: Callable[[], None] | None = None,
    ) -> None:
        self.backend = backend
        self.url = backend.url
        self._judge = judge or (lambda: None)
        self._before_listing = before_listing
        # Parsed manifests by (key, version): a rescan re-reads only what changed.
        self.memo: dict[tuple[str, str], object] = {}

    def scan(self) -> _catalog.Catalog:
        """Every checkpoint of the root, its manifest read (memoised by version)."""
        if self._before_listing is not None:
            self._before_listing()
        return _catalog.scan(self.backend, cache=self.memo, judge=self._judge())

    def outline(self) -> Outline:
        """One listing of the root, its manifests read only as the caller walks them (restore,
        ``latest``, opening a writer); :meth:`list` and the rest read every manifest."""
        return Outline(self.backend, cache=self.memo, judge=self._judge())

    # ------------------------------------------------------------------ the read API

    def list(self) -> builtins.list[CheckpointInfo]:  # `list`: this method, in the class
        """One row per step, oldest first (valid or not, with why): the highest writer's folder
        of the step, its other folders in ``copies``, a takeover's re-commit marked ``anchor``."""
        return self.scan().rows()

    def latest(self) -> CheckpointInfo | None:
        """The newest restorable checkpoint (sizes checked, digests not yet), or None.

        Reads the manifests of the newest folders only, down to the first valid one."""
        return self.outline().newest_valid()

    def best(self, metric: str, mode: Mode | None = None) -> CheckpointInfo | None:
        """The restorable checkpoint with the best ``metric``, or None when none holds it.

        Judged from the committed manifests, as ``keep_best`` judges: NaN/inf are never best, a
        checkpoint without the metric is not a candidate, a tie goes to the older step, and a
        zombie's orphans are never candidates (they are not restorable).

        Args:
            metric: a name the saves passed in ``metrics``.
            mode: ``"min"`` or ``"max"``; None: :func:`~ckptsdk.checkpoint.retention.default_mode`
                (``min`` for a name ending in ``loss``).

        Example:
            >>> from ckptsdk import CheckpointManager, TrainState
            >>> import torch
            >>> with CheckpointManager("memory://best-doc") as mgr:
            ...     state = TrainState(model=torch.nn.Linear(1, 1))
            ...     for step, loss in ((10, 0.5), (20, 0.2), (30, float("nan"))):
            ...         _ = mgr.save(state, step=step, metrics={"val_loss": loss})
            ...     mgr.best("val_loss").step
            20
        """
        rows = {c.step: c for c in self.scan().rows() if c.valid and c.manifest is not None}
        order = best_order(
            (Candidate.of(c.manifest) for c in rows.values() if c.manifest), metric, mode or default_mode(metric)
        )
        return rows[order[0].step] if order else None

    def load_manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (newest restorable if None)."""
        return self.pick(step).manifest  # type: ignore[return-value]  # pick never returns one without

    def load(self, step: int | None = None) -> Any:
        """The raw state tree of a checkpoint (newest restorable one if ``step`` is None), verified.

        Returns:
            The decoded tree (nested dicts, lists, tensors and JSON values, as it was saved).

        Raises:
            NoValidCheckpointError: no checkpoint of that step (or none at all) can be read.
            CorruptCheckpointError: a given ``step`` fails its digest check.
        """
        if step is not None:
            return self.read_tree(self.pick(step))
        return self.read_newest()[0]

    def verify(self, step: int | None = None, *, key: str | None = None) -> CheckpointInfo:
        """Re-hash a checkpoint's files against its manifest; raise ``CorruptCheckpointError``.

        Args:
            step: the step to check (the newest restorable one if None and no ``key``).
            key: one checkpoint folder (``step-0000000040.e2``), when several lease epochs hold
                the same step (a takeover re-commits its resume point under its own epoch).

        Returns:
            The checkpoint checked.
        """
        info = self.pick(step, key=key)
        self._rehash(info)
        return info

    def check(self, info: CheckpointInfo) -> Verdict:
        """The verdict on one checkpoint folder of :meth:`list` (``ckptsdk verify`` prints these).

        A committed folder is re-hashed (an orphan too: it says whether ``gc`` removes an intact
        one); a torn one is CORRUPT by its listing; an uncommitted one is never a failure.
        """
        if not info.committed:
            return Verdict("uncommitted", info.reason, rehashed=False)
        if info.manifest is None or (not info.valid and not info.orphan):
            return self._unless_gone(info, Verdict("CORRUPT", info.reason or "invalid", rehashed=False))
        try:
            self._rehash(info)
        except (CorruptCheckpointError, ManifestError) as exc:
            return self._unless_gone(info, Verdict("CORRUPT", str(exc), rehashed=True))
        unchecked = _unchecked(info.manifest)
        if info.orphan:
            return Verdict("orphan", info.reason, rehashed=True, unchecked=unchecked)
        return Verdict("ok", None, rehashed=True, unchecked=unchecked)

    def _unless_gone(self, info: CheckpointInfo, verdict: Verdict) -> Verdict:
        """``verdict``, unless the checkpoint's manifest is gone now: deletion removes the manifest
        first, so a checkpoint a writer rotated away (or ``gc`` removed) while it was listed or
        read looks torn, and is only gone. One stat, on a failure only."""
        if info.reason == VANISHED or not self.backend.exists(f"{info.key}/{MANIFEST}"):
            return Verdict("gone", f"rotated away while verifying (its manifest is gone): {verdict.reason}", False)
        return verdict

    def _rehash(self, info: CheckpointInfo) -> None:
        """The one re-hash of a checkpoint: every file its manifest lists (the shared ones too), size and digest."""
        assert info.manifest is not None
        for key, entry in [(f"{info.key}/{f.name}", f) for f in info.manifest.files] + [
            (f.name, f) for f in info.manifest.shared
        ]:
            try:
                verify_file(self.backend, key, size=entry.size, digest=entry.digest, algorithm=entry.algorithm)
            except ConfigError as exc:  # an algorithm this ckptsdk does not know: unverifiable, never usable
                raise CorruptCheckpointError(
                    f"checkpoint {self.url}/{info.key}: {exc}", url=self.url, step=info.step, key=key
                ) from exc

    # ------------------------------------------------------------------ picking and reading

    def pick(self, step: int | None, *, key: str | None = None) -> CheckpointInfo:
        """The checkpoint a ``key``, a ``step`` or (both None) "the newest restorable" names.

        Returns:
            A checkpoint whose manifest could be read (``manifest`` is set).

        Raises:
            NoValidCheckpointError: nothing readable of that key or step (lists each and why).
        """
        if key is None and step is None:
            outline = self.outline()
            seen = []
            for info in outline.newest_first():
                if info.valid:
                    return info
                seen.append(info)
            raise NoValidCheckpointError(
                f"no valid checkpoint under {self.url}",
                url=self.url,
                tried={c.key: c.reason or "" for c in seen},
            )
        cat = self.scan()
        if key is not None:
            match = next((c for c in cat.checkpoints if c.key == key.rstrip("/")), None)
            if match is None or match.manifest is None:
                why = match.reason if match is not None else "no such checkpoint folder"
                raise NoValidCheckpointError(
                    f"cannot read checkpoint {self.url}/{key}: {why}", url=self.url, tried={key: why or ""}
                )
            return match
        assert step is not None
        found = cat.find(step)
        usable = [c for c in found if c.manifest is not None and not c.orphan]
        if not usable:
            why = "; ".join(f"{c.key}: {c.reason}" for c in found) or "no such step"
            raise NoValidCheckpointError(
                f"no readable checkpoint of step {step} under {self.url} ({why}); `ckptsdk ls URL` lists the steps",
                url=self.url,
                tried={c.key: c.reason or "" for c in found},
            )
        return usable[0]

    def read_newest(
        self,
        accept: Callable[[Any, CheckpointInfo], None] | None = None,
        into: LiveTarget | None = None,
        outline: Outline | None = None,
        *,
        strict: bool = True,
    ) -> tuple[Any, CheckpointInfo]:
        """The newest checkpoint that reads back whole, skipping (and naming) damaged ones.

        ``accept(tree, info)``, when given, is one more check of a candidate that read back
        whole (the distributed manager: every rank's files); raising ``CorruptCheckpointError``
        skips it like a damaged one, before anything (lineage, anchor) is decided from it.

        ``into``: see :meth:`read_tree`. A candidate that failed after its bytes began to fill
        ``into``'s live tensors left them NaN: a later one that restores overwrites them all, and
        the error says so when none does (a half-overwritten model must not train on as fresh).

        ``outline``: a listing of the root to walk instead of a new one (a writer's, taken at open
        once its lease was held).

        ``strict``: False fits ``into`` leaving out what one side holds only (see
        :meth:`read_tree`).

        Raises:
            NoValidCheckpointError: with ``tried`` empty when the root holds no committed
                checkpoint of the live lineage (a fresh start), else listing each and why.
            NewerFormatError: a checkpoint newer than every restorable one was written by a newer
                ckptsdk (a newer major format): never skipped like damage.
            StateMismatchError: a candidate does not fit ``into``.
        """
        # One listing; a manifest is read only when its folder's turn comes (see Outline).
        seen: list[CheckpointInfo] = []
        tried: dict[str, str] = {}
        dirty = False
        for info in (self.outline() if outline is None else outline).newest_first():
            seen.append(info)
            if info.newer and not info.orphan:
                # A newer ckptsdk wrote the run's newest state: restoring an older one past it
                # would silently train on from the past (a mixed-version pair of runtimes).
                raise NewerFormatError(
                    f"checkpoint {self.url}/{info.key} (step {info.step}) was written by a newer ckptsdk "
                    f"({info.reason}); this one will not restore an older checkpoint past it: upgrade "
                    "ckptsdk (pip install -U ckptsdk) where you restore",
                    url=self.url,
                    step=info.step,
                    key=info.key,
                )
            if not info.valid:
                tried[info.key] = info.reason or ""
                if info.committed and not info.orphan:
                    logger.warning("skipping checkpoint %s/%s: %s", self.url, info.key, info.reason)
                else:  # a save in progress, or a superseded writer's leftover: expected
                    logger.info("not restoring %s/%s: %s", self.url, info.key, info.reason)
                continue
            tree = None
            filled = _Filled()
            try:
                tree = self._read_tree(info, into, filled, strict=strict)
                if accept is not None:
                    accept(tree, info)
                return tree, info
            except (CorruptCheckpointError, ManifestError) as exc:
                logger.warning("skipping checkpoint %s/%s: %s", self.url, info.key, exc)
                tried[info.key] = str(exc)
                if tree is not None and into is not None:  # accept refused a tree read into them
                    filled.spoiled = _poison(into.live_tensors())
                dirty = dirty or filled.spoiled
            except StateMismatchError as exc:
                if dirty:
                    raise StateMismatchError(f"{exc} {_POISONED}", mismatches=exc.mismatches) from exc
                raise
        # Only committed checkpoints of the live lineage count: a root holding nothing but an
        # interrupted first save (or a superseded writer's orphans) is a fresh start.
        blocking = {c.key for c in seen if c.committed and not c.orphan}
        if not blocking:
            tried = {}
        listing = "; ".join(f"{k}: {v}" for k, v in sorted(tried.items())) or "none"
        raise NoValidCheckpointError(
            f"no valid checkpoint under {self.url}: tried {len(tried)} ({listing}). "
            "Inspect with `ckptsdk ls URL` / `ckptsdk verify URL`; restore a copy, or start a new root"
            + (f". {_POISONED}" if dirty else ""),
            url=self.url,
            tried=tried,
        )

    def read_tree(self, info: CheckpointInfo, into: LiveTarget | None = None, *, strict: bool = True) -> Any:
        """The state tree of one checkpoint (from :meth:`pick` or :meth:`list`), its tensor files
        verified; never a part of it.

        Every file's header is read and the tree decoded before a data byte is: ``into`` (a
        :class:`LiveTarget`: restore's ``TrainState``) is checked against it first, then the
        bytes go straight into its live tensors where dtype and shape match (one read, no copy).
        A failure once the bytes began to arrive sets those tensors to NaN (``read_newest`` then
        restores another checkpoint into them, or says so in its error).

        A checkpoint that records tensors by reference (format 3.0's ``referenced``: a frozen
        base) is read only into an ``into`` that holds them: before any file is opened, the live
        tensors at those paths are proven to hold the recorded bytes (hashed; nothing written),
        and the tree then holds those live tensors themselves (a load copies each onto itself).
        With ``strict=False``, referenced paths the live state does not hold are neither proven
        nor loaded (their tree leaves are meta tensors).

        Raises:
            CorruptCheckpointError: a file fails its check, or the tree does not match the tensors.
            ManifestError: the manifest lists no tensor file.
            StateMismatchError: the tree does not fit ``into`` (nothing was read into it), or
                the live base is not the one the checkpoint references (nothing was read; never
                a fallback: another base fails every checkpoint of the run).
        """
        return self._read_tree(info, into, _Filled(), strict=strict)

    def _base(self, info: CheckpointInfo, into: LiveTarget | None, *, strict: bool) -> dict[str, Any]:
        """The live tensors a checkpoint references, proven (see :meth:`read_tree`); their paths
        the live state lacks (``strict=False`` only) as meta tensors."""
        import torch

        from ckptsdk.format.dtype import BY_NAME, to_torch
        from ckptsdk.format.files.reference import prove

        manifest = info.manifest
        assert manifest is not None
        refs = manifest.referenced_tensors()
        if not refs:
            return {}
        count = len(refs)
        sources = ", ".join(sorted({g.source or "an unnamed source" for g in manifest.referenced}))
        if into is None:
            raise StateMismatchError(
                f"checkpoint {self.url}/{info.key} records {count} tensor(s) by reference (from {sources}), not "
                "their bytes: restore it into a state holding that base (mgr.restore(TrainState(model=...))), "
                "or export it with the base (`ckptsdk export --base`)",
                url=self.url,
                step=info.step,
                mismatches=sorted(refs)[:10],
            )
        live = dict(into.tensors_at(list(refs)))
        groups = manifest.referenced
        if not strict:
            groups = [
                g.model_copy(update={"tensors": {p: e for p, e in g.tensors.items() if p in live}})
                for g in manifest.referenced
            ]
            groups = [g for g in groups if g.tensors]
            skipped = count - sum(len(g.tensors) for g in groups)
            if skipped:
                logger.info("not proving %d referenced tensor(s) the live state does not hold (strict=False)", skipped)
        prove(live, groups, url=f"{self.url}/{info.key}", step=info.step)
        base = {p: t.detach() for p, t in live.items() if p in refs}
        for path, (_group, entry) in refs.items():
            if path not in base:
                base[path] = torch.empty(entry.shape, dtype=to_torch(BY_NAME[entry.dtype]), device="meta")
        return base

    def _read_tree(self, info: CheckpointInfo, into: LiveTarget | None, filled: _Filled, *, strict: bool = True) -> Any:
        # torch (tensors, the codec, RNG checks) only on this path (here and the steps it calls):
        # listing and verifying a root, as the CLI does, never pays its import.
        from ckptsdk.format.files.hashedread import open_file
        from ckptsdk.format.files.readahead import read_ahead
        from ckptsdk.format.files.tensorfile import open_tensorfile
        from ckptsdk.rng import check_rng

        manifest = info.manifest
        assert manifest is not None
        entry = next((f for f in manifest.files if f.name == TENSORS), None)
        if entry is None:
            raise ManifestError(f"{info.key}/{MANIFEST} lists no {TENSORS}", url=self.url, step=info.step)
        base = self._base(info, into, strict=strict)  # before any file is opened: another base touches nothing
        # The base is never filled nor poisoned: a fallback to an older checkpoint proves it again.
        live = {p: t for p, t in (into.live_tensors() if into is not None else {}).items() if p not in base}
        files: list[tuple[str, FileEntry | SharedFile]] = [(f"{info.key}/{TENSORS}", entry)]
        files += [(s.name, s) for s in manifest.shared]
        with ExitStack() as stack:
            streams: list[BinaryIO] = []
            for key, _ in files:
                streams.append(stack.enter_context(open_file(self.backend, key)))
            # The disk reads the files while their headers, the plan, the decode and the fit
            # check below run; fill() then copies from the page cache (local files and the Drive
            # mount; object stores have no descriptor to warm). Started before the first header
            # read: ResNet-18 restore 43 -> 35 ms, against 46 ms without (benchmarks/bench_restore.py).
            stack.enter_context(read_ahead(streams))
            opened = [
                stack.enter_context(
                    open_tensorfile(
                        self.backend, key, size=f.size, digest=f.digest, algorithm=f.algorithm, stream=stream
                    )
                )
                for (key, f), stream in zip(files, streams, strict=True)
            ]
            # A shared file may hold tensors this checkpoint no longer uses (changed since): they
            # are hashed, not kept. The memory check is of the whole read, every file together.
            plans = [(live, None)] + [
                (
                    {p: live[p] for p in shared.tensors if p in live and p not in shared.aliases},
                    {shared.aliases.get(p, p) for p in shared.tensors},
                )
                for shared in manifest.shared
            ]
            fresh = [tf.fresh_bytes(mine, wanted) for tf, (mine, wanted) in zip(opened, plans, strict=True)]
            allocated = [
                tf.allocate(mine, wanted=wanted, besides=sum(fresh) - own)
                for tf, (mine, wanted), own in zip(opened, plans, fresh, strict=True)
            ]
            tensors = allocated[0]
            self._place_base(info, tensors, base)
            copies = self._place_shared(info, tensors, allocated[1:])
            tree, complete = self._decode(info, tensors)
            if into is not None:
                into.check_fit(tree, strict=strict)  # before any byte lands in a live tensor
            try:
                for tf in opened:
                    tf.fill()
                for dest, src in copies:
                    dest.copy_(src)
                complete()
                if isinstance(tree, Mapping) and isinstance(tree.get("rng"), Mapping):
                    check_rng(tree["rng"])  # an impossible RNG state is damage: fall back, not fail later
            except BaseException:
                if live:  # part of a file that failed (or a storage error) is in the live tensors
                    filled.spoiled = _poison(live)
                raise
        return tree

    def _place_base(self, info: CheckpointInfo, tensors: dict[str, Any], base: dict[str, Any]) -> None:
        """Add the proven live base to the folder's tensors (a path both stored and referenced is damage)."""
        for path, t in base.items():
            if path in tensors:
                raise self._damage(info, f"tensor {path!r} is both stored and referenced")
            tensors[path] = t

    def _place_shared(
        self, info: CheckpointInfo, tensors: dict[str, Any], allocated: builtins.list[dict[str, Any]]
    ) -> builtins.list[tuple[Any, Any]]:
        """Add each shared file's tensors (unchanged since an earlier save, verified the same way)
        to ``tensors``; return the copies still to make once filled: (an alias's own tensor, its source)."""
        import torch

        manifest = info.manifest
        assert manifest is not None
        copies: builtins.list[tuple[torch.Tensor, torch.Tensor]] = []
        for shared, held in zip(manifest.shared, allocated, strict=True):
            handed: set[str] = set()
            for path in shared.tensors:
                key = shared.aliases.get(path, path)  # equal bytes (tied weights): stored once, under one key
                if key not in held or path in tensors:
                    why = "does not hold" if key not in held else "repeats the folder's"
                    raise self._damage(info, f"shared file {shared.name} {why} tensor {path!r}")
                # An alias means equal bytes, not one storage: two zero momentum buffers share a
                # key, and handing both paths one tensor would make the optimizer update it twice
                # per step after the resume. Every path after the first gets its own copy.
                if key in handed:
                    copies.append((torch.empty_like(held[key]), held[key]))
                    tensors[path] = copies[-1][0]
                else:
                    tensors[path] = held[key]
                    handed.add(key)
        return copies

    def _decode(self, info: CheckpointInfo, tensors: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
        """The manifest's tree over ``tensors`` (values still unfilled) and what completes it once
        they are; a tree that does not match the tensors is damage."""
        from ckptsdk.format.decoding import decode_before_values

        manifest = info.manifest
        assert manifest is not None
        try:
            tree, complete = decode_before_values(manifest.tree, tensors)
            unused = set(tensors) - manifest.tensor_path_set()
            if unused:  # the tree lost a leaf (a momentum buffer): never restore part of a state
                raise ValueError(f"the tensor file holds {sorted(unused)[:3]} that the tree never uses")
        except (KeyError, ValueError, TypeError) as exc:
            raise self._damage(info, f"its manifest tree does not match its tensors ({exc})") from exc
        return tree, complete

    def _damage(self, info: CheckpointInfo, what: str) -> CorruptCheckpointError:
        """The error for a checkpoint whose parts do not fit together: ``restore`` falls back past it."""
        return CorruptCheckpointError(
            f"checkpoint {self.url}/{info.key}: {what}; it cannot be restored (restore falls back to an "
            "earlier checkpoint)",
            url=self.url,
            step=info.step,
            key=info.key,
        )


def _unchecked(manifest: Manifest) -> str | None:
    """What a files-only check leaves out: the tensors a checkpoint records by reference."""
    if not manifest.referenced:
        return None
    count = sum(len(g.tensors) for g in manifest.referenced)
    sources = ", ".join(sorted({g.source or "unnamed" for g in manifest.referenced}))
    return f"{count} referenced tensor(s) (source {sources}) not checked: no base given"


@dataclass
class _Filled:
    """One read into live tensors: whether a failure left them NaN (``read_newest`` says so)."""

    spoiled: bool = False


_POISONED = (
    "The live model's tensors were being filled from a checkpoint that then failed, so they are "
    "set to NaN: build the model again before training it from scratch"
)


def _poison(live: Mapping[str, Any]) -> bool:
    """Set live tensors a failed read filled part of to NaN (a fallback that restores overwrites
    them all: it loads every module key); whether there were any."""
    import torch

    with torch.no_grad():
        for t in live.values():
            t.fill_(float("nan"))
    return bool(live)
