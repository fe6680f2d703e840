"""A DataLoader whose position is part of the training state: it resumes mid-epoch bit for bit.

``ckptsdk.DataLoader`` wraps ``torch.utils.data.DataLoader`` over a map-style dataset. Its state
is (seed, epoch, batches done); the order of an epoch, the workers' ``base_seed`` and the RNG
seeds of every batch's fetch are functions of (seed, epoch, batch), so a restore skips the
consumed batches by index, never by loading them. A torchdata ``StatefulDataLoader`` put in a
``TrainState`` is adapted here to resume bit for bit too (``check_loader``). Storage and the step
log do not belong here.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

import numpy as np
import torch
import torch.utils.data as tud

from ckptsdk.errors import ConfigError, StateMismatchError
from ckptsdk.rng import capture_rng, restore_rng

logger = logging.getLogger(__name__)

__all__ = ["LOADER_FORMAT", "WORKER_RNG_FORMAT", "DataLoader", "check_loader", "loaders_of", "resolve_position"]

LOADER_FORMAT: Final = "ckptsdk.loader/1"
# Arguments that would take the order (or its bookkeeping) away from us.
_REFUSED = ("sampler", "batch_sampler", "in_order")
_SEED_BITS = 53  # stored as a JSON int: exact in every JSON reader, doubles included


def _derive(seed: int, *parts: object) -> int:
    """A seed for one purpose of one (epoch, batch): a hash, so that no two purposes share a stream."""
    text = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> (64 - _SEED_BITS)


class _Batch(list[int]):
    """The indices of one batch, with the seed its fetch runs under (travels to a worker by pickle)."""

    seed: int = 0


@contextmanager
def _kept_rngs() -> Iterator[None]:
    # Fetching in the main process (num_workers=0) must not move the training process's RNGs:
    # the training step after it would draw differently than in a run with workers.
    torch_state = torch.default_generator.get_state()
    py_state = random.getstate()
    np_state = np.random.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)


class _SeededFetch(tud.Dataset[Any]):
    """The user's dataset, fetched batch by batch under the batch's own seed.

    Why per batch: a worker's RNG stream otherwise depends on which batches that worker fetched
    before (round robin), which a resume that skips batches cannot reproduce; seeded by (seed,
    epoch, batch) the random augmentation of a batch is the same whatever came before it and
    whatever the number of workers.
    """

    def __init__(self, dataset: tud.Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: _Batch) -> list[Any]:
        if tud.get_worker_info() is None:
            with _kept_rngs():
                return self._fetch(batch)
        return self._fetch(batch)

    def _fetch(self, batch: _Batch) -> list[Any]:
        # Only the CPU generator: torch.manual_seed would also reseed CUDA in the main process.
        torch.default_generator.manual_seed(batch.seed)
        random.seed(batch.seed)
        np.random.seed(batch.seed % (1 << 32))
        getitems = getattr(self.dataset, "__getitems__", None)
        if callable(getitems):
            return list(getitems(list(batch)))
        return [self.dataset[i] for i in batch]


class _Plan(tud.Sampler[list[int]]):
    """The batch sampler: the remaining batches of the loader's current epoch, in order."""

    def __init__(self, owner: DataLoader) -> None:
        self.owner = owner

    def __len__(self) -> int:
        return len(self.owner)

    def __iter__(self) -> Iterator[list[int]]:
        owner = self.owner
        order = owner._order(owner.epoch)
        for b in range(owner._start, len(owner)):
            batch = _Batch(order[b * owner.batch_size : (b + 1) * owner.batch_size])
            batch.seed = _derive(owner.seed, owner.epoch, b, "fetch")
            yield batch


