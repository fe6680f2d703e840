"""What only the S3 backend has, on the patched moto server (ckptsdk.testing.s3_server) on 127.0.0.1.

The shared contract runs in tests/backends/test_backends.py (TestS3Backend). Here: multi-part
uploads and their end-to-end checksum, lost replies, retries that leave the global RNG alone,
clear errors (no credentials, missing bucket, wrong region, dead endpoint), clients no code here
wrote (boto3, s3fs) reading our objects, the precondition probe, and SIGKILL mid-upload.
"""

from __future__ import annotations

import http.server
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

from ckptsdk import LeaseOptions
from ckptsdk.backends import open_backend
from ckptsdk.backends.cloud.s3 import S3Backend
from ckptsdk.backends.probe import prove_preconditions
from ckptsdk.errors import (
    BackendError,
    ConfigError,
    PreconditionFailed,
    PreconditionsNotHonoured,
    StorageUnavailable,
)
from ckptsdk.testing.s3_server import start_s3_server
from tests.support._crash_child import content

pytestmark = pytest.mark.s3
REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@pytest.fixture
def target(make_backend_target):
    return make_backend_target("s3")


@pytest.fixture
def backend(target) -> S3Backend:
    b = target.open()
    assert isinstance(b, S3Backend)
    return b


def _small_parts(b: S3Backend) -> S3Backend:
    b.multipart_threshold = 5 * MIB  # S3's smallest part: keeps the multi-part tests small
    b.part_size = 5 * MIB
    return b


def test_multipart_round_trip_with_checksum_and_conditions(backend):
    b = _small_parts(backend)
    data = random.Random(1).randbytes(12 * MIB + 7)
    info = b.create("big", data)
    assert info.version.endswith("-3")  # three parts: a multi-part upload really happened
    assert b.read("big") == data and b.stat("big") == info
    with pytest.raises(PreconditionFailed) as exc_info:
        b.create("big", data[::-1])
    assert exc_info.value.actual == info.version
    other = data[::-1]
    newer = b.replace("big", (memoryview(other)[i : i + MIB] for i in range(0, len(other), MIB)), info.version)
    assert newer.size == len(data) and newer.version != info.version
    with pytest.raises(PreconditionFailed) as exc_info:  # If-Match on CompleteMultipartUpload
        b.replace("big", data + b"x", info.version)
    assert (exc_info.value.expected, exc_info.value.actual) == (info.version, newer.version)
    assert b.read("big") == other and b.sweep(0) == []  # refused uploads were aborted, not left


def test_stat_and_list_report_the_store_time(backend):
    before = time.time()
    backend.write("t", b"1")
    stamp = backend.stat("t").mtime
    assert stamp is not None and before - 2 <= stamp <= time.time() + 1
    assert backend.list()[0].mtime == stamp


def test_retries_use_a_private_generator_and_lost_replies_are_ours(backend, s3_server):
    backend.backoff_s = 0.01
    state = random.getstate()
    s3_server.fail(2, method="PUT")
    info = backend.create("k", b"after two 503s")
    assert random.getstate() == state  # the job's Python RNG did not move
    assert backend.read("k") == b"after two 503s"
    s3_server.fail(1, method="PUT", applied=True)  # applied, then the reply is lost
    again = backend.replace("k", b"lost reply", info.version)
    assert again.version == backend.stat("k").version and backend.read("k") == b"lost reply"
    s3_server.fail(1, method="PUT", applied=True)
    with pytest.raises(PreconditionFailed):  # someone else's object answers 412: not ours
        backend.create("k", b"different bytes")
    assert backend.read("k") == b"lost reply"


