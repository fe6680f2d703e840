"""The options of a CheckpointManager, grouped: what to keep, how the lease behaves, how saves run.

Each group is a frozen dataclass that checks its own values when it is made (a ``ConfigError``
naming the option, the value and what is allowed), so an option is validated once, whichever way
it came: a group the caller built, or the four flat keywords of the README's first loop
(``keep_last=``, ``keep=``, ``save_every=``, ``async_save=``). The other flat keywords of ckptsdk
0.1.0 still work until ``REMOVED_IN``, with a ``DeprecationWarning`` (:func:`deprecated_shorthand`).
Using the options (the lease, rotation, the save pipeline) does not belong here.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, SupportsIndex, TypeVar

from ckptsdk.checkpoint.pruning.rotation import LEFTOVER_GRACE_S, RETENTION_MODES, RetentionMode
from ckptsdk.checkpoint.retention import Rule
from ckptsdk.checkpoint.writing.sharing import FROZEN_MODES, FrozenMode
from ckptsdk.checkpoint.writing.staging import SNAPSHOT_MODES, SnapshotMode
from ckptsdk.errors import ConfigError
from ckptsdk.preemption import DEFAULT_DEADLINE

__all__ = [
    "DEPRECATED",
    "FLAT",
    "REMOVED_IN",
    "LeaseOptions",
    "Retention",
    "SaveOptions",
    "deprecated_shorthand",
    "grouped",
]

_Group = TypeVar("_Group", "Retention", "LeaseOptions", "SaveOptions")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    # Literal types say this to a type checker; a caller without one (or with a value from a
    # config file) learns it here, before anything is opened.
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_count(name: str, value: object, *, optional: bool, why: str = "") -> None:
    if value is None and optional:
        return
    # int first: isinstance against a runtime Protocol (SupportsIndex: numpy ints) costs microseconds.
    if isinstance(value, bool) or not isinstance(value, (int, SupportsIndex)) or operator.index(value) < 1:
        allowed = ">= 1 or None" if optional else ">= 1"
        raise ConfigError(f"{name} must be an integer {allowed}, got {value!r}{why}")


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints rotation keeps, and how the others go.

    Shorthand: ``CheckpointManager(keep_last=, keep=)``; ``keep_every=``, ``retention_mode=`` and
    ``leftover_grace=`` are deprecated flat keywords (see :data:`DEPRECATED`).

    Attributes:
        keep_last: committed checkpoints to keep (the newest is always kept).
        keep_every: also keep, forever, every checkpoint whose step is a multiple of this.
        keep: more keep rules, kept by union with ``keep_last`` / ``keep_every``: e.g.
            ``[keep.best("val_loss", 2), keep.every_seconds(3600)]`` from :mod:`ckptsdk.keep`.
            They are judged from the committed manifests (a metric a save passes in
            ``metrics``), so a restart, a takeover and ``gc`` decide alike. Stored as a tuple;
            that each is a rule is checked by the rotation that applies them.
        mode: ``"delete"`` rotated-out checkpoints, or ``"recycle"`` the oldest one's file for
            the next save (renamed and rewritten in place, so nothing full-size goes to Drive's
            trash; see docs/DRIVE.md). None: ``"recycle"`` where the store has a trash and can
            rewrite in place (Drive), else ``"delete"``.
        leftover_grace: seconds an uncommitted folder of an earlier writer must have been silent,
            by the store's own times, before it is removed where the store has no
            compare-and-swap (Drive: another VM may still be uploading it). Elsewhere such
            folders go at once.

    Example:
        >>> Retention(keep_last=5, keep_every=1000).mode is None
        True
    """

    #: The manager's flat keywords for these fields (flat keyword -> field), deprecated ones too.
    SHORTHAND: ClassVar[Mapping[str, str]] = {
        "keep_last": "keep_last",
        "keep_every": "keep_every",
        "keep": "keep",
        "retention_mode": "mode",
        "leftover_grace": "leftover_grace",
    }

    keep_last: int = 3
    keep_every: int | None = None
    keep: Rule | Sequence[Rule] = ()
    mode: RetentionMode | None = None
    leftover_grace: float = LEFTOVER_GRACE_S

    def __post_init__(self) -> None:
        if not isinstance(self.keep, tuple):  # a list or one rule: a tuple keeps the group hashable
            object.__setattr__(self, "keep", (self.keep,) if isinstance(self.keep, Rule) else tuple(self.keep))
        _check_count("keep_last", self.keep_last, optional=False, why=": the newest checkpoint is always kept")
        _check_count("keep_every", self.keep_every, optional=True)
        if self.mode is not None:
            _check_choice("retention_mode (Retention.mode)", self.mode, RETENTION_MODES)
        if isinstance(self.leftover_grace, bool) or not (
            isinstance(self.leftover_grace, (int, float)) and self.leftover_grace >= 0  # nan fails too
        ):
            raise ConfigError(f"leftover_grace must be a number of seconds >= 0, got {self.leftover_grace!r}")


