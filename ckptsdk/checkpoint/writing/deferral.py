"""Deferral: which tensors of a saved tree a pipelined save may copy after ``save()`` returns.

Those only ``optimizer.step()`` changes (the held optimizers' parameters and their state): the
next step waits for their copy. How the copy is made, held and checked is ``staging.py``'s;
which optimizers a job has is ``ckptsdk.state.TrainState``'s.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch

from ckptsdk.checkpoint.writing.staging import NO_STORAGE, tensor_key

__all__ = ["Deferral", "held_tensors", "step_only_keys"]


def step_only_keys(optimizers: Sequence[torch.optim.Optimizer]) -> set[tuple[int, torch.dtype, tuple[int, ...]]]:
    """Keys (data pointer, dtype, shape) of the tensors only ``optimizer.step()`` changes: the
    optimizers' parameters and their state tensors (see ``staging.tensor_key``)."""
    keys = {tensor_key(t) for t in held_tensors(optimizers)}
    keys.discard(NO_STORAGE)
    return keys


def held_tensors(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The optimizers' parameters, then their state tensors, in their order."""
    objects: list[torch.Tensor] = []
    for opt in optimizers:
        for group in opt.param_groups:
            objects.extend(group["params"])
        objects.extend(  # one comprehension: a generator per entry cost more than the lookups saved
            [
                v
                for entry in opt.state.values()
                if type(entry) is dict or isinstance(entry, Mapping)
                for v in entry.values()
                if isinstance(v, torch.Tensor)
            ]
        )
    return objects


class Deferral:
    """Per tensor of a saved tree, whether only ``optimizer.step()`` changes it; what it took to
    answer is kept for the next save.

    Worked out in full, the answer costs a pointer lookup for every tensor no optimizer holds
    (a module's buffers) and took a tenth of the training thread's time in ``save()``. It depends
    only on which objects are saved and which the optimizers hold. While the optimizers hold the
    very objects of the last save (an identity check, no call per tensor), their lookup tables
    are kept, and a saved tensor that is the very object of the last save keeps its answer: only
    the new ones (the RNG keys, fresh at each save) are looked up. What identity does not see (a
    tensor given another storage in place, ``p.data = x``) only changes a match by pointer between
    two distinct objects, which a job does not make; and a stale answer is never a wrong
    checkpoint: False copies at ``save()`` (always safe), True defers a copy whose source's version
    counter is checked (a change fails the save, loudly). It holds the last save's tensors (alive
    anyway while they are the job's) until the next save: a model or optimizer a job drops from
    its ``TrainState`` between saves is freed at the next save, or with the ``TrainState``.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=0.1)
        >>> Deferral().flags([opt], [p, torch.zeros(2)])
        [True, False]
    """

    def __init__(self) -> None:
        self._held: _Held | None = None
        self._tensors: list[torch.Tensor] = []
        self._flags: list[bool] = []

    def flags(self, optimizers: Sequence[torch.optim.Optimizer], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Per tensor of ``tensors``, whether it is one of :func:`step_only_keys` (not empty)."""
        objects = held_tensors(optimizers)
        held = self._held
        if held is None or not _same_objects(held.objects, objects):
            held = self._held = _Held(objects)
            self._tensors, self._flags = [], []
        look = held.flag
        if len(tensors) == len(self._tensors):
            flags = [f if t is o else look(t) for t, o, f in zip(tensors, self._tensors, self._flags, strict=True)]
        else:
            flags = [look(t) for t in tensors]
        # Kept alive here, so an object compared later is never a new one at a reused address.
        self._tensors, self._flags = list(tensors), flags
        return list(flags)


def _same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class _Held:
    """The tensors the optimizers hold, found by object and by pointer (built once, when needed)."""

    def __init__(self, objects: list[torch.Tensor]) -> None:
        self.objects = objects
        self._by_id = {id(v): v for v in objects}
        self._by_pointer: dict[int, torch.Tensor] | None = None

    def flag(self, t: torch.Tensor) -> bool:
        # tensor_key()'s rule (pointer, dtype, shape; never empty) without a tuple per tensor. The
        # very objects (keep_vars, the optimizer's own state) are found by id(): both are alive,
        # so an equal id is the same tensor. Only the others go by pointer, where two stepped
        # tensors at one keep the last: one matching the other is copied at save() (always safe).
        s = self._by_id.get(id(t))
        if s is not None:
            return t.numel() > 0
        if self._by_pointer is None:
            self._by_pointer = {v.data_ptr(): v for v in self._by_id.values()}
        s = self._by_pointer.get(t.data_ptr())
        return s is not None and s.dtype is t.dtype and s.shape == t.shape and t.numel() > 0
