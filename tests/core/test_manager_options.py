"""CheckpointManager's option groups (Retention, LeaseOptions, SaveOptions), their flat shorthand,
and the deprecated flat keywords of ckptsdk 0.1.0."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import warnings
from typing import Any

import pytest
import torch

import ckptsdk
from ckptsdk import CheckpointManager, LeaseOptions, Retention, SaveOptions, TrainState
from ckptsdk._version import __version__
from ckptsdk.backends import open_backend
from ckptsdk.checkpoint.pruning.rotation import LEFTOVER_GRACE_S
from ckptsdk.errors import ConfigError
from ckptsdk.options import DEPRECATED, FLAT, REMOVED_IN
from ckptsdk.preemption import DEFAULT_DEADLINE

GROUPS: dict[str, type[Any]] = {"retention": Retention, "lease_options": LeaseOptions, "save_options": SaveOptions}


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _params() -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(CheckpointManager).parameters)


def _deprecated(kw: str) -> contextlib.AbstractContextManager[object]:
    """Expect the DeprecationWarning of each deprecated keyword in ``kw`` (none: expect nothing)."""
    return pytest.warns(DeprecationWarning) if any(k in DEPRECATED for k in kw) else contextlib.nullcontext()


def test_every_flat_keyword_is_the_shorthand_of_exactly_one_group_field() -> None:
    # A flat keyword missing from every SHORTHAND table would be accepted and silently ignored.
    shorthand = [kw for cls in GROUPS.values() for kw in cls.SHORTHAND]
    assert len(shorthand) == len(set(shorthand))
    flat = {name for name, p in _params().items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    flat -= {"retention", "lease_options", "save_options", "read_only", "storage_options", "run_id", "_simulation"}
    # One spelling per option: the signature keeps the README's first loop, the rest is deprecated.
    assert flat == set(FLAT) == {"keep_last", "keep", "save_every", "async_save"}
    assert set(shorthand) == flat | set(DEPRECATED) and not flat & set(DEPRECATED)
    assert _params()["deprecated"].kind is inspect.Parameter.VAR_KEYWORD
    for cls in GROUPS.values():
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(cls.SHORTHAND.values()) | getattr(cls, "GROUP_ONLY", frozenset()) == fields, cls
    for kw in flat:
        assert _params()[kw].default is None, f"{kw}: a flat default other than None hides whether it was given"


def test_flat_defaults_are_the_groups_defaults() -> None:
    with CheckpointManager("memory://opts-defaults") as mgr:
        assert mgr.retention == Retention(keep_last=3, keep_every=None, mode="delete", leftover_grace=LEFTOVER_GRACE_S)
        assert mgr.lease_options == LeaseOptions(ttl=None, wait=None, settle=None, force=False)
        assert mgr.save_options == SaveOptions(
            every=None, asynchronous=False, snapshot="pipelined", on_signal=None, signal_deadline=DEFAULT_DEADLINE
        )
        assert (mgr.keep_last, mgr.keep_every, mgr.save_every, mgr.async_save, mgr.snapshot) == (
            3,
            None,
            None,
            False,
            "pipelined",
        )


def test_deprecated_flat_keywords_and_groups_configure_the_same_manager() -> None:
    flat_kw: dict[str, Any] = dict(
        keep_last=2,
        keep_every=4,
        retention_mode="delete",
        leftover_grace=10.0,
        lease_ttl=7.0,
        lease_wait=1.0,
        lease_settle=0.0,
        force=True,
        save_every=5,
        async_save=True,
        snapshot="copy",
        save_on_signal=False,
        signal_deadline=3.0,
    )
    groups: dict[str, Any] = dict(
        retention=Retention(keep_last=2, keep_every=4, mode="delete", leftover_grace=10.0),
        lease_options=LeaseOptions(ttl=7.0, wait=1.0, settle=0.0, force=True),
        save_options=SaveOptions(every=5, asynchronous=True, snapshot="copy", on_signal=False, signal_deadline=3.0),
    )
    seen = []
    for name, kwargs in (("flat", flat_kw), ("grouped", groups)):
        with _deprecated(kwargs), CheckpointManager(f"memory://opts-same-{name}", **kwargs) as mgr:
            state = _state()
            for step in range(1, 10):
                mgr.save(state, step=step, blocking=True)
            seen.append(
                (
                    mgr.retention,
                    mgr.lease_options,
                    mgr.save_options,
                    mgr.lease.ttl if mgr.lease else None,
                    [c.step for c in mgr.list()],
                    mgr.should_save(10),
                )
            )
    assert seen[0] == seen[1]
    assert seen[0][4] == [4, 8, 9]  # keep_every=4 forever, plus the last 2
    assert seen[0][5] is True


def test_groups_mix_with_other_groups_flat_keywords() -> None:
    with CheckpointManager(
        "memory://opts-mix", retention=Retention(keep_last=1), save_every=2, lease_options=LeaseOptions(ttl=9.0)
    ) as mgr:
        assert (mgr.keep_last, mgr.save_every, mgr.lease_options.ttl) == (1, 2, 9.0)


@pytest.mark.parametrize(
    ("group", "flat_kw"),
    [
        ("retention", {"keep_last": 3}),
        ("retention", {"keep": []}),
        ("retention", {"retention_mode": "delete"}),
        ("lease_options", {"force": False}),
        ("lease_options", {"lease_ttl": 5.0, "lease_wait": 1.0}),
        ("save_options", {"snapshot": "pipelined"}),
        ("save_options", {"async_save": True}),
        ("save_options", {"save_every": 10}),
    ],
)
def test_a_group_and_its_flat_keyword_together_are_refused_before_the_root_is_touched(
    group: str, flat_kw: dict[str, Any]
) -> None:
    url = f"memory://opts-both-{group}-{'-'.join(flat_kw)}"
    with CheckpointManager(url, keep_last=5) as mgr:
        committed = mgr.save(_state(), step=1, blocking=True)
    before = {o.key: open_backend(url).read(o.key) for o in open_backend(url).list("")}
    with pytest.raises(ConfigError) as exc_info, _deprecated(flat_kw):
        CheckpointManager(url, **{group: GROUPS[group](), **flat_kw})
    message = str(exc_info.value)
    assert all(f"{kw}=" in message for kw in flat_kw) and f"{group}=" in message
    # Nothing was taken or changed: no lease takeover, the committed checkpoint as it was.
    after = {o.key: open_backend(url).read(o.key) for o in open_backend(url).list("")}
    assert after == before
    with CheckpointManager(url, read_only=True) as reader:
        assert [c.key for c in reader.list()] == [committed.key]


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"snapshot": "fast"}, ["snapshot", "'pipelined'", "'copy'", "'fast'"]),
        ({"retention_mode": "trash"}, ["retention_mode", "'delete'", "'recycle'", "'trash'"]),
        ({"keep_last": 0}, ["keep_last", "newest checkpoint is always kept"]),
        ({"keep_last": True}, ["keep_last", "True"]),
        ({"keep_every": 0}, ["keep_every", ">= 1 or None"]),
        ({"save_every": 0}, ["save_every", ">= 1 or None"]),
        ({"save_every": 2.5}, ["save_every", "2.5"]),
        ({"leftover_grace": -1.0}, ["leftover_grace", ">= 0"]),
        ({"leftover_grace": float("nan")}, ["leftover_grace", "nan"]),
        ({"save_deadline": 0}, ["save_deadline", "> 0"]),
        ({"save_deadline": float("inf")}, ["save_deadline", "inf"]),
        ({"signal_deadline": -1.0}, ["signal_deadline", "> 0"]),
    ],
)
def test_bad_option_values_are_one_config_error_whichever_way_they_come(
    kwargs: dict[str, Any], names: list[str]
) -> None:
    ((kw, value),) = kwargs.items()
    cls = next(c for c in GROUPS.values() if kw in c.SHORTHAND)
    with pytest.raises(ConfigError) as flat_error, _deprecated(kwargs):
        CheckpointManager(f"memory://opts-bad-{kw}", **kwargs)
    with pytest.raises(ConfigError) as group_error:
        cls(**{cls.SHORTHAND[kw]: value})
    assert str(flat_error.value) == str(group_error.value)
    for name in names:
        assert name in str(flat_error.value)


def test_a_group_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"retention= takes a ckptsdk.Retention, got LeaseOptions"):
        CheckpointManager("memory://opts-kind", retention=LeaseOptions())  # type: ignore[arg-type]


def test_groups_are_frozen_values() -> None:
    kept = Retention(keep_last=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        kept.keep_last = 1  # type: ignore[misc]
    assert kept == Retention(keep_last=4) and hash(kept) == hash(Retention(keep_last=4))
    assert ckptsdk.Retention is Retention


def test_retention_mode_none_is_the_stores_choice_and_reads_back_resolved(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    with CheckpointManager("drive://run", read_only=True) as mgr:
        assert mgr.retention.mode == "recycle"  # Drive: a trash, and rewrites in place
    with CheckpointManager(str(tmp_path / "local"), read_only=True) as mgr:
        assert mgr.retention.mode == "delete"
    with CheckpointManager("drive://run", read_only=True, retention=Retention(mode="delete")) as mgr:
        assert mgr.retention.mode == "delete"


def test_counts_from_numpy_or_a_config_file_are_accepted_as_integers() -> None:
    import numpy as np

    assert Retention(keep_last=np.int64(2), keep_every=np.int32(5)).keep_last == 2  # type: ignore[arg-type]
    assert SaveOptions(every=np.int64(10)).every == 10  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"save_every \(SaveOptions.every\) must be an integer >= 1 or None"):
        SaveOptions(every=np.float64(10.0))  # type: ignore[arg-type]


def test_keep_rules_belong_to_retention_either_way() -> None:
    from ckptsdk.checkpoint import retention as rules

    best = rules.keep_best("val_loss", 1)
    assert Retention(keep=best).keep == (best,)  # one rule or a list: stored as a tuple
    assert Retention(keep=[best]) == Retention(keep=(best,))
    seen = []
    for name, kwargs in (
        ("flat", {"keep_last": 1, "keep": [best]}),
        ("grouped", {"retention": Retention(1, keep=best)}),
    ):
        with CheckpointManager(f"memory://opts-keep-{name}", **kwargs) as mgr:
            state = _state()
            for step, loss in enumerate([0.9, 0.1, 0.5, 0.7], start=1):
                mgr.save(state, step=step, metrics={"val_loss": loss}, blocking=True)
            seen.append((mgr.keep, [c.step for c in mgr.list()]))
    assert seen[0] == seen[1] == (((best,), [2, 4]))  # the best (step 2) and the newest
    with pytest.raises(ConfigError, match="keep="):
        CheckpointManager("memory://opts-keep-both", retention=Retention(), keep=[best])
    with pytest.raises(ConfigError, match="keep= takes keep rules"):
        CheckpointManager("memory://opts-keep-bad", keep=["val_loss"])  # type: ignore[list-item]


#: A value other than the default for each deprecated keyword.
OLD_VALUES: dict[str, Any] = {
    "keep_every": 4,
    "retention_mode": "delete",
    "leftover_grace": 10.0,
    "lease_ttl": 7.0,
    "lease_wait": 1.0,
    "lease_settle": 0.5,
    "force": True,
    "snapshot": "copy",
    "save_on_signal": False,
    "signal_deadline": 3.0,
    "max_staging_bytes": 1 << 20,
    "save_deadline": 30.0,
    "incremental": False,
}


@pytest.mark.parametrize("kw", sorted(DEPRECATED))
def test_each_deprecated_keyword_still_works_and_warns_once_with_its_replacement(kw: str) -> None:
    assert set(OLD_VALUES) == set(DEPRECATED)
    cls = DEPRECATED[kw]
    group = next(name for name, c in GROUPS.items() if c is cls)
    field = cls.SHORTHAND[kw]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = CheckpointManager(f"memory://opts-old-{kw}", read_only=True, **{kw: OLD_VALUES[kw]})
    with CheckpointManager(f"memory://opts-new-{kw}", read_only=True, **{group: cls(**{field: OLD_VALUES[kw]})}) as new:
        assert getattr(mgr, group) == getattr(new, group)  # the same group value either way
    mgr.close()
    assert [w.category for w in caught] == [DeprecationWarning]
    message = str(caught[0].message)
    assert f"{kw}= is deprecated" in message and f"{group}={cls.__name__}({field}=...)" in message
    assert f"removed in ckptsdk {REMOVED_IN}" in message
    assert caught[0].filename == __file__, "stacklevel must point at the caller's line"


def test_several_deprecated_keywords_warn_once_each() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager("memory://opts-old-many", lease_ttl=7.0, force=True, snapshot="copy") as mgr:
            assert mgr.lease_options == LeaseOptions(ttl=7.0, force=True) and mgr.snapshot == "copy"
    assert sorted(str(w.message).split("=")[0] for w in caught) == ["force", "lease_ttl", "snapshot"]


def test_keep_every_points_at_the_keep_rule_too() -> None:
    with pytest.warns(DeprecationWarning, match=r"keep=\[ckptsdk\.keep\.every\(\.\.\.\)\]"):
        CheckpointManager("memory://opts-old-every", keep_every=5, read_only=True).close()


def test_an_unknown_keyword_is_a_type_error_as_python_says_it() -> None:
    with pytest.raises(
        TypeError, match=r"CheckpointManager.__init__\(\) got an unexpected keyword argument 'lease_tll'"
    ):
        CheckpointManager("memory://opts-typo", lease_tll=5)
    with pytest.raises(TypeError, match="'ttl'"):  # a group's field is not a manager keyword
        CheckpointManager("memory://opts-typo", ttl=5)


def test_the_removal_release_leaves_one_minor_release_of_warning() -> None:
    # CHANGELOG.md: deprecated for at least one minor release. 0.1.0 is out; the words are
    # deprecated in the next minor release and go in the one after it.
    major, minor, _ = (int(p) for p in __version__.split("."))
    removed = tuple(int(p) for p in REMOVED_IN.split("."))
    assert removed >= (major, minor + 2, 0)


def test_save_on_signal_off_the_main_thread_is_refused_with_the_group_spelling() -> None:
    errors: list[BaseException] = []

    def open_() -> None:
        try:
            CheckpointManager("memory://opts-thread", save_options=SaveOptions(on_signal=True))
        except ConfigError as exc:
            errors.append(exc)

    thread = threading.Thread(target=open_)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "save_options=SaveOptions(on_signal=False)" in str(errors[0])


def test_the_distributed_manager_takes_the_groups_and_deprecates_the_same_words() -> None:
    from ckptsdk.distributed import DistributedCheckpointManager

    params = inspect.signature(DistributedCheckpointManager).parameters
    assert {"retention", "lease_options", "save_options", *FLAT} <= set(params)
    assert not set(DEPRECATED) & set(params)
    # Its old words warn first, then the usual check (no process group here) refuses it.
    with pytest.warns(DeprecationWarning, match="lease_ttl= is deprecated") as record:
        with pytest.raises(ConfigError, match="torch.distributed initialised"):
            DistributedCheckpointManager("memory://opts-dist", lease_ttl=5.0)
    assert record[0].filename == __file__
    with pytest.raises(TypeError, match="unexpected keyword argument 'lease_settle'"):  # never one of its words
        DistributedCheckpointManager("memory://opts-dist", lease_settle=0.0)
    with pytest.raises(ConfigError, match="save_options="), pytest.warns(DeprecationWarning):
        DistributedCheckpointManager("memory://opts-dist", save_options=SaveOptions(), snapshot="copy")
