"""CheckpointManager under a torch.distributed process group: one committer, every rank writes.

Rank 0 owns an ordinary :class:`ckptsdk.CheckpointManager` (lease, lineage, rotation, step log)
and commits; other ranks never touch the lease. Every decision (fenced or not, which folder, which
checkpoint, did it commit) is made on rank 0 and broadcast as JSON, so no rank writes after rank 0
was fenced. Tensors go through DCP with :mod:`.storage`; each rank's RNG states go to its own file.
Restoring (offer, load, agree, fall back together) is restoring.py's; what a background save
copies at ``save()`` and what waits for the worker is snapshot.py's.
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading import catalog as _catalog
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo
from ckptsdk.checkpoint.retention import Rule
from ckptsdk.distributed import restoring
from ckptsdk.distributed.collective import broadcast_json, describe_error, gather_json, rebuild_error
from ckptsdk.distributed.payload import PAYLOAD_FORMAT, local_file
from ckptsdk.distributed.snapshot import Frozen, Snapshotter, find_optimizers
from ckptsdk.distributed.storage import CkptStorageWriter, JsonSavePlanner, unwrap
from ckptsdk.errors import CkptError, ConfigError, CorruptCheckpointError
from ckptsdk.format import codec
from ckptsdk.format.digest import DEFAULT as DIGEST_ALGORITHM
from ckptsdk.format.files.tensorfile import write_tensorfile
from ckptsdk.format.layout import checkpoint_dir, writer_tag
from ckptsdk.format.manifest import FileEntry
from ckptsdk.manager import CheckpointManager, ResumePoint, Simulation, save_due
from ckptsdk.options import DEPRECATED, LeaseOptions, Retention, SaveOptions, deprecated_shorthand, grouped
from ckptsdk.rng import capture_rng

if TYPE_CHECKING:
    from ckptsdk.runlog.audit import AuditReport

logger = logging.getLogger(__name__)

__all__ = ["DistributedCheckpointManager"]

#: The deprecated flat keywords this signature took in ckptsdk 0.1.0 (the others never were).
_DEPRECATED = {kw: DEPRECATED[kw] for kw in ("keep_every", "lease_ttl", "lease_wait", "force", "snapshot")}


def _snapshot(obj: Any) -> Any:
    """A copy of a small tree (metrics, ``local`` extras) that no longer changes with training."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


