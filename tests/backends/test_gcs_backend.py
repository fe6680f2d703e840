"""GCSBackend against the patched emulator: races, a SIGKILLed uploader, lost replies, throughput.

The shared conformance suite (tests/backends/test_backends.py) covers the contract; this file covers what
only GCS has: preconditions under real concurrency, atomic publish when the *client* dies
mid-upload, replies lost in transit (through a proxy that drops them), the resumable path, a
missing bucket, and what 100 MB costs.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import random
import select
import signal
import socket
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path

import aiohttp
import fsspec.asyn
import pytest
import xxhash
from gcsfs.core import GCSFileSystem

import ckptsdk.backends
from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend, Capabilities
from ckptsdk.backends.cloud import gcs_transport
from ckptsdk.backends.cloud.gcs import GCSBackend
from ckptsdk.errors import (
    BackendError,
    MissingDependencyError,
    ObjectNotFound,
    PreconditionFailed,
    StorageUnavailable,
)
from ckptsdk.testing.gcs_emulator import Emulator, start_emulator
from tests.support.gcs_proxy import LoopbackProxy

pytestmark = pytest.mark.gcs

MIB = 1 << 20


@pytest.fixture(scope="module")
def emulator() -> Iterator[Emulator]:
    with start_emulator() as server:
        yield server


def _bucket(emulator: Emulator) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    emulator.make_bucket(name)
    return name


def _backend(emulator: Emulator, bucket: str, **extra: object) -> GCSBackend:
    # A separate GCSFileSystem (and HTTP session) per backend, as separate hosts would have.
    return GCSBackend(f"{bucket}/run", **emulator.storage_options, skip_instance_cache=True, **extra)


@pytest.fixture
def backend(emulator: Emulator) -> GCSBackend:
    return _backend(emulator, _bucket(emulator))


# -- the third-party API this backend stands on ----------------------------------------------------

_GCS_MODULES = ("gcs.py", "gcs_transport.py", "gcs_payload.py", "gcs_upload.py")


def test_no_private_attribute_of_another_library_is_touched() -> None:
    """gcsfs/aiohttp internals change without notice (the `gcs` extra admits gcsfs >= 2024.2): the
    GCS modules may reach ``._name`` only on ``self``."""
    from ckptsdk.backends import cloud

    backends = Path(cloud.__file__).parent
    offenders = []
    for name in _GCS_MODULES:
        tree = ast.parse((backends / name).read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                offenders.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_the_gcs_extra_bounds_what_the_backend_uses() -> None:
    """pyproject's `gcs` extra names the lowest aiohttp with client middlewares; the installed
    versions meet it; the public names gcs_transport.py uses exist; an older aiohttp is refused
    at construction with the extra to install, not with a TypeError inside a save."""
    with open(Path(ckptsdk.backends.__file__).parents[2] / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["gcs"]
    bounds = dict(req.split(">=") for req in extra)
    assert set(bounds) == {"gcsfs", "aiohttp", "google-crc32c"}
    assert tuple(int(p) for p in bounds["aiohttp"].split(".")) == gcs_transport.MIN_AIOHTTP
    for package, low in bounds.items():
        have = tuple(int(p) for p in importlib.metadata.version(package).split(".")[:2])
        assert have >= tuple(int(p) for p in low.split(".")[:2]), (package, have, low)
    assert "middlewares" in inspect.signature(aiohttp.ClientSession).parameters
    assert callable(fsspec.asyn.sync) and callable(fsspec.asyn.get_loop)
    creds = GCSFileSystem(token="anon", skip_instance_cache=True).credentials
    headers: dict[str, str] = {}
    creds.apply(headers)  # anonymous: signs nothing, but the public method is there
    assert headers == {} and creds.method == "anon"
    gcs_transport.check_aiohttp(aiohttp.__version__)
    with pytest.raises(MissingDependencyError, match=r"aiohttp >= 3\.12.*pip install 'ckptsdk\[gcs\]'") as exc_info:
        gcs_transport.check_aiohttp("3.11.18")
    assert exc_info.value.extra == "gcs"


def test_is_a_backend_with_honest_capabilities(backend: GCSBackend) -> None:
    assert isinstance(backend, Backend)
    assert backend.capabilities == Capabilities(
        exclusive_create=True,
        compare_and_swap=True,
        durable_on_return=True,
        immediately_consistent=True,
        cheap_copy=True,
        remote_conditions=True,
    )
    assert backend.url.startswith("gs://b-") and backend.url.endswith("/run")
    assert backend.sweep(0) == []


def test_open_backend_honours_storage_emulator_host(emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = _bucket(emulator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.endpoint)
    b = open_backend(f"gs://{bucket}/run")  # no options: endpoint from env, token "anon" implied
    assert isinstance(b, GCSBackend)
    info = b.write("k", b"v")
    assert b.stat("k") == info and b.read("k") == b"v"


def test_create_race_two_threads_fifty_rounds(emulator: Emulator) -> None:
    bucket = _bucket(emulator)
    racers = [_backend(emulator, bucket), _backend(emulator, bucket)]
    for round_ in range(50):
        key = f"lease-{round_}"
        barrier = threading.Barrier(2)
        outcomes: list[object] = [None, None]

        def race(
            i: int,
            key: str = key,
            barrier: threading.Barrier = barrier,
            outcomes: list[object] = outcomes,
            round_: int = round_,
        ) -> None:
            barrier.wait(timeout=30)
            try:
                outcomes[i] = racers[i].create(key, f"writer-{i}-{round_}".encode())
            except PreconditionFailed as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=race, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        winners = [i for i in (0, 1) if not isinstance(outcomes[i], PreconditionFailed)]
        assert len(winners) == 1, (round_, outcomes)
        won, lost = outcomes[winners[0]], outcomes[1 - winners[0]]
        assert isinstance(lost, PreconditionFailed)
        assert lost.key == key and lost.expected is None and lost.actual == won.version
        assert racers[0].read(key) == f"writer-{winners[0]}-{round_}".encode()


def test_missing_bucket_is_storage_unavailable(emulator: Emulator) -> None:
    name = f"nope-{uuid.uuid4().hex[:8]}"
    b = _backend(emulator, name)
    ops: dict[str, Callable[[], object]] = {
        "read": lambda: b.read("k"),
        "open": lambda: b.open("k"),
        "stat": lambda: b.stat("k"),
        "exists": lambda: b.exists("k"),
        "list": lambda: b.list(),
        "write": lambda: b.write("k", b"x"),
        "create": lambda: b.create("k", b"x"),
        "delete": lambda: b.delete("k"),
        "big write": lambda: b.write("k", b"x" * (9 * MIB)),  # resumable path
    }
    for op, call in ops.items():
        with pytest.raises(StorageUnavailable) as info:
            call()
        msg = str(info.value)
        assert name in msg and "create the bucket" in msg and "fix the URL" in msg, (op, msg)
        assert info.value.url == b.url
    assert emulator.request("GET", f"/storage/v1/b/{name}")[0] == 404  # nothing was created


def test_dead_server_is_a_backend_error_within_seconds(emulator: Emulator) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    b = GCSBackend(
        "bucket/run", endpoint_url=f"http://127.0.0.1:{port}", token="anon", project="test", skip_instance_cache=True
    )
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        b.read("k")
    assert type(info.value) is BackendError and isinstance(info.value.__cause__, OSError)
    assert f"127.0.0.1:{port}" in str(info.value)
    assert time.monotonic() - started < 15  # gcsfs's own retries would take ~34 s


# -- the resumable path (objects bigger than one multipart request) -----------------------------


def _small_chunks(b: GCSBackend) -> GCSBackend:
    b.multipart_max = 512 * 1024
    b.chunk_size = 256 * 1024  # GCS's minimum; several chunks per object
    return b


def test_resumable_round_trip_with_a_buffer_reusing_producer(backend: GCSBackend) -> None:
    _small_chunks(backend)
    data = random.Random(1).randbytes(2 * MIB + 777)

    def producer() -> Iterator[memoryview]:
        buf = bytearray(100_000)  # one buffer, refilled: the backend must copy what it keeps
        for i in range(0, len(data), len(buf)):
            piece = data[i : i + len(buf)]
            buf[: len(piece)] = piece
            yield memoryview(buf)[: len(piece)]

    info = backend.write("big", producer())
    assert info.size == len(data) and backend.read("big") == data
    again = backend.replace("big", memoryview(data[::-1]), info.version)
    assert backend.read("big") == data[::-1] and again.version != info.version
    with pytest.raises(PreconditionFailed) as exc:
        backend.replace("big", data, info.version)
    assert exc.value.expected == info.version and exc.value.actual == again.version
    with pytest.raises(PreconditionFailed):
        backend.create("big", data)
    assert backend.read("big") == data[::-1]


def test_resumable_create_loses_to_a_writer_that_finished_first(emulator: Emulator, backend: GCSBackend) -> None:
    """The precondition is checked when the session finishes, not only when it starts."""
    _small_chunks(backend)
    rival = _backend(emulator, backend.bucket)

    def producer() -> Iterator[bytes]:
        for i in range(8):
            if i == 4:  # our session is open and half sent: another host creates the key now
                rival.create("lease", b"rival")
            yield bytes([i]) * 200_000

    with pytest.raises(PreconditionFailed) as exc:
        backend.create("lease", producer())
    assert exc.value.actual == rival.stat("lease").version
    assert backend.read("lease") == b"rival"


def test_failing_producer_on_resumable_path_publishes_nothing(backend: GCSBackend) -> None:
    _small_chunks(backend)
    old = backend.write("obj", b"old")

    def producer() -> Iterator[bytes]:
        yield b"x" * (3 * MIB)
        raise KeyError("producer failed")

    with pytest.raises(KeyError):
        backend.write("obj", producer())
    assert backend.list() == [old] and backend.read("obj") == b"old"


def test_open_is_pinned_to_one_generation(backend: GCSBackend) -> None:
    backend.read_block = 256 * 1024
    data = random.Random(2).randbytes(MIB)
    info = backend.write("obj", data)
    with backend.open("obj") as f:
        assert f.read(1000) == data[:1000]
        backend.replace("obj", b"new bytes", info.version)
        with pytest.raises(ObjectNotFound, match="replaced or deleted while being read"):
            f.read()  # beyond the first block: the next ranged GET finds its generation gone


# -- lost replies ------------------------------------------------------------------------------


@pytest.fixture
def lossy(emulator: Emulator) -> Iterator[tuple[GCSBackend, LoopbackProxy, GCSBackend]]:
    """(backend through the proxy, the proxy, a direct backend on the same root)."""
    bucket = _bucket(emulator)
    proxy = LoopbackProxy(emulator.port)
    through = GCSBackend(
        f"{bucket}/run", endpoint_url=proxy.endpoint, token="anon", project="test", skip_instance_cache=True
    )
    through.backoff_s = 0.05
    yield through, proxy, _backend(emulator, bucket)
    proxy.close()


def test_lost_reply_to_a_create_we_won_is_a_success(lossy) -> None:
    b, proxy, direct = lossy
    proxy.drop_next(b"uploadType=multipart")
    info = b.create("lease", b"nonce-123")
    assert proxy.dropped and b" 200 " in proxy.dropped[0]  # the server did create it
    assert info == direct.stat("lease") and direct.read("lease") == b"nonce-123"


def test_lost_reply_then_someone_else_overwrote_is_a_precondition_failure(lossy) -> None:
    b, proxy, direct = lossy
    proxy.drop_next(b"uploadType=multipart", then=lambda: direct.write("lease", b"other"))
    with pytest.raises(PreconditionFailed) as exc:
        b.create("lease", b"mine")
    assert exc.value.actual == direct.stat("lease").version
    assert direct.read("lease") == b"other"


def test_lost_reply_to_a_replace_and_to_a_resumable_create(lossy) -> None:
    b, proxy, direct = lossy
    v1 = direct.write("obj", b"v1")
    proxy.drop_next(b"uploadType=multipart")
    v2 = b.replace("obj", b"v2", v1.version)
    assert v2 == direct.stat("obj") and direct.read("obj") == b"v2"
    _small_chunks(b)
    data = random.Random(3).randbytes(MIB + 5)
    proxy.drop_next(b"bytes 1048576-")  # the final chunk's PUT (5 bytes after 4 full chunks)
    info = b.create("big", data)
    assert proxy.dropped[-1].startswith(b"PUT") and info == direct.stat("big")
    assert direct.read("big") == data


def test_lost_reply_to_a_refused_resumable_finalisation(lossy) -> None:
    """The final PUT is refused (412) and that answer is lost: the status query says so again."""
    b, proxy, direct = lossy
    _small_chunks(b)
    data = random.Random(4).randbytes(MIB + 5)

    def producer() -> Iterator[bytes]:
        for i in range(0, len(data), 100_000):
            if i + 100_000 >= len(data):  # before our last chunk goes out, a rival takes the key
                direct.create("lease", b"rival")
            yield data[i : i + 100_000]

    proxy.drop_next(f"-{len(data) - 1}/{len(data)}".encode())  # only the final PUT's range
    with pytest.raises(PreconditionFailed) as exc:
        b.create("lease", producer())
    assert proxy.dropped and b" 412 " in proxy.dropped[-1]
    assert exc.value.actual == direct.stat("lease").version and direct.read("lease") == b"rival"


def test_lost_reply_to_a_delete(lossy) -> None:
    b, proxy, direct = lossy
    v = direct.write("obj", b"x")
    proxy.drop_next(b"DELETE ")
    b.delete("obj", version=v.version)  # the retry finds it gone: that was us
    assert not direct.exists("obj")
    with pytest.raises(ObjectNotFound):
        b.delete("obj")  # a plain miss, no lost reply: still an error


# -- a real crash of the uploading client ------------------------------------------------------


def _payload(version: int, size: int) -> bytes:
    block = random.Random(version).randbytes(MIB)
    return (block * (size // MIB + 1))[:size]


def _fork_uploader(
    emulator: Emulator, root: str, key: str, size: int, first: int, chunk: int | None = None
) -> tuple[int, object]:
    """Fork a child that writes versions ``first, first+1...`` of ``key`` until it is killed.

    Forked rather than spawned: importing ckptsdk (torch) in a fresh interpreter costs seconds a
    trial on a busy machine. The child builds its own GCSFileSystem (fsspec gives a forked child a
    new event loop) and reports "ready", "start N" and "wrote N" on a pipe.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(r)
            with os.fdopen(w, "w", buffering=1) as out:
                b = GCSBackend(root, **emulator.storage_options, skip_instance_cache=True)
                if chunk is not None:
                    b.chunk_size = chunk
                data = _payload(first, size)
                out.write("ready\n")
                for version in range(first, first + 1000):
                    out.write(f"start {version}\n")
                    b.write(key, data)
                    out.write(f"wrote {version}\n")
                    data = _payload(version + 1, size)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    progress = os.fdopen(r, "r")
    ready, _, _ = select.select([progress], [], [], 60)
    assert ready and progress.readline() == "ready\n", "uploader child did not start"
    return pid, progress


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "size", "chunk", "window"),
    # Resumable: 24 MiB in three 8 MiB pieces proves what 100 MiB in 64 MiB pieces did (a kill
    # between pieces, inside one, before the finalising one) with a quarter of the bytes.
    [("resumable", 24 * MIB, 8 * MIB, 1.0), ("multipart", 6 * MIB, None, 1.0)],
)
def test_sigkilled_uploader_leaves_old_or_new_never_partial(
    emulator: Emulator, path: str, size: int, chunk: int | None, window: float
) -> None:
    """A child uploading a multi-piece resumable object (or one multipart request) is SIGKILLed at random moments.

    Afterwards the object is absent (nothing finished yet) or whole: by digest, exactly one of the
    versions the child started, and never older than the last one it reported written.
    """
    assert (size > GCSBackend.multipart_max) == (path == "resumable")
    assert chunk is None or size > 2 * chunk, "the resumable case must span several pieces"
    bucket = _bucket(emulator)
    root, key = f"{bucket}/run", "tensors.safetensors"
    reader = _backend(emulator, bucket)
    rng = random.Random(1234)
    digests: dict[str, int] = {}
    version, last_written, mid_write_kills, trials = 0, None, 0, 20
    for trial in range(trials):
        pid, progress = _fork_uploader(emulator, root, key, size, version, chunk)
        try:
            time.sleep(rng.uniform(0.05, window))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with progress:
            lines = progress.read().split()
        started = [int(v) for w, v in pairwise(lines) if w == "start"]
        written = [int(v) for w, v in pairwise(lines) if w == "wrote"]
        for v in started:
            digests.setdefault(xxhash.xxh3_128_hexdigest(_payload(v, size)), v)
        if started and (not written or written[-1] < started[-1]):
            mid_write_kills += 1
        last_written = written[-1] if written else last_written
        version = (started[-1] + 1) if started else version
        try:
            stored = reader.read(key)
        except ObjectNotFound:
            assert last_written is None, f"trial {trial}: version {last_written} was written, object gone"
            continue
        found = digests.get(xxhash.xxh3_128_hexdigest(stored))
        assert found is not None, f"trial {trial}: stored object ({len(stored)} bytes) is no version: torn"
        assert last_written is None or found >= last_written, (trial, found, last_written)
    print(
        f"\n[{path}] {trials} SIGKILLs, {mid_write_kills} landed mid-write; "
        f"{len(digests)} versions started; object always absent or whole"
    )
    assert mid_write_kills >= trials // 2, "the kills did not hit uploads in flight; widen the window"


