"""What a training job checkpoints: TrainState bundles its objects and the RNG states.

``TrainState`` checks a saved tree against the live objects before loading anything; the RNG
states it carries are ``ckptsdk.rng``'s. Encoding to tensors/JSON is codec.py's job; storage is the manager's.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ckptsdk.checkpoint.writing.deferral import Deferral, step_only_keys
from ckptsdk.errors import ConfigError, StateMismatchError
from ckptsdk.format import codec
from ckptsdk.loader import DataLoader, check_loader
from ckptsdk.rng import capture_rng, check_rng, problem_message, restore_rng

logger = logging.getLogger(__name__)

__all__ = ["Restorable", "Stateful", "TrainState", "preflight", "torch_class", "with_tied"]

# What TrainState wraps: passed bare to save()/restore(), they are refused with a hint.
_BARE = (
    torch.nn.Module,
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    *((torch.amp.GradScaler,) if hasattr(torch.amp, "GradScaler") else ()),
)

# Optimizer state entries that have the shape of their parameter (torch.optim's built-ins).
_PARAM_SHAPED = frozenset(
    {"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum"}
    | {"grad_avg", "exp_inf", "prev", "ax", "mu_product_buf"}
)


@runtime_checkable
class Restorable(Protocol):
    """What ``restore()`` loads a checkpoint's tree into: a :class:`TrainState`, or an object of
    the job's (or an integration's) with ``load_state_dict``."""

    def load_state_dict(self, state_dict: dict[str, Any], /) -> object: ...


@runtime_checkable
class Stateful(Restorable, Protocol):
    """What ``save()`` reads besides a plain tree: ``state_dict()`` (and ``load_state_dict()``)."""

    def state_dict(self) -> Mapping[str, Any]: ...


def torch_class(obj: Any) -> str | None:
    """The torch.optim class an optimizer or LR scheduler is (None for anything else).

    A user's subclass maps to the torch class it derives from, so renaming it stays compatible
    while AdamW state restored into SGD is caught (torch itself would only fail at ``step()``).
    """
    if isinstance(obj, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
        for cls in type(obj).__mro__:
            if cls.__module__.startswith("torch.optim"):
                return f"{cls.__module__}.{cls.__qualname__}"
    return None


#: torch's own ``Module.state_dict``: a module using it takes ``keep_vars`` as documented.
_MODULE_STATE_DICT = torch.nn.Module.state_dict


def preflight(state: Any, call: str, *, encode: bool = True) -> None:
    """Refuse what ``save``/``restore`` cannot use, before anything is read, written or trained.

    Args:
        state: what the caller passed.
        call: "save" or "restore", for the message.
        encode: also encode a ``TrainState``'s live objects once (storing nothing), so that an
            object the codec refuses fails here rather than at the first save, hours later.

    Raises:
        ConfigError: ``state`` is a bare module, optimizer, scheduler or GradScaler.
        UnsupportedStateError: an object's state holds something the codec cannot store.
    """
    if isinstance(state, _BARE):
        kind = type(state).__name__
        raise ConfigError(
            f"{call}() got a bare {kind}; it takes a TrainState, which names each object and "
            f"carries the RNG states: {call}(TrainState(model=model, optimizer=opt, ...)), with the "
            "same names at save() and restore()"
        )
    if encode and isinstance(state, TrainState):
        codec.check(state.state_dict())


class TrainState:
    """The objects of a training job, checkpointed together with the RNG states.

    Args:
        **objects: name -> anything with ``state_dict()`` and ``load_state_dict()`` (a model,
            an optimizer, an LR scheduler, a GradScaler, a user object). The tree also records
            which torch class each optimizer and scheduler is, checked before loading.

    Raises:
        ConfigError: an object lacks ``state_dict``/``load_state_dict``.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState(model=model, optimizer=opt)
        >>> tree = state.state_dict()        # {"objects": {...}, "rng": {...}, "types": {...}}
        >>> sorted(tree["objects"])
        ['model', 'optimizer']
        >>> state.load_state_dict(tree)      # checks first, then loads, then restores the RNGs
    """

    def __init__(self, **objects: Stateful) -> None:
        for name, obj in objects.items():
            check_loader(name, obj)  # a loader whose resume would be silently wrong is refused
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ConfigError(
                    f"TrainState({name}=...) got a {type(obj).__name__}, which has no "
                    "state_dict()/load_state_dict(); wrap it in an object that has both"
                )
        self.objects: dict[str, Any] = dict(objects)  # Any: each is used as its own class
        # A pipelined save copies parameters and optimizer state while the next forward and
        # backward run; each optimizer's next step() first waits for that copy (see hold_steps).
        self._hold: Callable[[], None] | None = None
        #: Set while no optimizer's ``step()`` runs: a background save's tensor writes wait on it
        #: (briefly) so as not to take a core from the step's threads (``checkpoint/writing/pacing.py``).
        self.steps_idle = threading.Event()
        self.steps_idle.set()
        self._deferral = Deferral()  # which tensors a pipelined save defers, kept between saves
        self._hooks = [opt.register_step_pre_hook(self._before_step) for opt in self.optimizers()]
        self._hooks += [opt.register_step_post_hook(self._after_step) for opt in self.optimizers()]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers among the objects (their ``step()`` waits for a pipelined snapshot)."""
        return [_stepped(obj) for obj in self.objects.values() if isinstance(obj, torch.optim.Optimizer)]

    def step_only_tensors(self) -> set[tuple[int, torch.dtype, tuple[int, ...]]]:
        """Keys (data pointer, dtype, shape) of the tensors only ``optimizer.step()`` changes.

        These are the held optimizers' parameters and their state tensors. A pipelined save
        copies them in the background; everything else (module buffers such as BatchNorm's
        running stats, which change in forward; schedulers; RNG states) is copied at ``save()``.
        """
        return step_only_keys(self.optimizers())

    def step_only_flags(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Per tensor of a saved tree: whether it is one only ``optimizer.step()`` changes (see
        :meth:`step_only_tensors`), so a pipelined save may copy it in the background."""
        return self._deferral.flags(self.optimizers(), tensors)

    def frozen_flags(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Per tensor of a saved tree: whether it is a frozen weight (a module's parameter with
        ``requires_grad=False``), which ``frozen="reference"`` may record by digest."""
        frozen = {
            p.data_ptr()
            for obj in self.objects.values()
            if isinstance(obj, torch.nn.Module)
            for p in obj.parameters()
            if not p.requires_grad and p.numel()
        }
        return [t.numel() > 0 and t.data_ptr() in frozen for t in tensors]

    def hold_steps(self, wait: Callable[[], None] | None) -> None:
        """Make every held optimizer's next ``step()`` call ``wait()`` first (None: stop).

        The save pipeline passes the pending snapshot's ``wait_copied``. A step GradScaler skips
        (inf/NaN gradients) changes nothing, so it needs no wait.
        """
        self._hold = wait

    def _before_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        wait = self._hold
        if wait is not None:
            wait()
        self.steps_idle.clear()

    def _after_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        # Not called when step() raises: the writes' wait for it is bounded (pacing.MAX_WAIT_S).
        self.steps_idle.set()

    def state_dict(self, *, keep_vars: bool = False) -> dict[str, Any]:
        """The whole state as a tree: ``{"objects": {name: obj.state_dict()}, "rng": ...}``.

        Tensors in it are the live ones (not copies); snapshot them before training goes on.
        Never draws from the global RNGs.

        Args:
            keep_vars: modules' parameters and buffers as they are (``nn.Parameter``, not
                detached), as torch's own ``keep_vars``: what a save uses, which copies them
                anyway and so skips a ``detach()`` per tensor. Modules overriding
                ``state_dict`` are asked without it.
        """
        return {
            "objects": {
                name: obj.state_dict(keep_vars=True)
                if keep_vars and type(obj).state_dict is _MODULE_STATE_DICT
                else obj.state_dict()
                for name, obj in self.objects.items()
            },
            "rng": capture_rng(),
            # Which torch class each optimizer/scheduler is: its state_dict does not say.
            "types": {n: t for n, o in self.objects.items() if (t := torch_class(o)) is not None},
        }

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """Tensor path (as the codec names it) -> the live module tensor a restore may read
        straight into, detached: plain (no subclass), CPU, floating point, contiguous, of modules
        that load as stock torch does. The rest is copied in by ``load_state_dict`` as before.
        These are also what a failed read sets to NaN, so only what can be filled is offered
        (``TensorFile.allocate`` checks the memory again for any caller).

        Stock only: a module whose loading transforms what it is given (its own
        ``_load_from_state_dict``, load or state-dict hooks: a transpose, a rename) must see the
        checkpoint's tensor, not its own memory already overwritten.
        """
        out: dict[str, torch.Tensor] = {}
        for name, obj in self.objects.items():
            if not (isinstance(obj, torch.nn.Module) and _loads_as_stock(obj)):
                continue
            prefix = f"objects/{codec.path_component(name)}/"
            for key, t in obj.state_dict(keep_vars=True).items():
                if (
                    type(t) in _PLAIN  # not a subclass (a DTensor's memory is a shard of what it shows)
                    and t.device.type == "cpu"
                    and t.is_floating_point()
                    and t.layout == torch.strided
                    and t.is_contiguous()
                    and not (t.is_conj() or t.is_neg())
                ):
                    out[prefix + codec.path_component(key)] = t.detach()
        return out

    def tensors_at(self, paths: Collection[str]) -> dict[str, torch.Tensor]:
        """Path (as the codec names it) -> the live tensor there, of any device and dtype, for
        the ``paths`` the live state holds (restore proves a checkpoint's referenced base on
        them, then loads each onto itself). Nothing is copied or written."""
        wanted = set(paths)
        tensors, _ = codec.encode({"objects": {name: obj.state_dict() for name, obj in self.objects.items()}})
        return {p: t for p, t in tensors.items() if p in wanted}

    def check_fit(self, tree: Any, *, strict: bool = True) -> None:
        """Raise ``StateMismatchError`` unless ``tree`` fits the live objects, looking at its
        structure only: restore calls it on a tree whose tensors' bytes are not read yet (their
        values, the RNG states', are checked once they are). ``strict``: see :meth:`mismatches`."""
        _refuse_unfit(self.mismatches(tree, strict=strict, values=False))

    def mismatches(self, tree: Any, *, strict: bool = True, values: bool = True) -> list[str]:
        """Every way ``tree`` does not fit the live objects (empty when it fits).

        Args:
            tree: a tree from ``state_dict()`` (usually through the codec and back).
            strict: also count objects and module keys present on one side only.
            values: also check the RNG states' values (False: parts and types only, see ``check_fit``).
        """
        if not isinstance(tree, Mapping) or not isinstance(tree.get("objects"), Mapping):
            return ["the tree has no 'objects' dict; it is not a TrainState.state_dict()"]
        saved = tree["objects"]
        problems: list[str] = []
        types = tree.get("types")
        for name, obj in self.objects.items():
            was = types.get(name) if isinstance(types, Mapping) else None  # None: older checkpoint
            now = torch_class(obj)
            if was is not None and now is not None and was != now:
                problems.append(
                    f"{name}: the checkpoint holds the state of a {was}, the live object "
                    f"is a {now}; build the same class as when it was saved"
                )
        if strict:
            problems += [
                f"objects: {n!r} is in this TrainState but not in the checkpoint"
                for n in self.objects
                if n not in saved
            ]
            problems += [
                f"objects: {n!r} is in the checkpoint but not in this TrainState"
                for n in saved
                if n not in self.objects
            ]
        for name, obj in self.objects.items():
            if name in saved:
                problems += _object_mismatches(name, obj, saved[name], strict=strict)
        if "rng" not in tree:
            problems.append("rng: missing from the checkpoint")
        else:
            problems += check_rng(tree["rng"], values=values)
        return problems

    def load_state_dict(self, tree: Mapping[str, Any], *, strict: bool = True) -> None:
        """Check ``tree`` against the live objects, then load every object and the RNG states.

        Nothing is loaded unless the whole tree fits. With ``strict=False``, objects and
        module keys present on one side only are skipped (shape mismatches still fail).

        Raises:
            StateMismatchError: the tree does not fit; ``.mismatches`` lists every problem.
        """
        _refuse_unfit(self.mismatches(tree, strict=strict))
        self._load_fitted(tree, strict=strict)

    def _load_fitted(self, tree: Mapping[str, Any], *, strict: bool = True) -> None:
        """:meth:`load_state_dict` without its check: for a tree ``check_fit`` already passed
        whose RNG values ``check_rng`` passed once read (``CheckpointReader.read_tree``, which
        ``CheckpointManager.restore`` loads this way: the second check was 1 ms of a 36 ms
        restore)."""
        for name, obj in self.objects.items():
            if name not in tree["objects"]:
                continue
            try:
                if isinstance(obj, torch.nn.Module):
                    obj.load_state_dict(_copied_in(obj, with_tied(obj, tree["objects"][name])), strict=strict)
                else:
                    obj.load_state_dict(tree["objects"][name])
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
                # Earlier objects are already loaded: say so, the caller must not train on.
                problem = f"{name}: load_state_dict failed: {exc}"
                raise StateMismatchError(
                    problem_message(
                        f"loading {name!r} failed (objects before it were already "
                        "loaded; rebuild the objects before retrying)",
                        [problem],
                    ),
                    mismatches=[problem],
                ) from exc
        restore_rng(tree["rng"])


def _refuse_unfit(problems: list[str]) -> None:
    if problems:
        raise StateMismatchError(
            problem_message("the checkpoint does not fit the live training state", problems), mismatches=problems
        )


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STOCK_LOADERS = (torch.nn.Module._load_from_state_dict, torch.nn.modules.batchnorm._NormBase._load_from_state_dict)


def _loads_as_stock(module: torch.nn.Module) -> bool:
    """Whether loading ``module`` only copies each tensor given into its own (see ``live_tensors``)."""
    top = type(module)
    if top.state_dict is not _MODULE_STATE_DICT or top.load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    return all(
        type(m)._load_from_state_dict in _STOCK_LOADERS
        and not (
            m._state_dict_hooks
            or m._state_dict_pre_hooks
            or m._load_state_dict_pre_hooks
            or m._load_state_dict_post_hooks
        )
        for m in module.modules()
    )


def _copied_in(module: torch.nn.Module, saved: Mapping[str, Any]) -> Mapping[str, Any]:
    """Copy saved CPU tensors into the module's live tensors with one plain memcpy each, and
    hand the live tensors back to ``load_state_dict`` in their place (its ``copy_`` of a tensor
    onto itself is a no-op, while its hooks and checks still run).

    Why: ``copy_`` splits every copy over torch's intra-op threads, which on a small busy VM
    wait on each other (twice the time of the read itself for ResNet-18). Entries whose dtype,
    shape, device or layout differ go through ``load_state_dict`` unchanged.
    """
    from ckptsdk.checkpoint.writing.staging import memcpy

    out: OrderedDict[str, Any] = OrderedDict(saved)
    with torch.no_grad():
        for key, live in module.state_dict(keep_vars=True).items():
            src = saved.get(key)
            if (
                isinstance(src, torch.Tensor)
                and isinstance(live, torch.Tensor)
                and src.data_ptr() != live.data_ptr()  # read straight into it (live_tensors): nothing to copy
                and src.device.type == "cpu"
                and live.device.type == "cpu"
                and src.dtype == live.dtype
                and src.shape == live.shape
                and src.is_contiguous()
                and live.is_contiguous()
                and not live.is_conj()
                and src.layout == torch.strided
                and live.layout == torch.strided
            ):
                memcpy(live.detach(), src)
                out[key] = live.detach()
    if hasattr(saved, "_metadata"):  # per-module versions (BatchNorm's num_batches_tracked rule)
        out._metadata = saved._metadata  # type: ignore[attr-defined]
    return out


def _object_mismatches(name: str, obj: Any, saved: Any, *, strict: bool) -> list[str]:
    if isinstance(obj, torch.nn.Module):
        return _module_mismatches(name, obj, saved, strict=strict)
    if isinstance(obj, torch.optim.Optimizer):
        return _optimizer_mismatches(name, obj, saved)
    if isinstance(obj, DataLoader):  # checked with the rest, before any object is loaded
        return [f"{name}: {p.removeprefix('loader: ')}" for p in obj.mismatches(saved)]
    return []


def _shape(x: Any) -> list[int] | None:
    return list(x.shape) if isinstance(x, (torch.Tensor, np.ndarray)) else None


def _view(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one: the same memory seen the same way (None: holds no memory)."""
    if t.numel() == 0 or t.layout != torch.strided or type(t) not in _PLAIN:
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def with_tied(module: torch.nn.Module, saved: Mapping[str, Any]) -> Mapping[str, Any]:
    """``saved`` plus each key it lacks that the live ``module`` ties to a key it holds.

    A tied weight (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is one tensor under
    two names: ``save_pretrained`` and safetensors' ``save_model`` write it once, so an imported
    HF checkpoint lacks the second name. Loading the saved name fills the live tensor both names
    show, so the missing name is given that same saved tensor: the live module, not a guess,
    says the two are one (same memory, dtype, shape and strides). ``saved`` itself is unchanged.
    """
    live = module.state_dict(keep_vars=True)
    missing = [k for k in live if k not in saved and isinstance(live[k], torch.Tensor)]
    if not missing:
        return saved
    held: dict[tuple[Any, ...], str] = {}
    for key, t in live.items():
        if key in saved and isinstance(t, torch.Tensor) and (v := _view(t)) is not None:
            held.setdefault(v, key)
    tied = {k: held[v] for k in missing if (v := _view(live[k])) is not None and v in held}
    if not tied:
        return saved
    out: OrderedDict[str, Any] = OrderedDict(saved)
    out.update((k, saved[partner]) for k, partner in tied.items())
    if hasattr(saved, "_metadata"):
        out._metadata = saved._metadata  # type: ignore[attr-defined]
    return out


def _module_mismatches(name: str, module: torch.nn.Module, saved: Any, *, strict: bool) -> list[str]:
    if not isinstance(saved, Mapping):
        return [f"{name}: expected a module state dict, got {type(saved).__name__}"]
    saved = with_tied(module, saved)
    live = module.state_dict()
    problems = []
    if strict:
        problems += [
            f"{name}: missing key {k!r} (in the live model, not in the checkpoint)" for k in live if k not in saved
        ]
        problems += [
            f"{name}: unexpected key {k!r} (in the checkpoint, not in the live model)" for k in saved if k not in live
        ]
    for key, value in live.items():
        if key in saved and _shape(saved[key]) != _shape(value):
            problems.append(
                f"{name}: {key!r} has shape {_shape(saved[key])} in the checkpoint, {_shape(value)} in the live model"
            )
    return problems


def _optimizer_mismatches(name: str, opt: torch.optim.Optimizer, saved: Any) -> list[str]:
    if not (
        isinstance(saved, Mapping)
        and isinstance(saved.get("param_groups"), list)
        and isinstance(saved.get("state"), Mapping)
    ):
        return [f"{name}: expected an optimizer state dict with 'state' and 'param_groups'"]
    groups = saved["param_groups"]
    if len(groups) != len(opt.param_groups):
        return [
            f"{name}: {len(groups)} param group(s) in the checkpoint, {len(opt.param_groups)} in the live optimizer"
        ]
    problems = []
    params: dict[Any, torch.Tensor] = {}
    for i, (group, live_group) in enumerate(zip(groups, opt.param_groups, strict=True)):
        ids = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(ids, list):
            problems.append(f"{name}: param group {i} has no 'params' list")
            continue
        if len(ids) != len(live_group["params"]):
            problems.append(
                f"{name}: param group {i} has {len(ids)} params in the checkpoint, "
                f"{len(live_group['params'])} in the live optimizer"
            )
            continue
        params.update(zip(ids, live_group["params"], strict=True))
    if problems:
        return problems
    for pid, entry in saved["state"].items():
        if pid not in params:
            problems.append(f"{name}: state for param {pid!r}, which no param group lists")
            continue
        if not isinstance(entry, Mapping):
            continue
        want = list(params[pid].shape)
        for key, value in entry.items():
            if key in _PARAM_SHAPED and _shape(value) is not None and _shape(value) != want:
                problems.append(
                    f"{name}: state[{pid!r}][{key!r}] has shape {_shape(value)} in "
                    f"the checkpoint, the live param has {want}"
                )
    return problems


def _stepped(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``step()`` really runs: a wrapper that subclasses ``Optimizer``
    without its ``__init__`` (accelerate's ``AcceleratedOptimizer``) has no hook registry and
    steps the optimizer it holds."""
    inner = getattr(opt, "optimizer", None)
    if not hasattr(opt, "_optimizer_step_pre_hooks") and isinstance(inner, torch.optim.Optimizer):
        return inner
    return opt
