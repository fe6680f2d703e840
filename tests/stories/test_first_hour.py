"""The first hour of a new user (issue 13): each usual mistake fails early, with a clear error.

Every test here failed before its fix; the message each one checks is the one a user now reads.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, OrderedDict, defaultdict, deque
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptsdk
from ckptsdk import LeaseOptions
from ckptsdk.backends import open_backend
from ckptsdk.format import codec
from ckptsdk.lease import waiting
from tests.support.story_child import can_unshare, elsewhere

REPO = os.path.dirname(os.path.dirname(os.path.abspath(ckptsdk.__file__)))


# ---------------------------------------------------------------- storage URLs and roots


@pytest.mark.parametrize("url", ["", "   ", "file://"])
def test_an_empty_url_is_refused_instead_of_meaning_the_current_directory(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckptsdk.ConfigError, match="empty storage URL"):
        ckptsdk.CheckpointManager(url)
    assert list(tmp_path.iterdir()) == []  # no LEASE.json in the working directory


def test_a_root_that_cannot_be_created_says_so():
    with pytest.raises(ckptsdk.StorageUnavailable) as info:
        ckptsdk.CheckpointManager("/proc/ckptsdk-no-such-root")
    msg = str(info.value)
    assert "storage root /proc/ckptsdk-no-such-root does not exist and cannot be created" in msg
    assert "LEASE.json" not in msg


def test_a_root_that_cannot_be_created_is_not_created_by_reads(tmp_path):
    root = tmp_path / "not-yet"
    b = open_backend(str(root))
    assert not b.exists("LEASE.json") and not root.exists()


def test_gcs_that_cannot_be_reached_names_what_to_check():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = open_backend("gs://bucket/run", token="anon", endpoint_url=f"http://127.0.0.1:{port}")
    b.max_attempts, b.backoff_s = 1, 0.0
    with pytest.raises(ckptsdk.BackendError) as info:
        b.exists("LEASE.json")
    msg = str(info.value)
    assert f"cannot reach GCS at http://127.0.0.1:{port} for gs://bucket/run" in msg
    for hint in (
        "network",
        "gcloud auth application-default login",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "STORAGE_EMULATOR_HOST",
    ):
        assert hint in msg


# ---------------------------------------------------------------- a user's own training script


def _job(opt_cls=torch.optim.AdamW, **opt_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = opt_cls(model.parameters(), lr=0.1, **opt_kwargs)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 2, 4], gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps):
    for _ in range(steps):
        loss = model(torch.ones(4, 3)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_multisteplr_and_the_standard_containers_round_trip_exactly(tmp_path):
    model, opt, sched = _job()
    _train(model, opt, sched, 3)
    state = ckptsdk.TrainState(model=model, optimizer=opt, scheduler=sched)
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(state, step=3)
    model2, opt2, sched2 = _job()
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(ckptsdk.TrainState(model=model2, optimizer=opt2, scheduler=sched2)).step == 3
    assert type(sched2.milestones) is Counter and sched2.milestones == Counter({2: 2, 4: 1})
    assert sched2.state_dict() == sched.state_dict()
    tree = {
        "od": OrderedDict(b=1, a=2),
        "c": Counter("abca"),
        "dd": defaultdict(list, {"k": [1]}),
        "ddn": defaultdict(None),
        "q": deque([1, (2, 3)], maxlen=4),
    }
    tensors, skeleton = codec.encode(tree)
    back = codec.decode(json.loads(json.dumps(skeleton)), tensors)
    for key, value in tree.items():
        assert type(back[key]) is type(value) and back[key] == value, key
    assert list(back["od"]) == ["b", "a"] and back["dd"].default_factory is list
    assert back["q"].maxlen == 4 and back["ddn"].default_factory is None


def test_an_unsupported_object_fails_at_restore_before_training(tmp_path):
    class Odd:  # a user object whose state holds something no checkpoint can store
        def state_dict(self):
            return {"fn": lambda x: x}

        def load_state_dict(self, sd):
            pass

    mgr = ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ckptsdk.UnsupportedStateError) as info:
        mgr.restore(ckptsdk.TrainState(model=model, odd=Odd()))  # a fresh root: nothing to load
    assert info.value.path == "objects/odd/fn" and "recreate it in code" in str(info.value)
    assert mgr.list() == []
    mgr.close()
    # A reader never saves, so it does not refuse what only a save could not store: its
    # restore of the same state is a fresh start (the root holds nothing).
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), read_only=True) as reader:
        assert reader.restore(ckptsdk.TrainState(model=model, odd=Odd())) is None


def test_a_lazy_module_still_restores():
    lazy = torch.nn.LazyLinear(2)
    codec.check({"m": lazy.state_dict()})  # not materialised yet: fine before the first forward
    with pytest.raises(ckptsdk.UnsupportedStateError, match="forward pass"):
        codec.encode({"m": lazy.state_dict()})


def test_adamw_state_into_sgd_is_refused_at_restore_naming_both(tmp_path):
    model, opt, sched = _job()
    _train(model, opt, sched, 2)
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(ckptsdk.TrainState(model=model, optimizer=opt), step=2)
    model2, sgd, _ = _job(torch.optim.SGD, momentum=0.9)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        with pytest.raises(ckptsdk.StateMismatchError) as info:
            mgr.restore(ckptsdk.TrainState(model=model2, optimizer=sgd))
    assert (
        "optimizer: the checkpoint holds the state of a torch.optim.adamw.AdamW, the live object "
        "is a torch.optim.sgd.SGD"
    ) in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items())  # nothing changed
    assert "momentum" in sgd.param_groups[0] and not sgd.state


def test_a_subclass_of_the_saved_optimizer_still_restores(tmp_path):
    class MyAdamW(torch.optim.AdamW):
        pass

    model, opt, sched = _job()
    _train(model, opt, sched, 2)
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(ckptsdk.TrainState(model=model, optimizer=opt), step=2)
    model2, opt2, _ = _job(MyAdamW)
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(ckptsdk.TrainState(model=model2, optimizer=opt2)).step == 2


@pytest.mark.parametrize("bare", ["model", "optimizer", "scheduler"])
def test_a_bare_module_or_optimizer_is_refused_with_the_fix(bare, tmp_path):
    model, opt, sched = _job()
    obj = {"model": model, "optimizer": opt, "scheduler": sched}[bare]
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(ckptsdk.TrainState(model=model), step=1)
        for call in (mgr.restore, lambda s: mgr.save(s, step=2)):
            with pytest.raises(ckptsdk.ConfigError) as info:
                call(obj)
            assert f"got a bare {type(obj).__name__}; it takes a TrainState" in str(info.value)
            assert "TrainState(model=model, optimizer=opt, ...)" in str(info.value)
        assert [i.step for i in mgr.list()] == [1]


def test_restore_after_close_is_a_config_error_like_save(tmp_path):
    mgr = ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5))
    state = ckptsdk.TrainState(model=torch.nn.Linear(2, 2))
    mgr.save(state, step=1)
    mgr.close()
    with pytest.raises(ckptsdk.ConfigError, match=r"save\(\) after close\(\)"):
        mgr.save(state, step=2)
    with pytest.raises(ckptsdk.ConfigError, match=r"restore\(\) after close\(\)"):
        mgr.restore(state)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("extra", np.arange(3), "extra['v'] is a numpy.ndarray of shape (3,)"),
        ("metrics", np.arange(3), "metrics['v'] is a numpy.ndarray of shape (3,)"),
        ("metrics", [1.0], "metrics['v'] is a list"),
        ("extra", (1, 2), "extra['v'] is a tuple"),
        ("extra", {"$float": "nan"}, "extra['v'] has the key '$float'"),
        ("metrics", {1, 2}, "metrics['v'] is a set"),
    ],
)
def test_metrics_and_extra_follow_one_rule_with_a_clear_error(field, value, words, tmp_path):
    state = ckptsdk.TrainState(model=torch.nn.Linear(2, 2))
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        with pytest.raises(ckptsdk.ConfigError) as info:
            mgr.save(state, step=1, **{field: {"v": value}})
        assert words in str(info.value) and "metrics and extra hold None, bool, int" in str(info.value)
        assert mgr.list() == []


def test_numpy_scalars_and_nan_are_kept_in_both(tmp_path):
    state = ckptsdk.TrainState(model=torch.nn.Linear(2, 2))
    values = {"n": np.int64(3), "f": np.float32(0.5), "nan": float("nan"), "t": torch.tensor(2.5)}
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(state, step=1, metrics=values, extra={**values, "deep": [{"inf": math.inf}]})
    with ckptsdk.CheckpointManager(str(tmp_path / "run"), lease_options=LeaseOptions(ttl=5)) as mgr:
        pos = mgr.restore(state)
    for got in (pos.metrics, pos.extra):
        assert got["n"] == 3 and type(got["n"]) is int and got["f"] == 0.5 and got["t"] == 2.5
        assert math.isnan(got["nan"])
    assert pos.extra["deep"] == [{"inf": math.inf}]


def test_the_audit_report_prints_one_short_line(tmp_path):
    url = str(tmp_path / "run")
    state = ckptsdk.TrainState(model=torch.nn.Linear(2, 2))
    with ckptsdk.CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        for step in (1, 2, 3):
            mgr.log_step(step, loss=1.0 / step)
            if step == 2:
                mgr.save(state, step=2)
    with ckptsdk.CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.restore(state)
        mgr.log_step(3, loss=1.0 / 3)
        report = mgr.audit()
    assert str(report) == (f"audit of {url}: bit-exact: 2 attempts, 1 step run by more than one; max |loss diff| 0")
    assert "series" not in repr(report) and len(repr(report)) < 2000


# ---------------------------------------------------------------- no silent waits


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _killed_holder(url: str, ttl: float, host: str | None = None) -> None:
    """A writer that takes the lease and dies by SIGKILL, as a crashed job does (on another
    machine named ``host``, if given)."""
    code = (
        "import os, signal, ckptsdk; "
        f"ckptsdk.CheckpointManager({url!r}, lease_options=ckptsdk.LeaseOptions(ttl={ttl})); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(
        cmd if host is None else elsewhere(host, cmd),
        cwd=str(REPO),
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)  # unshare reports it as an exit code


@pytest.mark.timeout(120)
def test_a_rerun_after_a_crash_on_this_machine_takes_the_lease_at_once(tmp_path, capsys):
    url = str(tmp_path / "run")
    _killed_holder(url, ttl=60.0)
    capsys.readouterr()
    started = time.monotonic()
    with ckptsdk.CheckpointManager(url, lease_options=LeaseOptions(ttl=60.0)) as mgr:
        assert (mgr.lease.epoch, mgr.lease.attempt) == (2, 2)
    waited = time.monotonic() - started
    assert waited < 60  # not by the ttl rule: the dead process was recognised
    assert "waiting for the lease" not in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.skipif(not can_unshare(), reason="needs root and namespaces (unshare) to play another machine")
def test_a_rerun_after_a_crash_elsewhere_says_it_waits_who_holds_and_how_to_skip(tmp_path, capsys):
    url = str(tmp_path / "run")
    _killed_holder(url, ttl=2.0, host="other-vm")
    capsys.readouterr()
    started = time.monotonic()
    with ckptsdk.CheckpointManager(url, lease_options=LeaseOptions(ttl=2.0)):
        pass
    waited = time.monotonic() - started
    err = capsys.readouterr().err.splitlines()
    assert 2.0 <= waited < 30
    first = err[0]
    assert first.startswith(f"ckptsdk: waiting for the lease on {url}: held by host ")
    for words in (
        "epoch 1, attempt 1, acquired",
        "taken over after 2 s without a change",
        "skip the wait: lease_options=LeaseOptions(force=True) (the examples' --force)",
        f"`ckptsdk lease {url} --break --yes-i-am-sure`",
        "s to take over if it stays silent",
    ):
        assert words in first, words
    assert err[-1] == f"ckptsdk: took the lease on {url}: epoch 2, attempt 2"
    assert len(err) == 2  # one line for the wait, one for its outcome


def test_without_a_terminal_the_wait_is_said_once():
    out = io.StringIO()
    notice = waiting.WaitNotice("waiting for x", stream=out)
    for remaining, renewals in ((3.0, 1), (2.9, 2), (2.8, 2), (2.0, 3)):  # the holder renews meanwhile
        notice.update(remaining=remaining, total=3.0, detail=f"held by y ({renewals} renewals)", goal="take over")
    notice.close("took it")
    assert out.getvalue().splitlines() == [
        "ckptsdk: waiting for x: held by y (1 renewals); 3 s to take over",
        "ckptsdk: took it",
    ]


def test_in_a_terminal_a_countdown_under_one_line_of_why():
    out = _Terminal()
    notice = waiting.WaitNotice("waiting for x", stream=out)
    for remaining in (3.0, 2.0, 1.0):
        notice.update(remaining=remaining, total=3.0, detail="held by y", goal="take over")
    notice.close("took it")
    text = out.getvalue()
    assert text.count("ckptsdk: waiting for x: held by y") == 1  # said once, not per tick
    assert "1 s to take over" in text and "\r" in text  # a redrawn bar
    assert text.endswith("ckptsdk: took it\n")


@pytest.mark.timeout(60)
def test_a_fresh_drive_root_does_not_wait_for_the_settle(tmp_path, monkeypatch, capsys):
    (tmp_path / "drive").mkdir()
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path / "drive"))
    started = time.monotonic()
    with ckptsdk.CheckpointManager("drive://runs/a", lease_options=LeaseOptions(settle=600)) as mgr:
        opened = time.monotonic() - started
        assert mgr.lease.settle == 600 and not mgr.lease.settled  # read back later, in the background
    assert opened < 600
    assert "ckptsdk:" not in capsys.readouterr().err  # nothing to wait for, nothing said


@pytest.mark.timeout(60)
def test_a_clean_release_then_a_restart_does_not_wait(tmp_path, capsys):
    # Decided (issue 13): a released lease is taken at once wherever writes are immediately
    # visible (local disk, GCS): no ttl, no settle. Drive still settles (see lease.py): the
    # settle is not about the old holder, it is the only chance to see a rival newcomer's write.
    url = str(tmp_path / "run")
    ckptsdk.CheckpointManager(url, lease_options=LeaseOptions(ttl=60)).close()
    started = time.monotonic()
    with ckptsdk.CheckpointManager(url, lease_options=LeaseOptions(ttl=60)) as mgr:
        assert mgr.lease.epoch == 2
    assert time.monotonic() - started < 5
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- the example's command line


@pytest.mark.timeout(120)
def test_the_example_help_shows_true_defaults():
    out = subprocess.run(
        [sys.executable, "-m", "examples.train_cifar10", "--help"],
        cwd=REPO,
        timeout=120,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": REPO},
    ).stdout
    text = " ".join(out.split())
    for shown in (
        "(default: 40 with --preset full, 5 with --preset quick)",
        "(default: full)",
        "(default: 100 with --preset full, 4 with --preset quick)",
        "(default: 60 on local disk and GCS, 300 on Drive)",
        "(default: cifar10)",
    ):
        assert shown in text, shown
    assert "default: None" not in text


def test_the_example_lease_ttl_is_the_library_default(tmp_path, monkeypatch):
    import inspect

    from adapters.cifar10.train import run_job
    from examples.train_cifar10 import parse_args

    assert parse_args(["--ckpt", "x"]).lease_ttl is None
    assert inspect.signature(run_job).parameters["lease_ttl"].default is None
    (tmp_path / "drive").mkdir()
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path / "drive"))
    from ckptsdk.lease.acquire import Lease

    assert Lease(open_backend("drive://r")).ttl == 45.0 and Lease(open_backend(str(tmp_path))).ttl == 15.0


# ---------------------------------------------------------------- the Colab notebook


def _install_cell(source: str, dest: Path) -> str:
    nb = json.loads((Path(REPO) / "examples" / "colab_cifar10.ipynb").read_text())
    code = next(
        "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code" and "SOURCE = " in "".join(c["source"])
    )
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("SOURCE = "))
    assert lines[at + 1].startswith("DEST = ")
    return "\n".join([*lines[:at], f"SOURCE = {source!r}", f"DEST = {str(dest)!r}", *lines[at + 2 :]])


def test_the_notebook_states_the_t4_time_and_hides_no_failure():
    text = (Path(REPO) / "examples" / "colab_cifar10.ipynb").read_text()
    assert "YOUR-ACCOUNT" not in text and "2>/dev/null" not in text and "|| git" not in text
    assert "on a T4, expect roughly 15–25 minutes" in text and "silent for 60 s" not in text


@pytest.mark.timeout(120)
def test_the_notebook_install_cell_fails_loudly_and_installs_from_an_archive(tmp_path):
    with pytest.raises(FileNotFoundError, match="git archive -o ckptsdk.tar.gz HEAD"):
        exec(_install_cell(str(tmp_path / "missing.tar.gz"), tmp_path / "a"), {})  # noqa: S102
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(subprocess.CalledProcessError):  # a failed clone stops the cell
        exec(_install_cell(f"https://127.0.0.1:{port}/ckptsdk.git", tmp_path / "b"), {})  # noqa: S102
    archive = tmp_path / "ckptsdk.tar.gz"
    subprocess.run(["git", "-C", REPO, "archive", "-o", str(archive), "HEAD"], check=True, timeout=60)
    code = _install_cell(str(archive), tmp_path / "c")
    ran: list[tuple[str, ...]] = []
    code = code.replace("def sh(*cmd):", 'def sh(*cmd):\n    if cmd[0] != "tar":\n        return ran.append(cmd)')
    exec(code, {"ran": ran})  # noqa: S102 - the notebook's own cell, pip and the CLI recorded
    assert (tmp_path / "c" / "pyproject.toml").exists()
    assert (tmp_path / "c" / "examples" / "train_cifar10.py").exists()
    assert ran == [
        (sys.executable, "-m", "pip", "install", "--progress-bar", "on", "-e", f"{tmp_path / 'c'}[cifar,plot]"),
        ("ckptsdk", "--help"),
    ]