class DataLoader:
    """``torch.utils.data.DataLoader`` for a map-style dataset, resumable mid-epoch; put it in the
    ``TrainState``.

    Iterating yields the remaining batches of the current epoch, then moves to the next epoch
    (``epoch`` + 1, ``batch_idx`` 0). Random augmentation in workers must draw from the global
    torch / ``random`` / numpy RNGs, which are seeded per batch; a generator a dataset makes for
    itself (e.g. in ``worker_init_fn``) is not reproduced.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch.
        shuffle: a new order every epoch, drawn from (``seed``, epoch).
        seed: the loader's seed (an int); default the ``generator``'s initial seed, else one
            drawn from torch's global RNG. A restore takes the saved one when neither was given;
            a seed or generator that gives another one is refused (the order would differ).
        drop_last: drop the last incomplete batch.
        generator: accepted for ``torch.utils.data.DataLoader`` compatibility; only its
            ``initial_seed()`` is used.
        **options: passed to ``torch.utils.data.DataLoader`` (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``worker_init_fn``, ``persistent_workers``, ``prefetch_factor``...).

    Raises:
        ConfigError: an iterable dataset, or ``sampler``/``batch_sampler``/``in_order``.

    Example:
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10))
        >>> loader = DataLoader(ds, batch_size=4, shuffle=True, seed=1)
        >>> first = [b[0].tolist() for b in loader]                # epoch 0, 3 batches
        >>> saved = None
        >>> for i, (x,) in enumerate(loader):                      # epoch 1
        ...     if i == 0:
        ...         saved = loader.state_dict()                    # after 1 batch of epoch 1
        >>> again = DataLoader(ds, batch_size=4, shuffle=True)
        >>> again.load_state_dict(saved)
        >>> (again.epoch, again.batch_idx, len([b for b in again]))  # resumes with 2 batches left
        (1, 1, 2)
    """

    def __init__(
        self,
        dataset: tud.Dataset[Any],
        batch_size: int = 1,
        shuffle: bool = False,
        *,
        seed: int | None = None,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        **options: Any,
    ) -> None:
        if isinstance(dataset, tud.IterableDataset):
            raise ConfigError(
                "ckptsdk.DataLoader needs a map-style dataset (indexable, with a length): an "
                f"IterableDataset ({type(dataset).__name__}) cannot be skipped by index. Use "
                "torchdata's StatefulDataLoader with a dataset that has state_dict()/"
                "load_state_dict(), and put that loader in the TrainState"
            )
        bad = [name for name in _REFUSED if name in options]
        if bad:
            raise ConfigError(
                f"ckptsdk.DataLoader does not take {', '.join(bad)}: it draws each epoch's order "
                "itself to resume it by index; pass shuffle=True/False and seed=..."
            )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        # A seed the user chose (or a generator's) is checked against a saved one; a drawn one
        # is only a fresh run's and gives way to it.
        self._seed_given = seed is not None or generator is not None
        if seed is None:
            seed = generator.initial_seed() if generator is not None else int(torch.randint(0, 1 << 62, ()).item())
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.seed = int(seed) & ((1 << _SEED_BITS) - 1)
        self.epoch = 0
        self.batch_idx = 0  # batches of `epoch` already yielded
        self._start = 0  # where the running iteration began (read by _Plan)
        self._size = len(dataset)  # type: ignore[arg-type]
        self._order_cache: tuple[int, list[int]] | None = None
        self._last_digest: str | None = None
        # The generator torch's loader draws its workers' base_seed from at iter(): reset per
        # epoch, so a worker_init_fn that reads torch.initial_seed() sees the same as before a kill.
        self._base = torch.Generator()
        self._loader = tud.DataLoader(_SeededFetch(dataset), batch_sampler=_Plan(self), generator=self._base, **options)

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self._size // self.batch_size
        return -(-self._size // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            g = torch.Generator().manual_seed(_derive(self.seed, epoch, "order"))
            order = torch.randperm(self._size, generator=g).tolist()
        else:
            order = list(range(self._size))
        self._order_cache = (epoch, order)
        return order

    def __iter__(self) -> Iterator[Any]:
        if self.batch_idx >= len(self):  # saved (or stopped) after an epoch's last batch
            self.epoch, self.batch_idx = self.epoch + 1, 0
        epoch, self._start = self.epoch, self.batch_idx
        order = self._order(epoch)
        self._base.manual_seed(_derive(self.seed, epoch, "workers"))
        for batch in self._loader:
            b = self.batch_idx
            indices = np.asarray(order[b * self.batch_size : (b + 1) * self.batch_size], dtype="<i8")
            self._last_digest = f"{epoch}:{b}:{hashlib.blake2b(indices.tobytes(), digest_size=8).hexdigest()}"
            self.batch_idx = b + 1
            yield batch
        self.epoch, self.batch_idx = epoch + 1, 0

    @property
    def last_batch_digest(self) -> str | None:
        """``"epoch:batch:hash"`` of the sample indices of the batch last yielded (None before one).

        The manager logs it with every step (the audit compares it between attempts).
        """
        return self._last_digest

    def batch_digest(self) -> str | None:
        """:attr:`last_batch_digest`, as the callable the run log's ``watch_data`` takes."""
        return self._last_digest

    def state_dict(self) -> dict[str, Any]:
        """The position: seed, epoch, batches done, and what the order depends on (checked at load)."""
        return {
            "format": LOADER_FORMAT,
            "seed": self.seed,
            "epoch": self.epoch,
            "batch_idx": self.batch_idx,
            "samples": self._size,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def mismatches(self, state: Any) -> list[str]:
        """Every way a saved ``state`` does not fit this loader (empty when it fits): another
        kind of state, or another dataset size, batch size, shuffle, drop_last or chosen seed.

        ``TrainState`` asks before it loads any object, so a loader that does not fit leaves
        the model untouched too.
        """
        if not isinstance(state, Mapping) or state.get("format") != LOADER_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            return [
                f"loader: not a ckptsdk.DataLoader state (format {found!r}, expected {LOADER_FORMAT!r}): "
                "was another kind of loader saved under this name?"
            ]
        problems = [
            f"loader: {name} was {state.get(name)!r} when saved, is {now!r} now"
            for name, now in (
                ("samples", self._size),
                ("batch_size", self.batch_size),
                ("shuffle", self.shuffle),
                ("drop_last", self.drop_last),
            )
            if state.get(name) != now
        ]
        if self._seed_given and state.get("seed") != self.seed:
            problems.append(
                f"loader: seed was {state.get('seed')!r} when saved, is {self.seed!r} now (pass "
                f"seed={state.get('seed')!r}, or leave seed and generator out to take the saved one)"
            )
        return problems

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` was saved: the next iteration yields the batches not yet done.

        Raises:
            StateMismatchError: the state is not a ckptsdk loader's, or was saved over another
                dataset size, batch size, shuffle, drop_last or a seed given now (the order would
                not be the same); ``.mismatches`` lists each (see :meth:`mismatches`).
        """
        problems = self.mismatches(state)
        if problems:
            raise StateMismatchError(
                "the saved loader position does not fit this loader (the order of the remaining "
                "batches would differ): " + "; ".join(problems) + ". Build the loader as it was built "
                "when the checkpoint was saved",
                mismatches=problems,
            )
        self.seed, self.epoch, self.batch_idx = int(state["seed"]), int(state["epoch"]), int(state["batch_idx"])
        if self.batch_idx >= len(self):  # saved at an epoch's last batch: that epoch is done
            self.epoch, self.batch_idx = self.epoch + 1, 0
        self._order_cache = None
        self._last_digest = None
        logger.info("loader resumes at epoch %d after %d batch(es)", self.epoch, self.batch_idx)


def loaders_of(state: Any) -> dict[str, DataLoader]:
    """The ckptsdk loaders among a ``TrainState``'s objects (name -> loader)."""
    objects = getattr(state, "objects", None)
    if not isinstance(objects, Mapping):
        return {}
    return {name: obj for name, obj in objects.items() if isinstance(obj, DataLoader)}


def resolve_position(state: Any, epoch: int | None, batch_idx: int | None) -> tuple[int | None, int | None]:
    """``save()``'s position, checked against the one ckptsdk loader of ``state`` (if exactly one).

    Missing values are taken from the loader. (e, number of batches) and (e + 1, 0) are the same
    position (a save at an epoch's last batch).

    Raises:
        ConfigError: ``epoch``/``batch_idx`` disagree with the loader (says what to pass).
    """
    found = loaders_of(state)
    if len(found) != 1:
        return epoch, batch_idx
    ((name, loader),) = found.items()

    def norm(e: int, b: int) -> tuple[int, int]:
        return (e + 1, 0) if b >= len(loader) else (e, b)

    want = (loader.epoch, loader.batch_idx)
    got = (loader.epoch if epoch is None else epoch, loader.batch_idx if batch_idx is None else batch_idx)
    if norm(*got) != norm(*want):
        raise ConfigError(
            f"save(epoch={epoch}, batch_idx={batch_idx}) disagrees with the TrainState's loader "
            f"{name!r}, which has yielded {want[1]} batch(es) of epoch {want[0]}: batch_idx means the "
            "batches of the epoch already done (i + 1 for `for i, batch in enumerate(loader)`); pass "
            f"epoch={name}.epoch, batch_idx={name}.batch_idx, or leave both out"
        )
    return got


def check_loader(name: str, obj: Any) -> None:
    """Refuse, when a ``TrainState`` is built, a loader whose resume would be silently wrong, and
    make a torchdata ``StatefulDataLoader`` resume bit for bit (see :func:`_adopt_stateful`).

    Raises:
        ConfigError: a plain ``torch.utils.data.DataLoader`` (it has no position to save), or a
            torchdata ``StatefulDataLoader`` built with ``generator=``: torchdata 0.11 resumes
            the interrupted epoch, but the epochs after it draw another order (measured).
    """
    if isinstance(obj, tud.DataLoader) and not callable(getattr(obj, "state_dict", None)):
        raise ConfigError(
            f"TrainState({name}=...) got a torch DataLoader, which has no position to save: build "
            "it as ckptsdk.DataLoader(dataset, batch_size=..., shuffle=..., seed=..., num_workers=...) "
            "(same arguments), or use torchdata's StatefulDataLoader"
        )
    if type(obj).__name__ == "StatefulDataLoader":
        if getattr(obj, "generator", None) is not None:
            raise ConfigError(
                f"TrainState({name}=StatefulDataLoader(..., generator=g)): after a restore torchdata "
                "replays the interrupted epoch exactly but draws a different order for every epoch "
                "after it. Leave generator=None (the order then comes from torch's global RNG, which "
                "the TrainState saves and restores) or use ckptsdk.DataLoader(..., seed=...)"
            )
        dataset = getattr(obj, "dataset", None)
        if isinstance(dataset, tud.IterableDataset):
            if not callable(getattr(dataset, "state_dict", None)):
                logger.warning(
                    "TrainState(%s=StatefulDataLoader over %s): an iterable dataset without "
                    "state_dict()/load_state_dict() is resumed by re-reading the consumed batches, and "
                    "only if its iteration is deterministic; give it state_dict()/load_state_dict()",
                    name,
                    type(dataset).__name__,
                )
        elif getattr(obj, "num_workers", 0) > 0 and not hasattr(dataset, "__dict__"):
            logger.warning(
                "TrainState(%s=StatefulDataLoader): its dataset (%s) has no __dict__, so the random "
                "state of its workers cannot travel with the loader's state: random augmentation in "
                "the workers will differ after a resume. Use num_workers=0 or ckptsdk.DataLoader",
                name,
                type(dataset).__name__,
            )
        _adopt_stateful(obj)


WORKER_RNG_FORMAT: Final = "ckptsdk.worker_rng/1"


def _adopt_stateful(loader: Any) -> None:
    """Make a ``StatefulDataLoader`` (``generator=None``) resume bit for bit; idempotent.

    Two things differ after torchdata 0.11 restores mid-epoch, both fixed here on the instance
    (its class and the user's dataset object are left alone):

    - the resumed ``iter()`` builds its iterator from the saved state and, on the way, draws the
      workers' ``base_seed`` from torch's global RNG (then overwrites it with the saved one); the
      uninterrupted run drew it at the epoch's start, before the save, so every later draw
      (dropout, augmentation at 0 workers) would be one behind. :class:`_KeepRngOnResume` puts
      the global RNGs back when, and only when, building the resumed iterator moved them;
    - with workers, torchdata saves each worker's dataset state but not its RNGs, and restarts
      the workers from ``base_seed + worker_id``: :class:`_WorkerRng` (the loader's
      ``worker_init_fn``, wrapping the user's) gives the dataset copy in each worker a
      ``state_dict()`` that carries that worker's RNG states, which torchdata then snapshots
      with every batch and restores in the resumed worker.
    """
    if not (callable(getattr(type(loader), "_get_iterator", None)) and hasattr(loader, "next_iter_state")):
        # Another torchdata than the 0.11 this was written against: say so rather than guess.
        logger.warning(
            "this StatefulDataLoader has no _get_iterator()/next_iter_state (another torchdata?): its "
            "resumed iter() may draw from the global RNG, so the resume may not be bit-exact"
        )
    elif not isinstance(loader.__dict__.get("_get_iterator"), _KeepRngOnResume):
        loader._get_iterator = _KeepRngOnResume(loader)
    if not isinstance(getattr(loader, "worker_init_fn", None), _WorkerRng):
        loader.worker_init_fn = _WorkerRng(loader.worker_init_fn)


class _KeepRngOnResume:
    """The loader's ``_get_iterator``: a resumed one may not move the training process's RNGs.

    Why undo every change rather than one draw: nothing the resumed iterator does at that point
    happens in the uninterrupted run (which is mid-epoch, or past the epoch a resumed iter() ends
    empty), and the saved RNG states already hold whatever torchdata replays (fetches since its
    last snapshot). Comparing before and after keeps this right once torchdata stops drawing.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.build = type(loader)._get_iterator

    def __call__(self) -> Any:
        if getattr(self.loader, "next_iter_state", None) is None:  # a new epoch: draws as usual
            return self.build(self.loader)
        before = capture_rng()
        iterator = self.build(self.loader)
        moved = _moved(before, capture_rng())
        if moved:
            restore_rng(before)
            logger.debug("put back %s, drawn from by the resumed StatefulDataLoader iter()", ", ".join(moved))
        return iterator


def _moved(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Which global RNGs differ between two ``capture_rng()`` trees."""
    b, a = before["numpy"], after["numpy"]
    numpy_same = b["state"]["pos"] == a["state"]["pos"] and np.array_equal(b["state"]["key"], a["state"]["key"])
    changed = {
        "torch's RNG": not torch.equal(before["torch"], after["torch"]),
        "numpy's RNG": not (numpy_same and (b["has_gauss"], b["gauss"]) == (a["has_gauss"], a["gauss"])),
        "random's RNG": before["python"] != after["python"],
        "CUDA's RNG": [t.tolist() for t in before["cuda"] or []] != [t.tolist() for t in after["cuda"] or []],
    }
    return [name for name, moved in changed.items() if moved]


class _WorkerRng:
    """A ``worker_init_fn`` (the user's first) after which the worker's dataset saves its RNGs.

    Runs in each worker before torchdata restores the worker's saved state, so a resumed
    worker's ``load_state_dict`` puts back the RNG states of the worker at its last batch. A
    dataset with its own ``state_dict`` keeps it (nested under ``"dataset"``); a state saved
    without this (an older checkpoint) goes to the dataset's own ``load_state_dict`` as it is.
    Picklable (the spawn context sends it to the workers).
    """

    def __init__(self, user: Any) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        if self.user is not None:
            self.user(worker_id)
        info = tud.get_worker_info()
        dataset = getattr(info, "dataset", None)
        if dataset is None or isinstance(dataset, tud.IterableDataset):
            return
        own_save, own_load = getattr(dataset, "state_dict", None), getattr(dataset, "load_state_dict", None)
        own = callable(own_save) and callable(own_load)

        def state_dict() -> dict[str, Any]:
            out: dict[str, Any] = {"format": WORKER_RNG_FORMAT, "rng": capture_rng()}
            if own:
                out["dataset"] = own_save()  # type: ignore[misc]
            return out

        def load_state_dict(state: Mapping[str, Any]) -> None:
            if isinstance(state, Mapping) and state.get("format") == WORKER_RNG_FORMAT:
                if own and state.get("dataset") is not None:
                    own_load(state["dataset"])  # type: ignore[misc]
                restore_rng(state["rng"])  # last: the state was taken after everything else
            elif own:
                own_load(state)  # type: ignore[misc]

        try:  # instance attributes of the worker's copy: the main process's dataset is untouched
            dataset.state_dict = state_dict
            dataset.load_state_dict = load_state_dict
        except (AttributeError, TypeError):
            logger.warning(
                "DataLoader worker %d: cannot give %s a state_dict() (no __dict__): its random "
                "state will not be restored on resume",
                worker_id,
                type(dataset).__name__,
            )