def test_boto3_and_s3fs_read_and_list_what_we_wrote(backend, s3_server):
    boto3 = pytest.importorskip("boto3")
    s3fs = pytest.importorskip("s3fs")
    big = random.Random(2).randbytes(6 * MIB)
    _small_parts(backend).write("dir/big.bin", big)
    backend.write("dir/small.json", b'{"a": 1}')
    bucket, prefix = backend.bucket, backend.prefix
    opts = s3_server.storage_options
    client = boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        region_name=opts["region"],
        aws_access_key_id=opts["aws_access_key_id"],
        aws_secret_access_key=opts["aws_secret_access_key"],
    )
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/dir/")["Contents"]
    assert sorted(o["Key"] for o in listed) == [f"{prefix}/dir/big.bin", f"{prefix}/dir/small.json"]
    assert client.get_object(Bucket=bucket, Key=f"{prefix}/dir/big.bin")["Body"].read() == big
    fs = s3fs.S3FileSystem(
        key=opts["aws_access_key_id"],
        secret=opts["aws_secret_access_key"],
        client_kwargs={"endpoint_url": opts["endpoint_url"], "region_name": opts["region"]},
        skip_instance_cache=True,
    )
    assert fs.cat_file(f"{bucket}/{prefix}/dir/small.json") == b'{"a": 1}'
    assert fs.cat_file(f"{bucket}/{prefix}/dir/big.bin") == big
    assert sorted(fs.find(f"{bucket}/{prefix}/dir")) == [
        f"{bucket}/{prefix}/dir/big.bin",
        f"{bucket}/{prefix}/dir/small.json",
    ]


def test_no_credentials_is_a_config_error_that_says_where_to_put_them(tmp_path, monkeypatch, s3_server):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ConfigError, match="no AWS credentials found for s3://b-x/run.*AWS_ACCESS_KEY_ID"):
        open_backend("s3://b-x/run", endpoint_url=s3_server.endpoint)


def test_unknown_option_and_missing_bucket(s3_server):
    with pytest.raises(ConfigError, match="unknown storage option"):
        open_backend("s3://b-x/run", token="anon", **s3_server.storage_options)
    b = open_backend("s3://no-such-bucket-here/run", **s3_server.storage_options)
    for call in (lambda: b.list(), lambda: b.read("k"), lambda: b.write("k", b"1"), lambda: b.stat("k")):
        with pytest.raises(StorageUnavailable, match="bucket 'no-such-bucket-here' does not exist"):
            call()


def test_an_endpoint_that_does_not_answer_fails_fast_and_clearly():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at once: nothing listens there
    b = open_backend(
        "s3://bkt/run", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="a", aws_secret_access_key="b"
    )
    b.backoff_s = 0.01
    with pytest.raises(BackendError, match=rf"cannot reach S3 at http://127.0.0.1:{port} .*4 tries") as exc_info:
        b.read("k")
    assert exc_info.value.key == "k"


class _WrongRegion(http.server.BaseHTTPRequestHandler):
    """Answers every request as S3 answers a client that names the wrong region."""

    def _answer(self) -> None:
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code>'
            b"<Message>The bucket you are attempting to access must be addressed using the specified "
            b"endpoint.</Message></Error>"
        )
        self.send_response(301)
        self.send_header("x-amz-bucket-region", "eu-west-3")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = _answer

    def log_message(self, *args: object) -> None:
        pass


def test_a_wrong_region_names_the_right_one():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WrongRegion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        b = open_backend(
            "s3://bkt/run",
            endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
            region="us-east-1",
            aws_access_key_id="a",
            aws_secret_access_key="b",
        )
        with pytest.raises(
            StorageUnavailable, match="not in region 'us-east-1' but in 'eu-west-3'.*region='eu-west-3'"
        ):
            b.list()
    finally:
        server.shutdown()
        server.server_close()


# -- the precondition probe --------------------------------------------------------------------


def test_the_probe_passes_once_on_a_store_that_honours_preconditions(backend):
    prove_preconditions(backend)
    assert backend.list() == []  # the probe object is gone
    sent = sum(backend.requests.values())
    prove_preconditions(backend)  # once per store per process
    assert sum(backend.requests.values()) == sent


def test_the_probe_refuses_a_store_that_ignores_if_match_and_advisory_opts_in():
    import ckptsdk

    with start_s3_server(ignore_if_match=True) as server:
        server.make_bucket("no-cas")
        b = open_backend("s3://no-cas/run", **server.storage_options)
        with pytest.raises(PreconditionsNotHonoured) as exc_info:
            prove_preconditions(b)
        err = exc_info.value
        assert len(err.lacks) == 1 and err.lacks[0].startswith("compare-and-swap")
        assert "preconditions': 'advisory'" in str(err) and "docs/GUARANTEES.md" in str(err)
        assert b.list() == []  # the probe cleaned up after itself
        with pytest.raises(PreconditionsNotHonoured):
            ckptsdk.CheckpointManager("s3://no-cas/run", storage_options=server.storage_options)
        assert b.list() == []  # a refused writer wrote nothing, not even a lease
        # The user's explicit word: the advisory (Drive-style) lease, no probe.
        opts = {**server.storage_options, "preconditions": "advisory"}
        mgr = ckptsdk.CheckpointManager(
            "s3://no-cas/run", storage_options=opts, lease_options=LeaseOptions(ttl=5.0, settle=0.05)
        )
        try:
            assert not mgr.backend.capabilities.compare_and_swap
            mgr.save({"w": __import__("torch").ones(3)}, step=1)
        finally:
            mgr.close()
        assert [
            c.step for c in ckptsdk.CheckpointManager("s3://no-cas/run", storage_options=opts, read_only=True).list()
        ] == [1]