# -- throughput ---------------------------------------------------------------------------------


def test_throughput_100mb(backend: GCSBackend) -> None:
    data = random.Random(5).randbytes(100 * 1000 * 1000)
    digest = xxhash.xxh3_128_hexdigest(data)
    started = time.perf_counter()
    info = backend.write("blob", data)
    t_write = time.perf_counter() - started
    started = time.perf_counter()
    back = backend.read("blob")
    t_read = time.perf_counter() - started
    started = time.perf_counter()
    out = bytearray(len(data))
    with backend.open("blob") as f:
        view, pos = memoryview(out), 0
        while pos < len(out):
            n = f.readinto(view[pos : pos + 8 * MIB])
            assert n > 0
            pos += n
    t_stream = time.perf_counter() - started
    assert info.size == len(data)
    assert xxhash.xxh3_128_hexdigest(back) == digest == xxhash.xxh3_128_hexdigest(out)
    print(
        f"\n[gcs emulator, 100 MB] write {100 / t_write:.0f} MB/s ({t_write:.2f} s), "
        f"read {100 / t_read:.0f} MB/s ({t_read:.2f} s), "
        f"open+readinto 8 MiB {100 / t_stream:.0f} MB/s ({t_stream:.2f} s)"
    )
    backend.delete("blob")