class DistributedCheckpointManager:
    """Checkpoints of a torch.distributed job under one root URL (call on every rank).

    Rank 0 acquires the writer lease (waiting or taking over as :class:`ckptsdk.CheckpointManager`
    does) and is the single committer; every rank writes its own share of each save.

    Args:
        url: the root (any ckptsdk URL), or an opened backend.
        group: the process group (default: the world). Its rank 0 is the committer.
        retention, lease_options, keep_last, keep, save_every, run_id, _simulation: as for
            :class:`ckptsdk.CheckpointManager` (used on rank 0).
        save_options: as for ``CheckpointManager``; ``on_signal`` is always off here (rank 0
            alone would catch the signal, and the other ranks would never join its last save).
            Its ``asynchronous`` (shorthand ``async_save``) makes ``save`` non-blocking by
            default and sets up the gloo process group background saves use (``dist.new_group``:
            every rank of the world takes part, even with a ``group`` that holds only some of
            them). Its ``snapshot`` says how a non-blocking save copies the state:
            ``"pipelined"`` (default) copies buffers, RNG and JSON at ``save()`` and leaves the
            optimizers' parameters and state to the background, before their next ``step()``
            (which waits for it; see :meth:`save`); ``"copy"`` copies everything at ``save()``.
            Both copy into host buffers kept for the next save (no device memory doubled).
        storage_options: fsspec options for ``gs://``.
        optimizers: the optimizers whose tensors a pipelined save may copy in the background,
            where the state dict's Stateful values hold none as an attribute (found there by
            default, one level down: ``AppState(model, optimizer).optimizer``).
        **deprecated: ``keep_every``, ``lease_ttl``, ``lease_wait``, ``force``, ``snapshot``: the
            flat keywords of ckptsdk 0.1.0, deprecated (:data:`ckptsdk.options.DEPRECATED`).

    Raises:
        ConfigError: torch.distributed is not initialised, an option value is invalid, or a
            group was given with one of its flat keywords.
        TypeError: a keyword that is neither in the signature nor a deprecated flat keyword.
        LeaseHeldError: on every rank, when rank 0 could not get the lease.

    Example (on every rank of a process group, not a doctest: tests/test_distributed_*.py)::

        dm = DistributedCheckpointManager("gs://bucket/run", save_every=100)
        state = {"app": AppState(model, optimizer)}
        pos = dm.restore(state)            # every rank; the same step everywhere
        if dm.should_save(step): dm.save(state, step=step, local={"batch": b})
        dm.close()
    """

    def __init__(
        self,
        url: str | Backend,
        *,
        group: dist.ProcessGroup | None = None,
        retention: Retention | None = None,
        lease_options: LeaseOptions | None = None,
        save_options: SaveOptions | None = None,
        keep_last: int | None = None,
        keep: Rule | Sequence[Rule] | None = None,
        save_every: int | None = None,
        async_save: bool | None = None,
        storage_options: Mapping[str, object] | None = None,
        run_id: str | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        _simulation: Simulation | None = None,
        **deprecated: Any,
    ) -> None:
        flat: dict[str, Any] = dict(keep_last=keep_last, keep=keep, save_every=save_every, async_save=async_save)
        flat.update(deprecated_shorthand(deprecated, _DEPRECATED, owner="DistributedCheckpointManager.__init__"))
        kept = grouped("retention", retention, Retention, flat)
        leasing = grouped("lease_options", lease_options, LeaseOptions, flat)
        saves = grouped("save_options", save_options, SaveOptions, flat)
        save_every, async_save, snapshot = saves.every, saves.asynchronous, saves.snapshot
        if not dist.is_initialized():
            raise ConfigError(
                "DistributedCheckpointManager needs torch.distributed initialised "
                "(dist.init_process_group); use ckptsdk.CheckpointManager in one process"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        self.save_every = save_every
        self.backend = open_backend(url, **dict(storage_options or {})) if isinstance(url, str) else url
        self.url = self.backend.url
        #: this rank's ``local`` extras from the restored checkpoint (None: fresh, or resharded).
        self.local: dict[str, Any] | None = None
        self._core: CheckpointManager | None = None
        self._closed = False
        self.async_save = async_save
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptsdk-dist-save") if async_save else None
        self._pending: Future[str] | None = None
        self.snapshot = snapshot
        self._optimizers = list(optimizers)
        self._snapshotter = Snapshotter(snapshot)
        #: bytes the last non-blocking save copied on the training thread at ``save()`` and left
        #: to the background (``{"at_save": ..., "deferred": ...}``), on this rank.
        self.last_snapshot: dict[str, int] = {}
        # Background saves talk over a group of their own (gloo: CPU, any thread), so their
        # collectives never interleave with the training loop's on the main group.
        self._bg_group: Any = None
        if async_save:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._bg_group = dist.new_group(ranks=ranks, backend="gloo")
        outcome: dict[str, Any] = {"ok": True}
        error: CkptError | None = None
        if self.rank == 0:
            try:
                self._core = CheckpointManager(
                    self.backend,
                    retention=kept,
                    lease_options=leasing,
                    # Rank 0 alone would catch the signal and the other ranks would never join
                    # its last save: signals keep their default behaviour in distributed jobs.
                    # Non-blocking saves and their snapshots are this manager's; the core commits
                    # blocking, with the default snapshot, as it always did.
                    save_options=dataclasses.replace(
                        saves, asynchronous=False, snapshot=SaveOptions().snapshot, on_signal=False
                    ),
                    run_id=run_id,
                    _simulation=_simulation,
                )
            except CkptError as exc:
                outcome, error = describe_error(exc), exc
        self._agree(outcome, error)

    # ------------------------------------------------------------------ helpers

    def _bcast(self, obj: Any, group: Any = None) -> Any:
        return broadcast_json(obj, src=self._src, group=group or self.group)

    def _agree(self, outcome: dict[str, Any], error: BaseException | None, group: Any = None) -> dict[str, Any]:
        """Broadcast rank 0's outcome; every rank raises the same error type when it failed."""
        outcome = self._bcast(outcome, group)
        if error is not None:  # rank 0 raises its own exception, with its fields and cause
            raise error if isinstance(error, Exception) else rebuild_error(outcome)
        if not outcome.get("ok"):
            raise rebuild_error(outcome)
        return outcome

    def _writer(self) -> tuple[int, str]:
        """Rank 0's writer rank (lease epoch, tag), as the core manager names its folders."""
        core = self._core
        assert core is not None and core.lease is not None and core.lease.record is not None
        tag = writer_tag(core.lease.record.holder.nonce, compare_and_swap=self.backend.capabilities.compare_and_swap)
        return core.lease.epoch, tag

    def _folder(self, step: int) -> str:
        """This writer's folder for ``step`` (``save`` checks the core manager committed that one)."""
        return checkpoint_dir(step, *self._writer())

    def should_save(self, step: int) -> bool:
        """True every ``save_every`` steps (the core manager's rule, on every rank)."""
        return save_due(step, self.save_every)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        state: dict[str, Any],
        *,
        step: int,
        epoch: int | None = None,
        batch_idx: int | None = None,
        metrics: Mapping[str, object] | None = None,
        extra: Mapping[str, object] | None = None,
        tags: Mapping[str, str] | None = None,
        local: Mapping[str, Any] | None = None,
        blocking: bool | None = None,
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
    ) -> str:
        """Save ``state`` (a DCP state dict; Stateful values allowed) at ``step`` on every rank.

        Rank 0 renews the lease and looks for a newer writer first; if it was fenced, every rank
        raises ``LeaseLostError`` before writing anything. Each rank then writes its share and its
        own RNG states and ``local`` extras; rank 0 publishes the manifest only after all of them.

        Args:
            state: what ``dcp.save`` takes (e.g. ``{"app": AppState(model, optimizer)}``).
            step, epoch, batch_idx, metrics, extra, tags: as for ``CheckpointManager.save``.
            local: this rank's own JSON/tensor extras (its sampler position), restored to the
                same rank.
            blocking: False snapshots the state into host buffers (see the manager's
                ``snapshot``: by default the optimizers' parameters and state are copied in the
                background, and their next ``step()`` waits for that copy) and writes it from a
                background thread over a process group of its own; the save's failure, on every
                rank, surfaces at the next ``save``/``wait``/``close``. None: ``async_save``.
                The pipelined rule: between ``save()`` and the next ``optimizer.step()`` only
                that step may change parameters and optimizer state; a break torch counts (an
                in-place edit on any rank) fails the save on every rank with ``CheckpointError``
                and commits nothing (docs/GUARANTEES.md says what it cannot see).
            optimizers: for this save, instead of the manager's ``optimizers``.

        Returns:
            Blocking: the committed folder (the same on every rank). Not blocking:
            ``"step-0000000100 (saving)"``; the save is committed once ``wait()`` returns.

        Raises:
            LeaseLostError: on every rank, when rank 0 lost the lease; nothing was written.
            BackendError, CkptError: on every rank, as rank 0 saw it; nothing was committed.
        """
        if self._closed:
            raise ConfigError(f"save() after close() on {self.url}")
        self.wait()  # one save in flight; its failure surfaces here, on every rank
        rng = capture_rng()  # first: nothing below may draw before the state is captured
        blocking = (not self.async_save) if blocking is None else blocking
        if blocking:
            return self._save(state, rng, step, epoch, batch_idx, metrics, extra, tags, local, self.group)
        if self._bg_group is None:
            raise ConfigError(
                "save(blocking=False) needs DistributedCheckpointManager(async_save=True), "
                "which sets up the process group background saves talk over"
            )
        live = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        opts = list(optimizers) if optimizers is not None else (self._optimizers or find_optimizers(state))
        where = f"the save of step {step} under {self.url} (rank {self.rank}): "
        frozen = self._snapshotter.freeze(live, opts, where=where)
        self.last_snapshot = {"at_save": frozen.copied_bytes, "deferred": frozen.deferred_bytes}
        if frozen.deferred_bytes:
            self._snapshotter.hold(frozen, opts)
        args = (
            frozen.tree,
            rng,
            step,
            epoch,
            batch_idx,
            _snapshot(dict(metrics or {})),
            dict(extra or {}),
            dict(tags or {}),
            _snapshot(dict(local or {})),
            self._bg_group,
            frozen.staged,
            frozen.verify,
        )
        assert self._pool is not None
        self._pending = self._pool.submit(self._background, frozen, args)
        # Every rank's folder is rank 0's decision, made in the background: name what it will be.
        return f"step-{step:010d} (saving)"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background save; re-raise its failure (every rank gets it). False: still running."""
        pending = self._pending
        if pending is None:
            return True
        done, _ = futures_wait([pending], timeout)
        if not done:
            return False
        self._pending = None
        self._snapshotter.hold(None)  # its copy is long done: the next steps run free
        pending.result()  # re-raises the background failure here
        return True

    def _background(self, frozen: Frozen, args: tuple[Any, ...]) -> str:
        """A non-blocking save on the worker: the deferred copies first, then the write."""
        frozen.finish()  # a failure is raised inside this rank's DCP write, so every rank gets it
        return self._save(*args)

    def _save(
        self,
        state: dict[str, Any],
        rng: Any,
        step: int,
        epoch: int | None,
        batch_idx: int | None,
        metrics: Mapping[str, Any] | None,
        extra: Mapping[str, Any] | None,
        tags: Mapping[str, str] | None,
        local: Mapping[str, Any] | None,
        group: Any,
        staged: Mapping[int, torch.Tensor] | None = None,
        verify: Callable[[], None] | None = None,
    ) -> str:
        decision: dict[str, Any] = {"ok": True}
        error: BaseException | None = None
        if self.rank == 0:
            try:
                decision = self._preflight(step)
            except CkptError as exc:
                decision, error = describe_error(exc), exc
        decision = self._agree(decision, error, group)
        folder: str = decision["folder"]
        if decision.get("existing"):
            return folder
        mine: dict[str, Any]
        failed: Exception | None = None
        try:
            tensors, skeleton = codec.encode({"rng": rng, "local": dict(local or {})})
            size, digest = write_tensorfile(self.backend, f"{folder}/{local_file(self.rank)}", tensors)
            mine = {
                "file": local_file(self.rank),
                "size": size,
                "digest": digest,
                "algorithm": DIGEST_ALGORITHM,
                "tree": skeleton,
            }
        except CkptError as exc:  # reported to every rank below, so that none waits for this one
            mine, failed = {"error": describe_error(exc)}, exc
        locals_ = gather_json(mine, group=group)
        if failed is not None:
            raise failed
        bad = next((rec["error"] for rec in locals_ if "error" in rec), None)
        if bad is not None:
            raise rebuild_error(bad)

        def commit(md: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
            core = self._core
            assert core is not None
            for rec in locals_:
                files[rec["file"]] = {k: rec[k] for k in ("size", "digest", "algorithm")}
            payload = {
                "format": PAYLOAD_FORMAT,
                "world_size": self.world_size,
                "dcp": md,
                "local": [rec["tree"] for rec in locals_],
            }
            # The rank files go into the manifest's file list: listing, verify and restore check them.
            info = core.save(
                payload,
                step=step,
                epoch=epoch,
                batch_idx=batch_idx,
                metrics=metrics,
                extra=extra,
                tags=tags,
                blocking=True,
                extra_files=[FileEntry(name=name, **entry) for name, entry in sorted(files.items())],
            )
            if info.key != folder:  # the core manager named the folder differently: never commit that
                raise CorruptCheckpointError(
                    f"{self.url}: the manifest went to {info.key} but the ranks wrote {folder}; this is "
                    "a ckptsdk bug (folder naming drifted), report it",
                    url=self.url,
                    key=info.key,
                )

        writer = CkptStorageWriter(self.backend, folder, commit=commit, verify=verify)
        failure: BaseException | None = None
        try:
            state_dict_saver.save(
                state, storage_writer=writer, planner=JsonSavePlanner(staged=staged), process_group=group
            )
        except CheckpointException as exc:
            failure = writer.commit_error or unwrap(exc)
        outcome = {"ok": True, "key": folder} if failure is None else describe_error(failure)
        self._agree(outcome, failure if self.rank == 0 else None, group)
        return folder

    def _preflight(self, step: int) -> dict[str, Any]:
        """On rank 0: renew the lease, fence on a newer writer, name the folder."""
        core = self._core
        assert core is not None and core.lease is not None
        core.lease.check()
        core.lease.renew()
        if core.runlog is not None:
            core.runlog.flush()  # the steps before a save are on storage even if a rank dies in it
        own = self._writer()
        cat = _catalog.scan(self.backend, judge=_catalog.Judge(core.lease.previous, own))
        if cat.fencing_rank > own:  # the core manager's fencing rule: any newer writer fences this one
            core.lease.fence(f"saw a newer writer (epoch {cat.fencing_rank[0]}) under {self.url}", cat.fencing_rank[0])
            core.lease.check()  # raises LeaseLostError
        folder = self._folder(step)
        existing = any(c.key == folder and c.committed for c in cat.checkpoints)
        return {"ok": True, "folder": folder, "existing": existing}

    # ------------------------------------------------------------------ restoring

    def restore(self, state: dict[str, Any]) -> ResumePoint | None:
        """Load the newest valid checkpoint into ``state`` on every rank (the same step on all).

        Rank 0 walks the checkpoints newest first through its core manager (skipping torn and
        orphaned ones: the rank files are in the manifest) and offers each to every rank; each
        rank loads what its shards need, verified, through DCP (a checkpoint written by N ranks
        restores on M). A rank file that fails its digest makes every rank drop that checkpoint
        together, with a warning naming the file, and the next older one is offered; rank 0's
        lineage starts only from the one every rank loaded. When the world size is unchanged each
        rank gets back its own RNG states and ``local`` extras (``self.local``); otherwise they
        are left alone and a warning says so.

        Returns:
            The :class:`ckptsdk.ResumePoint` (same on every rank), or ``None`` on a fresh root.

        Raises:
            StateMismatchError: on every rank, when ``state`` does not fit the checkpoint.
            NoValidCheckpointError, LeaseLostError: on every rank, as rank 0 saw them (every
                checkpoint corrupt on some rank included).
        """
        return restoring.restore(self, state)

    # ------------------------------------------------------------------ step log, lifecycle

    def log_step(self, step: int, **scalars: float | torch.Tensor | np.generic) -> None:
        """Append ``scalars`` for ``step`` to the step log: rank 0's only, other ranks: a no-op.

        No collective runs per step, so another rank's scalars never reach the log; log a value
        that is the same on every rank (an all-reduced loss) to have the audit cover them all.
        """
        if self._core is not None:
            self._core.log_step(step, **scalars)

    def audit(self, tolerance: float = 0.0) -> AuditReport | None:
        """The resume audit (see :meth:`ckptsdk.CheckpointManager.audit`); rank 0 only, else None.

        It compares rank 0's logged scalars only (see :meth:`log_step`), and says so in the log.
        """
        if self._core is None:
            return None
        logger.info(
            "audit of %s compares rank 0's logged scalars only (%d ranks): a divergence seen only "
            "in another rank's values is not detected; log all-reduced values to cover every rank",
            self.url,
            self.world_size,
        )
        return self._core.audit(tolerance)

    def list(self) -> builtins.list[CheckpointInfo]:  # `list`: this method, in the class
        """Every checkpoint folder under the root, oldest first (any rank; read-only)."""
        return _catalog.scan(self.backend).checkpoints

    def close(self) -> None:
        """Flush the step log and release the lease (rank 0). Idempotent; no collective."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self._snapshotter.close()
            if self._core is not None:
                self._core.close()

    def __enter__(self) -> DistributedCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
