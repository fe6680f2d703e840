"""Streaming reads through ``open()`` on the object stores (``ckptsdk.backends.cloud.ranged``): a ranged
answer shorter than asked, in the middle of an object, fails the read loudly on both GCS (the
emulator, behind a proxy that cuts one reply) and S3 (the patched moto server cutting one reply),
instead of reading as an early end of file. The reader's own rule is checked without a server too.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Callable

import pytest

from ckptsdk.backends.cloud.ranged import RangedReader
from ckptsdk.errors import BackendError
from tests.support.gcs_proxy import LoopbackProxy

BLOCK = 64 << 10
SIZE = 4 * BLOCK


def _reader(data: bytes, answer: Callable[[int, int], bytes] | None = None) -> RangedReader:
    """A reader over ``data`` whose fetch answers ``answer(offset, n)`` when given, else the exact range."""

    def fetch(offset: int, n: int) -> bytes:
        return answer(offset, n) if answer is not None else data[offset : offset + n]

    return RangedReader(fetch, len(data), store="TEST", url="test://root", key="obj")


def test_exact_answers_read_and_seek_like_a_file() -> None:
    data = os.urandom(10_000)
    with io.BufferedReader(_reader(data), buffer_size=1000) as f:
        assert f.read(1500) == data[:1500]
        f.seek(-100, io.SEEK_END)
        assert f.read() == data[-100:]
        assert f.read(10) == b""  # at the end: an empty read is the end of file, not an error
        f.seek(4000)
        assert f.tell() == 4000 and f.read(10) == data[4000:4010]
        with pytest.raises(ValueError, match="negative seek position"):
            f.seek(-1)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda offset, n: b"", id="empty"),
        pytest.param(lambda offset, n: b"x" * (n // 2), id="short"),
        pytest.param(lambda offset, n: b"x" * 10_000, id="ignored-range"),  # the whole object from 0
    ],
)
def test_an_answer_of_the_wrong_length_is_a_backend_error(answer) -> None:
    raw = _reader(b"\0" * 10_000, answer)
    raw.seek(2000)
    with pytest.raises(BackendError, match=r"TEST answered \d+ of the 1000 bytes asked at offsets 2000-2999") as exc:
        raw.read(1000)
    assert type(exc.value) is BackendError
    assert (exc.value.url, exc.value.key) == ("test://root", "obj")
    assert raw.tell() == 2000  # nothing was counted as read


def _read_cut_mid_object(f: io.BufferedReader, data: bytes, cut: Callable[[], object]) -> BackendError:
    """Read one block whole, have ``cut()`` arm the fault, and return the error of the next block."""
    assert f.read(BLOCK) == data[:BLOCK]
    cut()
    with pytest.raises(BackendError) as exc:
        f.read(BLOCK)
    assert type(exc.value) is BackendError  # not ObjectNotFound: the object is there, the reply was short
    return exc.value


@pytest.mark.gcs
@pytest.mark.timeout(120)
def test_gcs_reply_cut_short_mid_object_fails_the_read(gcs_emulator) -> None:
    from ckptsdk.backends.cloud.gcs import GCSBackend

    bucket = f"ckpt-{uuid.uuid4().hex[:16]}"
    gcs_emulator.make_bucket(bucket)
    proxy = LoopbackProxy(gcs_emulator.port)
    try:
        through = GCSBackend(
            f"{bucket}/run", endpoint_url=proxy.endpoint, token="anon", project="test", skip_instance_cache=True
        )
        direct = GCSBackend(f"{bucket}/run", **gcs_emulator.storage_options, skip_instance_cache=True)
        through.read_block = BLOCK
        data = os.urandom(SIZE)
        direct.write("obj", data)
        with through.open("obj") as f:
            err = _read_cut_mid_object(
                f, data, lambda: proxy.cut_next(f"Range: bytes={BLOCK}-{2 * BLOCK - 1}".encode())
            )
        assert proxy.cut and b" 206 " in proxy.cut[0]  # the emulator answered the range; the proxy cut it
        assert f"GCS answered {BLOCK // 2} of the {BLOCK} bytes asked at offsets {BLOCK}-{2 * BLOCK - 1}" in str(err)
        assert (err.url, err.key) == (through.url, "obj")
        assert direct.read("obj") == data  # nothing lost: the object is whole, and reads whole again
        with through.open("obj") as f:
            assert f.read() == data
    finally:
        proxy.close()


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_s3_reply_cut_short_mid_object_fails_the_read(s3_server, make_backend_target) -> None:
    backend = make_backend_target("s3").open()
    backend.read_block = BLOCK
    data = os.urandom(SIZE)
    backend.write("obj", data)
    with backend.open("obj") as f:
        err = _read_cut_mid_object(f, data, lambda: s3_server.cut_reads(1))
    assert f"S3 answered {BLOCK // 2} of the {BLOCK} bytes asked at offsets {BLOCK}-{2 * BLOCK - 1}" in str(err)
    assert (err.url, err.key) == (backend.url, "obj")
    assert backend.read("obj") == data
    with backend.open("obj") as f:
        assert f.read() == data


@pytest.mark.s3
@pytest.mark.timeout(60)
def test_the_s3_cut_fault_needs_the_patched_server() -> None:
    from ckptsdk.testing.s3_server import start_s3_server

    with start_s3_server(patched=False) as server, pytest.raises(RuntimeError, match="cut needs the patched server"):
        server.cut_reads(1)