#: A save's storage budget when neither ``save_deadline`` nor a lease ttl is given (seconds, plus
#: the tensors at ``SAVE_RATE_BPS``): the lease's old default ttl, kept when that ttl became short.
DEFAULT_SAVE_DEADLINE = 60.0


@dataclass(frozen=True)
class LeaseOptions:
    """How this writer takes and holds the root's lease (checked by :class:`ckptsdk.lease.acquire.Lease`).

    No flat shorthand: ``lease_ttl=``, ``lease_wait=``, ``lease_settle=`` and ``force=`` are
    deprecated flat keywords (see :data:`DEPRECATED`).

    Attributes:
        ttl: seconds a silent lease must stay unchanged before a newcomer on another machine
            takes over. None: 15 s on local disk, GCS and S3, 45 s on Drive (see
            :mod:`ckptsdk.lease.acquire`). A holder whose process is gone from this very host
            (same boot, same pid namespace) is taken over at once, whatever the ttl.
        wait: seconds to wait for a live holder before ``LeaseHeldError`` (None: five of the
            holder's ttls).
        settle: on backends without compare-and-swap (Drive): seconds after taking the lease
            when it is read back, in the background, to see whether a rival on another VM took
            it too (then the lower of the two is fenced). Nothing waits for it. Should exceed
            the time another VM's write takes to reach this one. None: 60 s on Drive, 0 elsewhere.
        force: break a live lease at once (only when you know the other writer is gone).
    """

    #: The manager's flat keywords for these fields (flat keyword -> field), deprecated ones too.
    SHORTHAND: ClassVar[Mapping[str, str]] = {
        "lease_ttl": "ttl",
        "lease_wait": "wait",
        "lease_settle": "settle",
        "force": "force",
    }

    ttl: float | None = None
    wait: float | None = None
    settle: float | None = None
    force: bool = False


