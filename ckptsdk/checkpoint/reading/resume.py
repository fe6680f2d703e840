"""What ``restore()`` returns: where a restored run continues (:class:`ResumePoint`), from a
checkpoint's manifest. Reading the checkpoint is :mod:`ckptsdk.checkpoint.reading.reader`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import JsonValue

from ckptsdk.checkpoint.reading.catalog import CheckpointInfo

__all__ = ["MetricValue", "ResumePoint", "resume_point"]


#: A metric as the manifest keeps it (a 0-d tensor or numpy scalar is stored as its value).
MetricValue = bool | int | float | str | None


@dataclass(frozen=True)
class ResumePoint:
    """Where a restored run continues: what ``restore()`` returns.

    Attributes:
        step: the saved step (the next step to run is ``step + 1``).
        epoch: the training epoch saved with it, if any.
        batch_idx: the batch index within that epoch, if any.
        extra: free-form position fields the job saved.
        metrics: metrics saved with the checkpoint.
        tags: string tags saved with the checkpoint (e.g. a dataset hash).
        key: the checkpoint folder restored from.
        lease_epoch: the lease epoch that wrote it.
        unrestored: the objects the checkpoint holds that the state given to
            ``restore(state, strict=False)`` did not (left as they were); empty for a strict restore.
    """

    step: int
    epoch: int | None
    batch_idx: int | None
    extra: dict[str, JsonValue]
    metrics: dict[str, MetricValue]
    tags: dict[str, str]
    key: str
    lease_epoch: int
    unrestored: tuple[str, ...] = ()


def resume_point(info: CheckpointInfo) -> ResumePoint:
    """The :class:`ResumePoint` of a checkpoint whose manifest was read."""
    manifest = info.manifest
    assert manifest is not None
    pos = manifest.position
    return ResumePoint(
        step=manifest.step,
        epoch=pos.epoch,
        batch_idx=pos.batch_idx,
        extra=dict(pos.extra),
        metrics=dict(manifest.metrics),
        tags=dict(manifest.tags),
        key=info.key,
        lease_epoch=info.epoch,
    )
