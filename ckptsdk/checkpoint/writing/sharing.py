"""Incremental saves: a tensor unchanged since the writer's newest commit is not written again.

A frozen fine-tuning base (2.2 GB of a 1.1B model next to 20 MB of adapters) would otherwise be
rewritten at every save. Such tensors go to a *shared* file (``shared/...``, named by the step
that wrote it, the writer and the content; see :mod:`ckptsdk.format.layout`), written once and
never rewritten; each later manifest that uses them lists the file with the paths it takes and
each tensor's digest. Whether a tensor is unchanged is decided by its content, never by a flag:

  - a tensor the newest commit took from a shared file is hashed now (dtype, shape and raw
    bytes, xxh3-128) and referred to only when the digest is the one that file holds. An edit by
    any route (in place under ``no_grad``, through ``.data``, ``copy_``, ``load_state_dict``, a
    new tensor assigned, ``set_``) changes the bytes, so the tensor is written again;
  - the cheap path only ever skips the hash, towards writing: a tensor whose storage pointer or
    version counter moved since the newest commit is written without hashing (full training,
    where everything moves, pays nothing but that check);
  - a tensor goes to a new shared file at the writer's first save when no optimizer steps it
    (the frozen base), or later once its pointer and version counter stayed put for a whole save
    interval (whatever its bytes are then: they are what is written).

Tensors under ``SHARE_MIN_BYTES`` always go to the checkpoint's own file. When a shared file may
go is :mod:`ckptsdk.checkpoint.pruning.shared_files`' (rotation and gc); the reader verifies every
shared file it uses as it does the folder's own.

``frozen="reference"`` (format 3.0's ``referenced``): a frozen weight (an ``nn.Parameter`` with
``requires_grad=False``, at least ``REFERENCE_MIN_BYTES``, that no optimizer steps) seen at the
writer's first save is recorded by dtype, shape and digest and never written: the restorer
supplies it and proves it. Decided on the training thread at ``save()`` (so staging never copies
it); hashed on the save's worker. The rule for edits of such a tensor:

  - an edit torch sees (its version counter or storage moved) before a ``save()``: that save and
    every later one store the tensor (as today), with a warning;
  - an edit torch cannot see (``.data``, a numpy view): the tensors are re-hashed in the
    background (:class:`~ckptsdk.format.files.rehash.Rehasher`) and by a whole pass begun after each
    ``save()`` before its commit, so the save after the edit stores the tensor in full, warned;
  - between a ``save()`` and its commit nothing may edit them (the pipelined snapshot's rule):
    the bytes stored are those the worker reads. An edit torch sees there fails the save.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import xxhash

from ckptsdk.backends.base import Backend
from ckptsdk.errors import CheckpointError, ObjectNotFound
from ckptsdk.format.dtype import of_torch
from ckptsdk.format.files.reference import TENSOR_ALGORITHMS, hash_tensor
from ckptsdk.format.files.rehash import Rehasher
from ckptsdk.format.manifest import Manifest, ReferencedBase, ReferencedTensor, SharedFile

logger = logging.getLogger(__name__)

__all__ = [
    "FROZEN_MODES",
    "REFERENCE_MIN_BYTES",
    "REHASH_INTERVAL_S",
    "SHARE_MIN_BYTES",
    "FrozenMode",
    "Hints",
    "Key",
    "Plan",
    "Sharing",
    "content_name",
    "tensor_digest",
]

#: What a save does with a frozen weight: store its bytes, or record it by digest (see the module doc).
FrozenMode = Literal["store", "reference"]
FROZEN_MODES: tuple[FrozenMode, ...] = get_args(FrozenMode)
#: Frozen weights smaller than this are stored with each checkpoint in reference mode: a manifest
#: entry costs about 200 bytes (a LoRA GPT-2's LayerNorms and biases, 3 KiB each, go by reference).
REFERENCE_MIN_BYTES = 4096
#: Seconds between the background re-hash passes of the referenced tensors (besides one per save).
REHASH_INTERVAL_S = 60.0

#: Tensors smaller than this are written with each checkpoint (not worth a manifest entry).
SHARE_MIN_BYTES = 1 << 20

#: (storage pointer, version counter) of a live tensor at ``save()``.
Key = tuple[int, int]


#: xxh3-128 of a tensor's dtype, shape and raw bytes (what a manifest's ``shared`` and
#: ``referenced`` record): the one rule, in :func:`ckptsdk.format.files.reference.hash_tensor`.
tensor_digest = hash_tensor


def content_name(digests: Mapping[str, str]) -> str:
    """16 hex digits naming a shared file by what it holds (its paths and their digests)."""
    h = xxhash.xxh3_64()
    for path in sorted(digests):
        h.update(f"{path}\0{digests[path]}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Hints:
    """What ``save()`` saw of the live tensors: their keys, and which of them an optimizer steps."""

    keys: Mapping[str, Key]
    step_only: frozenset[str] = frozenset()
    #: paths recorded by digest, not written (``frozen="reference"``): decided at ``save()``
    referenced: frozenset[str] = frozenset()
    #: ``time.monotonic()`` at ``save()``: a re-hash pass begun after it confirms the referenced bytes
    instant: float = 0.0


@dataclass
class Plan:
    """Where one save's tensors go: its own file, a new shared file, or a shared file already written."""

    own: dict[str, torch.Tensor] = field(default_factory=dict)
    new: dict[str, torch.Tensor] = field(default_factory=dict)
    new_digests: dict[str, str] = field(default_factory=dict)
    #: paths of ``new`` whose bytes another path of it holds already (tied weights): written once
    new_aliases: dict[str, str] = field(default_factory=dict)
    refs: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> {path: digest}
    ref_aliases: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> {path: key in it}
    referenced: dict[str, tuple[torch.Tensor, str]] = field(default_factory=dict)  # path -> (live, digest)
    hashed: int = 0  # bytes hashed to decide

    def written(self) -> dict[str, torch.Tensor]:
        """The tensors the new shared file holds: ``new`` without its aliases."""
        return {p: t for p, t in self.new.items() if p not in self.new_aliases}

    @property
    def reused(self) -> int:
        """How many tensors this save does not write again."""
        return sum(len(paths) for paths in self.refs.values())


