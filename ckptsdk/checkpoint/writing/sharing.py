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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from ckptsdk.backends.base import Backend
from ckptsdk.errors import ObjectNotFound
from ckptsdk.format.manifest import Manifest, SharedFile

logger = logging.getLogger(__name__)

__all__ = ["SHARE_MIN_BYTES", "Hints", "Key", "Plan", "Sharing", "content_name", "tensor_digest"]

#: Tensors smaller than this are written with each checkpoint (not worth a manifest entry).
SHARE_MIN_BYTES = 1 << 20

#: (storage pointer, version counter) of a live tensor at ``save()``.
Key = tuple[int, int]


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's dtype, shape and raw bytes (what a manifest's ``shared`` records).

    Example:
        >>> tensor_digest(torch.zeros(2)) == tensor_digest(torch.zeros(2))
        True
        >>> tensor_digest(torch.zeros(2)) == tensor_digest(torch.zeros(1, 2))
        False
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    h = xxhash.xxh3_128(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}\n".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


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
        min_bytes: tensors smaller than this are never shared.
    """

    def __init__(self, *, enabled: bool = True, min_bytes: int = SHARE_MIN_BYTES) -> None:
        self.enabled = enabled
        self.min_bytes = min_bytes
        self._stored: dict[str, tuple[str, str, str]] = {}  # path -> (shared file, digest, key in it)
        self._files: dict[str, SharedFile] = {}  # shared file -> its entry (size, digest, algorithm)
        self._keys: dict[str, Key] | None = None  # at the newest commit's save() (None: not known)
        self._fresh = True  # no commit and no restore yet: the first-save rule applies
        # The positions of the tensors large enough to share, for the last names tuple seen (a
        # cached template's: the same object at every save), so hints() visits only those.
        self._large: tuple[Sequence[str] | None, list[int]] = (None, [])

    @property
    def fresh(self) -> bool:
        """No commit or restore yet: ``save()`` should say which tensors an optimizer steps."""
        return self.enabled and self._fresh

    def hints(
        self, names: Sequence[str], tensors: Sequence[torch.Tensor], step_only: Sequence[bool] = ()
    ) -> Hints | None:
        """At ``save()``, on the training thread: the live tensors' keys (None when disabled)."""
        if not self.enabled:
            return None
        # Only the tensors plan() may share: it never looks up a smaller one's key. A shape
        # change the cached positions miss costs at most a hash there: keys only save hashing,
        # the digest decides what is shared.
        seen, large = self._large
        if seen is not names:
            large = [i for i, t in enumerate(tensors) if t.nbytes >= self.min_bytes]
            self._large = (names, large)
        keys = {names[i]: (tensors[i].data_ptr(), tensors[i]._version) for i in large}
        stepped = frozenset(names[i] for i in large if i < len(step_only) and step_only[i])
        return Hints(keys, stepped)

    def plan(self, tensors: Mapping[str, torch.Tensor], hints: Hints | None) -> Plan:
        """Decide, per tensor, where this save's bytes go (the tensors are the ones to be written:
        staging copies or, for a blocking save, the live tensors)."""
        plan = Plan()
        if not self.enabled or hints is None:
            plan.own.update(tensors)
            return plan
        before = self._keys
        for name, t in tensors.items():
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

    def adopt(self, manifest: Manifest) -> None:
        """After a restore (its anchor committed): refer to its shared files, hashing everything once."""
        self.committed(manifest, None)
