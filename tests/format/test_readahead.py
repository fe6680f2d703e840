"""The read-ahead of a restore's tensor files: it reads each file whole, in order, on its own
descriptors; it stops when told; it never changes what the caller reads; its failures are its own.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from pathlib import Path

import pytest

from ckptsdk.format.files import readahead
from ckptsdk.format.files.readahead import read_ahead


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "ckptsdk-read-ahead"]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Every ``sendfile`` the read-ahead makes, as (file size, offset, count); the real call runs."""
    calls: list[tuple[int, int, int]] = []
    real = os.sendfile

    def spy(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        calls.append((os.fstat(in_fd).st_size, offset, count))
        return real(out_fd, in_fd, offset, count)

    monkeypatch.setattr(readahead.os, "sendfile", spy)
    return calls


def test_each_file_is_read_whole_in_order_and_the_thread_is_gone_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sent: list[tuple[int, int, int]]
) -> None:
    monkeypatch.setattr(readahead, "SLICE", 1000)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(os.urandom(2500))
    b.write_bytes(os.urandom(700))
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.read(10)  # the caller's position: untouched by the read-ahead (pread semantics, own fds)
        with read_ahead([fa, fb]) as warmed:
            assert warmed.wait(30)
        assert fa.tell() == 10 and fb.tell() == 0
        assert fa.read() == a.read_bytes()[10:]
    assert [(size, at) for size, at, _ in sent] == [(2500, 0), (2500, 1000), (2500, 2000), (700, 0)]
    assert [n for _, _, n in sent] == [1000, 1000, 500, 700]
    assert _threads() == []


def test_the_caller_may_close_its_files_inside_the_block(tmp_path: Path, sent: list[tuple[int, int, int]]) -> None:
    p = tmp_path / "t"
    p.write_bytes(b"x" * 4096)
    f = open(p, "rb")  # noqa: SIM115 (closed inside the block, on purpose)
    with read_ahead([f]) as warmed:
        f.close()  # the thread reads through a duplicate descriptor of its own
        assert warmed.wait(30)
    assert sent and sent[0][0] == 4096
    assert _threads() == []


def test_streams_without_a_descriptor_start_no_thread(sent: list[tuple[int, int, int]]) -> None:
    before = threading.active_count()
    with read_ahead([io.BytesIO(b"an object store's stream has no fileno")]) as warmed:
        assert threading.active_count() == before
        assert warmed.is_set()
    assert sent == []


def test_leaving_the_block_stops_it_between_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sent: list[tuple[int, int, int]]
) -> None:
    monkeypatch.setattr(readahead, "SLICE", 1)
    p = tmp_path / "big"
    p.write_bytes(b"y" * 100_000)
    first = threading.Event()
    release = threading.Event()
    spy = readahead.os.sendfile

    def slow(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        first.set()
        assert release.wait(30)
        return spy(out_fd, in_fd, offset, count)

    monkeypatch.setattr(readahead.os, "sendfile", slow)
    with open(p, "rb") as f:
        with read_ahead([f]):
            assert first.wait(30)
            # Leaving sets stop before the join: the slice under way ends, no other starts.
            threading.Timer(0.05, release.set).start()
    assert len(sent) == 1
    assert _threads() == []


def test_a_failing_read_ahead_is_logged_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        raise OSError(22, "Invalid argument (a filesystem without sendfile)")

    monkeypatch.setattr(readahead.os, "sendfile", refuse)
    p = tmp_path / "t"
    p.write_bytes(b"z" * 10)
    with caplog.at_level(logging.DEBUG, logger="ckptsdk.format.files.readahead"), open(p, "rb") as f:
        with read_ahead([f]) as warmed:
            assert warmed.wait(30)
        assert f.read() == b"z" * 10
    assert "read-ahead stopped" in caplog.text and "Invalid argument" in caplog.text
    assert _threads() == []