@dataclass(frozen=True)
class SaveOptions:
    """When saves are due and how they run.

    Shorthand: ``CheckpointManager(save_every=, async_save=)``; ``snapshot=``, ``save_on_signal=``,
    ``signal_deadline=``, ``max_staging_bytes=``, ``save_deadline=`` and ``incremental=`` are
    deprecated flat keywords (see :data:`DEPRECATED`).

    Attributes:
        every: ``should_save(step)`` is true every this many steps (None: never by count).
        asynchronous: make ``save`` non-blocking by default (see ``save(blocking=)``).
        snapshot: how a non-blocking save copies the state. ``"pipelined"`` (default): at
            ``save()`` only what can change before the next ``optimizer.step()`` is copied (RNG
            states, module buffers, scheduler/scaler state, extras); parameters and optimizer
            state are copied in the background, and each optimizer held by the
            :class:`~ckptsdk.TrainState` waits for that copy at its next ``step()``. The rule a
            job must follow: nothing but ``optimizer.step()`` changes parameters or optimizer
            state between ``save()`` and the next step. ``"copy"``: copy everything at
            ``save()`` (the opt-out; also what happens for a state without optimizers).
        on_signal: on SIGTERM/SIGINT, make ``should_save`` true at the next step, commit that
            save (blocking, within ``signal_deadline``), release the lease, then exit as the
            signal asked (see :mod:`ckptsdk.preemption`). None: on when the manager is created
            in the main thread for writing.
        signal_deadline: seconds everything after a stop signal may take, from the final save's
            start to the exit: that save (abandoned, uncommitted, when it runs out), the step log's
            last flush and the lease release (left for the lease's ttl when it cannot finish).
        save_deadline: seconds the storage half of one save may take, all its requests and
            retries together, plus its tensors' bytes at 8 MiB/s (the slowest link the default
            allows, ``ckptsdk.backends.deadline.SAVE_RATE_BPS``: 89 MB adds 11 s). Past it the save raises
            ``DeadlineExceeded`` naming the store and the request it waited for, and commits
            nothing (the previous checkpoint stands). Honoured by the object-store transports
            (GCS, S3). None: the lease ttl you gave, else ``DEFAULT_SAVE_DEADLINE`` (60 s), so a
            frozen store fails a blocking save within about a minute, not after each request's
            own bound in turn.
        max_staging_bytes: host memory the snapshots of non-blocking saves may hold. A save due
            while the previous one is still writing never waits: its snapshot goes to a second
            staging buffer (a newer one replaces it while it waits). When that second buffer
            would exceed this bound, the due save is skipped and counted in ``mgr.stats``. None:
            no bound (at most two snapshots of the state).
        incremental: a tensor of 1 MiB or more that is unchanged since the writer's newest
            commit is not written again: the new manifest refers to the shared file that holds
            it (a frozen fine-tuning base is written once). Unchanged is decided by the tensor's
            digest (dtype, shape, bytes), never by a flag; a tensor whose version counter moved
            is written without hashing (see :mod:`ckptsdk.checkpoint.writing.sharing`). False: every
            save writes every tensor into its own folder, readable by a 1.2 reader.
        frozen: what a save does with a frozen weight (an ``nn.Parameter`` with
            ``requires_grad=False`` of 4 KiB or more that no optimizer steps: a fine-tune's
            base). ``"store"`` (default): its bytes are stored (once, with ``incremental``).
            ``"reference"``: it is recorded by dtype, shape and digest and never written nor
            copied at ``save()`` (format 3.0); ``restore`` first proves that the live tensors
            hold exactly those bytes, and refuses another base with ``StateMismatchError``
            before loading anything. Its digest is computed off the training thread, and the
            tensors are re-hashed in the background and before each commit: one whose bytes
            changed by any route (``.data``, numpy) is stored in full from then on, with a
            warning (see :mod:`ckptsdk.checkpoint.writing.sharing`).
        frozen_source: a label of where the referenced base comes from (``"hf:gpt2@607a30d"``),
            recorded with it and named when a restore finds another base; never fetched.
    """

    #: The manager's flat keywords for these fields (flat keyword -> field), deprecated ones too.
    SHORTHAND: ClassVar[Mapping[str, str]] = {
        "max_staging_bytes": "max_staging_bytes",
        "save_every": "every",
        "async_save": "asynchronous",
        "snapshot": "snapshot",
        "save_on_signal": "on_signal",
        "signal_deadline": "signal_deadline",
        "save_deadline": "save_deadline",
        "incremental": "incremental",
    }
    #: Fields with no flat keyword: new options go in the group only (the flat words are shorthand
    #: kept for what existed before the groups).
    GROUP_ONLY: ClassVar[frozenset[str]] = frozenset({"frozen", "frozen_source"})

    every: int | None = None
    asynchronous: bool = False
    snapshot: SnapshotMode = "pipelined"
    on_signal: bool | None = None
    signal_deadline: float = DEFAULT_DEADLINE
    max_staging_bytes: int | None = None
    save_deadline: float | None = None
    incremental: bool = True
    frozen: FrozenMode = "store"
    frozen_source: str | None = None

    def __post_init__(self) -> None:
        _check_count("save_every (SaveOptions.every)", self.every, optional=True)
        for name in ("signal_deadline", "save_deadline"):
            value = getattr(self, name)
            if (value is not None or name == "signal_deadline") and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")
            ):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        _check_count("max_staging_bytes", self.max_staging_bytes, optional=True)
        _check_choice("snapshot", self.snapshot, SNAPSHOT_MODES)
        if not isinstance(self.incremental, bool):
            raise ConfigError(f"incremental must be True or False, got {self.incremental!r}")
        _check_choice("frozen (SaveOptions.frozen)", self.frozen, FROZEN_MODES)
        source = self.frozen_source
        if source is not None and (not isinstance(source, str) or len(source) > 1000):
            raise ConfigError(f"frozen_source must be a str of at most 1000 characters, got {self.frozen_source!r}")