def _alias_new(plan: Plan) -> None:
    """``plan.new_aliases`` from its digests: equal digests (dtype, shape, bytes), one copy in the file."""
    first: dict[str, str] = {}
    plan.new_aliases = {}
    for name, digest in plan.new_digests.items():
        if first.setdefault(digest, name) != name:
            plan.new_aliases[name] = first[digest]


class Sharing:
    """One writer's memory of what its newest commit keeps in shared files (see the module doc).

    Args:
        enabled: False writes every tensor with every checkpoint (``incremental=False``).
        min_bytes: tensors smaller than this are never shared (nor referenced when it is under
            ``REFERENCE_MIN_BYTES``).
        mode: ``"reference"`` records frozen weights by digest (``SaveOptions.frozen``).
        source: the label recorded with the referenced tensors (``SaveOptions.frozen_source``).
        rehash_interval: seconds between background re-hash passes of the referenced tensors.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        min_bytes: int = SHARE_MIN_BYTES,
        mode: FrozenMode = "store",
        source: str | None = None,
        rehash_interval: float = REHASH_INTERVAL_S,
    ) -> None:
        self.enabled = enabled
        self.min_bytes = min_bytes
        self.mode = mode
        self.source = source
        self.rehash_interval = rehash_interval
        self._stored: dict[str, tuple[str, str, str]] = {}  # path -> (shared file, digest, key in it)
        self._files: dict[str, SharedFile] = {}  # shared file -> its entry (size, digest, algorithm)
        self._keys: dict[str, Key] | None = None  # at the newest commit's save() (None: not known)
        self._fresh = True  # no commit and no restore yet: the first-save rule applies
        # The positions of the tensors large enough to share, for the last names tuple seen (a
        # cached template's: the same object at every save), so hints() visits only those.
        self._large: tuple[Sequence[str] | None, list[int]] = (None, [])
        # Reference mode: path -> digest the newest commit (or a restore's proof) records; paths
        # seen changed, never referenced again; whether this writer committed yet; the watcher.
        self._refs: dict[str, str] = {}
        self._unreferenced: set[str] = set()
        self._first = True
        self._rehasher: Rehasher | None = None
        self._watched: dict[str, torch.Tensor] = {}

    @property
    def fresh(self) -> bool:
        """No commit or restore yet: ``save()`` should say which tensors an optimizer steps."""
        return self.enabled and (self._fresh or (self.referencing and self._first))

    @property
    def referencing(self) -> bool:
        """Frozen weights are recorded by digest (``frozen="reference"``)."""
        return self.enabled and self.mode == "reference"

    def hints(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        step_only: Sequence[bool] = (),
        frozen: Sequence[bool] = (),
    ) -> Hints | None:
        """At ``save()``, on the training thread: the live tensors' keys (None when disabled).

        ``step_only``/``frozen``: per tensor, whether an optimizer steps it / whether it is a
        frozen weight (asked while :attr:`fresh`; the rest are neither)."""
        if not self.enabled:
            return None
        # Only the tensors plan() may share: it never looks up a smaller one's key. A shape
        # change the cached positions miss costs at most a hash there: keys only save hashing,
        # the digest decides what is shared.
        seen, large = self._large
        if seen is not names:
            least = min(self.min_bytes, REFERENCE_MIN_BYTES) if self.referencing else self.min_bytes
            large = [i for i, t in enumerate(tensors) if t.nbytes >= least]
            self._large = (names, large)
        keys = {names[i]: (tensors[i].data_ptr(), tensors[i]._version) for i in large}
        stepped = frozenset(names[i] for i in large if i < len(step_only) and step_only[i])
        referenced: frozenset[str] = frozenset()
        if self.referencing:
            frozen_now = {names[i] for i in large if i < len(frozen) and frozen[i]}
            referenced = self._referenced_now(names, large, stepped | (set(names) - frozen_now), keys)
        return Hints(keys, stepped, referenced, time.monotonic())

    def _referenced_now(
        self, names: Sequence[str], large: list[int], never: set[str] | frozenset[str], keys: Mapping[str, Key]
    ) -> frozenset[str]:
        """The paths this save records by digest: at the writer's first save its frozen weights
        (every large one not in ``never``), later those still referenced whose storage and version
        counter stayed put."""
        if self._first and not self._refs:
            return frozenset(names[i] for i in large if names[i] not in never and names[i] not in self._unreferenced)
        before = self._keys
        out = set()
        for path in self._refs:
            if path not in keys or path in self._unreferenced:
                continue
            if before is not None and before.get(path) != keys[path]:
                self._unreferenced.add(path)
                logger.warning(
                    "referenced tensor %r was changed in place (its version counter or storage moved): "
                    "this save and every later one store it in full; a frozen base is not edited",
                    path,
                )
                continue
            out.add(path)
        return frozenset(out)

    def plan(self, tensors: Mapping[str, torch.Tensor], hints: Hints | None) -> Plan:
        """Decide, per tensor, where this save's bytes go (the tensors are the ones to be written:
        staging copies or, for a blocking save, the live tensors)."""
        plan = Plan()
        if not self.enabled or hints is None:
            plan.own.update(tensors)
            return plan
        if hints.referenced:
            self._reference(plan, tensors, hints)
        before = self._keys
        for name, t in tensors.items():
            if name in plan.referenced:
                continue
            nbytes = t.nbytes
            if nbytes < self.min_bytes:
                plan.own[name] = t
                continue
            moved = before is not None and before.get(name) != hints.keys.get(name)
            stored = self._stored.get(name)
            if stored is not None and not moved:
                digest = tensor_digest(t)
                plan.hashed += nbytes
                if digest == stored[1]:
                    plan.refs.setdefault(stored[0], {})[name] = digest
                    if stored[2] != name:
                        plan.ref_aliases.setdefault(stored[0], {})[name] = stored[2]
                    continue
            if stored is None and ((before is not None and not moved) or (self._fresh and name not in hints.step_only)):
                plan.new[name] = t
                continue
            plan.own[name] = t
        plan.new_digests = {n: tensor_digest(t) for n, t in plan.new.items()}
        plan.hashed += sum(t.nbytes for t in plan.new.values())
        _alias_new(plan)
        return plan

    def _reference(self, plan: Plan, tensors: Mapping[str, torch.Tensor], hints: Hints) -> None:
        """On the save's worker: ``plan.referenced`` from the live tensors ``hints.referenced``
        names. New ones are hashed now (after ``save()``: that hash is the pass confirming them);
        known ones are confirmed by a re-hash pass begun after ``save()``; a changed one is left to
        the store rules (its live bytes are written), warned, and is never referenced again."""
        live = {p: tensors[p] for p in sorted(hints.referenced) if p in tensors}
        began = time.monotonic()
        digests = {}
        for path, t in live.items():
            known = self._refs.get(path)
            if known is None:
                known = hash_tensor(t)
                plan.hashed += t.nbytes
                if (t.data_ptr(), t._version) != hints.keys.get(path):
                    self._unreferenced.add(path)
                    raise CheckpointError(
                        f"frozen tensor {path!r} was changed in place between save() and its hash (its version "
                        "counter or storage moved): this save was not committed, and the next one stores it in "
                        "full. Edit frozen weights before save(), never while a save is in flight",
                        key=path,
                    )
            digests[path] = known
        fresh = all(p not in self._refs for p in live)
        # A partial restore's anchor records what it did not load (meta tensors) as it was.
        watch = {p: t for p, t in live.items() if t.device.type != "meta"}
        changed = self._confirm(watch, {p: digests[p] for p in watch}, hints.instant, began if fresh else None)
        for path in sorted(changed):
            self._unreferenced.add(path)
            del live[path]
        if changed:
            logger.warning(
                "referenced tensor(s) %s no longer hold the bytes their checkpoints record, though torch saw no "
                "change (an edit through .data or a numpy view is the likely cause): this save and every later "
                "one store them in full. Edit frozen weights through torch, before save()",
                ", ".join(repr(p) for p in sorted(changed)[:5]),
            )
        plan.referenced = {p: (t, digests[p]) for p, t in live.items()}

    def _confirm(
        self, live: Mapping[str, torch.Tensor], digests: Mapping[str, str], since: float, checked_at: float | None
    ) -> dict[str, str]:
        """The tensors of ``live`` a re-hash pass begun after ``since`` found changed (the watcher
        follows ``live``: made again when the set or a tensor changed)."""
        if (
            self._rehasher is None
            or self._watched.keys() != live.keys()
            or any(self._watched[p] is not t for p, t in live.items())
        ):
            self.close()
            if not live:
                return {}
            self._rehasher = Rehasher(live, digests, interval=self.rehash_interval, checked_at=checked_at)
            self._watched = dict(live)
        return self._rehasher.confirm(since)

    def referenced_entries(self, plan: Plan) -> list[ReferencedBase]:
        """The manifest's ``referenced`` list for ``plan`` (one group: this writer's source)."""
        if not plan.referenced:
            return []
        tensors = {}
        for path, (t, digest) in sorted(plan.referenced.items()):
            entry = of_torch(t.dtype)
            name = entry.name if entry is not None else str(t.dtype).removeprefix("torch.")
            tensors[path] = ReferencedTensor(dtype=name, shape=list(t.shape), size=t.nbytes, digest=digest)
        return [ReferencedBase(source=self.source, algorithm=TENSOR_ALGORITHMS[0], tensors=tensors)]

    def seed(self, manifest: Manifest) -> None:
        """The digests ``manifest`` references (proven by the restore that read it) are this
        writer's: later saves refer to them while the live tensors hold them."""
        self._refs = {p: e.digest for g in manifest.referenced for p, e in g.tensors.items()}
        if self._refs:
            self._first = False

    def close(self) -> dict[str, str]:
        """Stop the re-hashing (at the writer's close): a last pass, warned about when the live
        base changed after the newest commit. Returns the changed paths and digests found."""
        rehasher, self._rehasher, self._watched = self._rehasher, None, {}
        if rehasher is None:
            return {}
        try:
            changed = rehasher.close()
        except RuntimeError as exc:  # the watcher failed: nothing more to say about the base
            logger.warning("re-hashing the referenced tensors failed: %s", exc)
            return {}
        fresh = sorted(set(changed) - self._unreferenced)
        if fresh:
            logger.warning(
                "referenced tensor(s) %s changed after the newest commit (an edit through .data or numpy?): "
                "the checkpoints record the base as it was; a restore needs that base",
                ", ".join(repr(p) for p in fresh[:5]),
            )
        return changed

    def drop_lost(self, plan: Plan, tensors: Mapping[str, torch.Tensor], backend: Backend, url: str) -> None:
        """A commit never names a shared file that is not there as this writer saw it last.

        Each file ``plan`` refers to is stat'ed (one call per file, usually one: the frozen base;
        none for a save that refers to none; before the upload, on the save's worker). One that is
        missing or not its recorded size (deleted or truncated by hand, a sync tool) leaves the
        plan, loudly: what it held goes to this save's new shared file (written again; later saves
        refer to that one). Else every later save would commit a manifest naming it, and nothing
        saved after the loss would restore. Its bytes are digest-checked at restore as ever.
        """
        for name in sorted(plan.refs):
            try:
                found: int | None = backend.stat(name).size
            except ObjectNotFound:
                found = None
            want = self._files[name].size
            if found == want:
                continue
            paths = plan.refs.pop(name)
            plan.ref_aliases.pop(name, None)
            for path, digest in paths.items():
                plan.new[path], plan.new_digests[path] = tensors[path], digest
            _alias_new(plan)
            self._stored = {p: held for p, held in self._stored.items() if held[0] != name}
            self._files.pop(name)
            logger.warning(
                "shared file %s/%s %s: the save writes its %d tensor(s) again, to a new shared file; "
                "the checkpoints that refer to it cannot be restored (`ckptsdk verify %s --all` lists them)",
                *(url, name, "is missing" if found is None else f"has {found} bytes, not {want}", len(paths), url),
            )

    def entries(self, plan: Plan, new: SharedFile | None) -> list[SharedFile]:
        """The manifest's ``shared`` list for ``plan`` (``new``: the file written for ``plan.new``)."""
        out = [new] if new is not None else []
        for name, paths in sorted(plan.refs.items()):
            out.append(
                self._files[name].model_copy(update={"tensors": paths, "aliases": plan.ref_aliases.get(name, {})})
            )
        return out

    def committed(self, manifest: Manifest, hints: Hints | None) -> None:
        """After a commit: what it keeps in shared files is what later saves may refer to."""
        self._stored = {p: (f.name, d, f.aliases.get(p, p)) for f in manifest.shared for p, d in f.tensors.items()}
        self._files = {f.name: f for f in manifest.shared}
        self._keys = None if hints is None else dict(hints.keys)
        self._fresh = False
        self._refs = {p: e.digest for g in manifest.referenced for p, e in g.tensors.items()}
        self._first = False

    def adopt(self, manifest: Manifest) -> None:
        """After a restore (its anchor committed): refer to its shared files, hashing everything
        once, and to its referenced tensors (proven by that restore)."""
        self.committed(manifest, None)