@pytest.mark.gcs
def test_the_probe_refuses_the_stock_gcs_emulator():
    pytest.importorskip("gcp_storage_emulator")
    from ckptsdk.testing.gcs_emulator import start_emulator

    with start_emulator(patched=False) as emulator:
        emulator.make_bucket("stock")
        b = open_backend("gs://stock/run", **emulator.storage_options)
        with pytest.raises(PreconditionsNotHonoured) as exc_info:
            prove_preconditions(b)
        lacks = exc_info.value.lacks
        assert [x.split(" ")[0] for x in lacks] == ["create-if-absent", "compare-and-swap"]
        assert b.list() == []


# -- SIGKILL mid-upload --------------------------------------------------------------------------


def _line(proc: subprocess.Popen, timeout: float) -> list[str]:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"child {proc.pid} printed nothing for {timeout} s"
    return proc.stdout.readline().decode().split()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_mid_upload_leaves_old_or_new_and_sweep_aborts_the_parts(target, tmp_path):
    size = 40 * MIB  # three 16 MiB parts
    known, files = {}, []
    for which in (0, 1):
        data = content(which, size)
        known[xxhash.xxh3_128_hexdigest(data)] = which
        files.append(str(tmp_path / f"c{which}"))
        Path(files[-1]).write_bytes(data)
    backend = target.open()
    env = {**os.environ, "PYTHONPATH": str(REPO), **target.env}
    rng = random.Random(26)
    seen = {"absent": 0, "whole": 0, "aborted": 0}
    cmd = [sys.executable, "-m", "tests.support._crash_child", "zygote", target.url, "ckpt/obj.bin", *files]
    zygote = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    try:
        assert _line(zygote, 120) == ["zygote-ready"]
        publish = 2.0
        for trial in range(8):
            zygote.stdin.write(f"go {trial}\n".encode())
            ready = _line(zygote, 60)
            assert ready[0] == "ready", ready
            time.sleep(rng.uniform(0.1, 1.5 * publish))
            os.kill(int(ready[1]), signal.SIGKILL)
            while (line := _line(zygote, 60))[0] != "reaped":
                publish = float(line[2]) - float(ready[2])
            listed = backend.list()
            assert [o.key for o in listed] in ([], ["ckpt/obj.bin"])
            if listed:
                assert xxhash.xxh3_128_hexdigest(backend.read("ckpt/obj.bin")) in known  # whole, never torn
                seen["whole"] += 1
            else:
                seen["absent"] += 1
            seen["aborted"] += len(backend.sweep(0))  # the killed upload's parts
            assert backend.sweep(0) == []
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
        zygote.stdout.close()
    assert seen["aborted"] >= 2, seen  # kills really landed mid-upload


def test_a_frozen_server_fails_a_call_instead_of_hanging_it_and_is_used_again_after():
    """SIGSTOP the server (its socket stays open: the kernel still accepts and buffers): each call
    ends with BackendError after its attempts time out; after SIGCONT the same backend works."""
    with start_s3_server() as server:
        server.make_bucket("frozen")
        b = open_backend("s3://frozen/run", **server.storage_options)
        b.write("k", b"before")
        patient = (b.connect_timeout_s, b.read_timeout_s, b.max_attempts)
        b.connect_timeout_s = b.read_timeout_s = 1.0
        b.max_attempts, b.backoff_s = 2, 0.01
        b._client = None  # a client with the short timeouts (the cache is keyed by them)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(BackendError, match="failed 2 times") as exc_info:
                b.read("k")
            assert exc_info.value.key == "k"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        # The same backend, patient again: a loaded machine's server, just woken with the
        # timed-out requests still queued, may take over a second to answer the next one.
        b.connect_timeout_s, b.read_timeout_s, b.max_attempts = patient
        b._client = None
        assert b.read("k") == b"before"