def grouped(keyword: str, group: _Group | None, cls: type[_Group], flat: Mapping[str, Any]) -> _Group:
    """One option group from either the group a caller gave or the flat keywords it gave.

    Args:
        keyword: the manager's keyword for the group (``"retention"``), for messages.
        group: what the caller passed for ``keyword``, or None.
        cls: the group's class; ``cls.SHORTHAND`` maps its flat keywords to its fields.
        flat: flat keyword -> the value given (None: not given); keywords of other groups are
            ignored.

    Returns:
        ``group``, or a ``cls`` made from the flat values given (the defaults for the rest).

    Raises:
        ConfigError: both ``group`` and one of its flat keywords were given (which one should
            win is the caller's to say), ``group`` is not a ``cls``, or a value is invalid.
    """
    given = {kw: flat[kw] for kw in cls.SHORTHAND if flat.get(kw) is not None}
    if group is None:
        return cls(**{cls.SHORTHAND[kw]: value for kw, value in given.items()})
    if not isinstance(group, cls):
        raise ConfigError(f"{keyword}= takes a ckptsdk.{cls.__name__}, got {type(group).__name__}: {group!r}")
    if given:
        names = ", ".join(f"{kw}=" for kw in given)
        raise ConfigError(
            f"{names} and {keyword}= were both given; pass the value inside {keyword}={cls.__name__}(...) "
            f"(the flat keyword is its shorthand) or drop {keyword}="
        )
    return group


#: The flat keywords the signatures keep: those of the README's first loop.
FLAT: tuple[str, ...] = ("keep_last", "keep", "save_every", "async_save")

#: The release that removes the deprecated flat keywords. They were deprecated in the release after
#: 0.1.0 (0.2.0) and keep working through it, as CHANGELOG.md's deprecation rule asks.
REMOVED_IN = "0.3.0"

_GROUPS: dict[type[Any], str] = {Retention: "retention", LeaseOptions: "lease_options", SaveOptions: "save_options"}

#: Every deprecated flat keyword -> the group that holds its value.
DEPRECATED: Mapping[str, type[Any]] = {kw: cls for cls in _GROUPS for kw in cls.SHORTHAND if kw not in FLAT}


def _replacement(keyword: str) -> str:
    cls = DEPRECATED[keyword]
    field = cls.SHORTHAND[keyword]
    instead = f"{_GROUPS[cls]}={cls.__name__}({field}=...)"
    kept = [f"{kw}= as {f}=" if kw != f else f"{kw}=" for kw, f in cls.SHORTHAND.items() if kw in FLAT]
    if kept:  # a group and its own flat keywords together are a ConfigError: say to move them in
        instead += f" (and {' and '.join(kept)} inside it too, if you give them)"
    if keyword == "keep_every":
        instead = "keep=[ckptsdk.keep.every(...)] (or " + instead + ")"
    return instead


def deprecated_shorthand(given: Mapping[str, Any], accepted: Collection[str], *, owner: str) -> dict[str, Any]:
    """The values of the deprecated flat keywords a caller gave, each warned about once.

    For a signature's ``**deprecated``: each keyword in ``accepted`` (a subset of
    :data:`DEPRECATED`) gives a ``DeprecationWarning`` naming its group field and
    :data:`REMOVED_IN`, attributed to the line that called ``owner``; its value then goes to
    :func:`grouped` as before. A keyword given as None is taken as not given (its old default).

    Args:
        given: the keywords the signature did not name.
        accepted: the deprecated keywords this signature still takes.
        owner: the signature's name for messages (``"CheckpointManager.__init__"``).

    Returns:
        flat keyword -> value, for :func:`grouped`.

    Raises:
        TypeError: a keyword that is neither in the signature nor deprecated (as Python would).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     deprecated_shorthand({"lease_ttl": 5}, DEPRECATED, owner="f")
        {'lease_ttl': 5}
        >>> print(caught[0].message)
        lease_ttl= is deprecated and will be removed in ckptsdk 0.3.0: pass lease_options=LeaseOptions(ttl=...)
    """
    for keyword in given:
        if keyword not in accepted:
            raise TypeError(f"{owner}() got an unexpected keyword argument {keyword!r}")
    for keyword in given:
        # stacklevel 3: past this function and the __init__ that called it, to the user's line.
        message = f"{keyword}= is deprecated and will be removed in ckptsdk {REMOVED_IN}: pass {_replacement(keyword)}"
        warnings.warn(message, DeprecationWarning, stacklevel=3)
    return dict(given)
