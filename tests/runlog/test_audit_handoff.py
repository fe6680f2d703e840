"""An audit with nothing to compare names its case (issue 47, item 14): a clean SIGTERM handoff or
a kill right after a save ("no step ran twice") reads apart from a lost log; the verdict stays
``unverified`` and ``--strict`` still exits 1 (nothing was proven), saying which case it is.
"""

from __future__ import annotations

import pytest

from ckptsdk import cli
from ckptsdk.backends import open_backend
from ckptsdk.runlog.audit import audit
from ckptsdk.runlog.writer import RunLog


def _attempt(backend, attempt: int, steps: range, *, resumed_from: int | None = None, close: bool = True) -> None:
    log = RunLog(backend, run_id="r", attempt=attempt, lease_epoch=attempt, resumed_from_step=resumed_from)
    for s in steps:
        log.log_step(s, loss=1.0 / (s + 1))
    if close:
        log.close()
    else:
        log.flush()


def test_a_clean_handoff_is_named(tmp_path, capsys):
    backend = open_backend(str(tmp_path / "run"))
    _attempt(backend, 1, range(0, 6))  # SIGTERM: saved step 5, closed
    _attempt(backend, 2, range(6, 9), resumed_from=5)
    report = audit(backend)
    assert (report.verdict, report.verified) == ("unverified", False)
    assert report.unverified_reason.startswith("clean handoff: no step ran twice")
    assert "nothing was lost" in report.unverified_reason and "lost log" not in report.unverified_reason
    assert cli.main(["audit", str(tmp_path / "run"), "--strict"]) == cli.EXIT_FAILED
    assert "unverified: clean handoff: no step ran twice" in capsys.readouterr().out


def test_a_kill_right_after_a_save_is_a_handoff_at_a_save():
    backend = open_backend("memory://handoff-at-save")
    _attempt(backend, 1, range(0, 6), close=False)  # killed in the second after saving step 5
    _attempt(backend, 2, range(6, 9), resumed_from=5)
    reason = audit(backend).unverified_reason
    assert reason.startswith("handoff at a save: no step ran twice")
    assert "never reached storage" in reason and "lost log" not in reason


@pytest.mark.parametrize("close", [True, False])
def test_a_lost_log_is_not_called_a_handoff(close):
    backend = open_backend(f"memory://lost-log-{close}")
    _attempt(backend, 1, range(0, 3), close=close)  # its log ends before the step resumed from
    _attempt(backend, 2, range(6, 9), resumed_from=5)
    reason = audit(backend).unverified_reason
    assert reason.startswith("no step was run by two attempts: lost log: attempt 1")
    assert "handoff" not in reason
