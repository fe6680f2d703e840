"""Proof that the patch in ckptsdk/testing/gcs_server.py makes the emulator answer like GCS.

Each check runs against a patched and an unpatched server: it must hold on the patched one and
demonstrably fail on the unpatched one (otherwise the patch, or the test, proves nothing). Raw
HTTP (urllib, sockets) and gcsfs are both used, so the fix is not an artefact of our client.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from ckptsdk.testing.gcs_emulator import Emulator, start_emulator
from tests.support.waiting import poll_until

pytestmark = pytest.mark.gcs


@pytest.fixture(scope="module")
def patched() -> Iterator[Emulator]:
    with start_emulator() as emulator:
        yield emulator


@pytest.fixture(scope="module")
def unpatched() -> Iterator[Emulator]:
    with start_emulator(patched=False) as emulator:
        yield emulator


@pytest.fixture(params=["patched", "unpatched"])
def server(request: pytest.FixtureRequest) -> Emulator:
    return request.getfixturevalue(request.param)


def _bucket(emulator: Emulator) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    emulator.make_bucket(name)
    return name


def _media(emulator: Emulator, bucket: str, name: str, body: bytes, **conds: str) -> tuple[int, bytes]:
    query = "".join(f"&{k}={v}" for k, v in conds.items())
    return emulator.request(
        "POST",
        f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}{query}",
        body,
        {"Content-Type": "application/octet-stream"},
    )


def _get(emulator: Emulator, bucket: str, name: str) -> tuple[int, bytes]:
    return emulator.request("GET", f"/download/storage/v1/b/{bucket}/o/{name}?alt=media")


def _meta(emulator: Emulator, bucket: str, name: str) -> dict:
    status, body = emulator.request("GET", f"/storage/v1/b/{bucket}/o/{name}")
    assert status == 200, (status, body)
    return json.loads(body)


def _is_condition_not_met(status: int, body: bytes) -> bool:
    return status == 412 and json.loads(body)["error"]["errors"][0]["reason"] == "conditionNotMet"


def _fs(emulator: Emulator):
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem(**emulator.storage_options, skip_instance_cache=True)


def test_servers_are_ready_and_distinct(patched: Emulator, unpatched: Emulator) -> None:
    assert patched.patched and not unpatched.patched
    assert patched.endpoint != unpatched.endpoint
    assert patched.request("GET", "/") == (200, b"OK")
    assert patched.storage_options == {"endpoint_url": patched.endpoint, "token": "anon", "project": "test"}
    assert patched.env["STORAGE_EMULATOR_HOST"] == patched.endpoint
    assert patched.url("b", "run/x") == "gs://b/run/x" and patched.url("b") == "gs://b"


def test_conditional_create_raw_http(server: Emulator) -> None:
    bucket = _bucket(server)
    assert _media(server, bucket, "k", b"first", ifGenerationMatch="0")[0] == 200
    status, body = _media(server, bucket, "k", b"second", ifGenerationMatch="0")
    kept = _get(server, bucket, "k")[1]
    if server.patched:
        assert _is_condition_not_met(status, body)
        assert kept == b"first"
    else:  # the gap the patch closes: the "create" overwrote an existing object
        assert status == 200 and kept == b"second"


def test_conditional_create_via_gcsfs(server: Emulator) -> None:
    bucket = _bucket(server)
    fs = _fs(server)
    fs.pipe_file(f"{bucket}/k", b"first", mode="create")
    if server.patched:
        with pytest.raises(FileExistsError):
            fs.pipe_file(f"{bucket}/k", b"second", mode="create")
        assert fs.cat_file(f"{bucket}/k") == b"first"
    else:
        fs.pipe_file(f"{bucket}/k", b"second", mode="create")  # no error: preconditions ignored
        assert fs.cat_file(f"{bucket}/k") == b"second"


def test_stale_generation_upload_delete_and_patch(server: Emulator) -> None:
    bucket = _bucket(server)
    old = json.loads(_media(server, bucket, "k", b"v1")[1])["generation"]
    new = json.loads(_media(server, bucket, "k", b"v2")[1])["generation"]
    assert old != new
    upload = _media(server, bucket, "k", b"v3", ifGenerationMatch=old)
    patch = server.request(
        "PATCH",
        f"/storage/v1/b/{bucket}/o/k?ifMetagenerationMatch=7",
        json.dumps({"metadata": {"x": "y"}}).encode(),
        {"Content-Type": "application/json"},
    )
    delete = server.request("DELETE", f"/storage/v1/b/{bucket}/o/k?ifGenerationMatch={old}")
    if server.patched:
        for status, body in (upload, patch, delete):
            assert _is_condition_not_met(status, body)
        assert _get(server, bucket, "k") == (200, b"v2")
        assert _meta(server, bucket, "k")["generation"] == new
        # ...and the matching generation is accepted.
        assert server.request("DELETE", f"/storage/v1/b/{bucket}/o/k?ifGenerationMatch={new}")[0] in (200, 204)
        assert _get(server, bucket, "k")[0] == 404
    else:
        assert upload[0] == 200 and patch[0] == 200 and delete[0] in (200, 204)
        assert _get(server, bucket, "k")[0] == 404


def test_resumable_upload_is_checked_at_finalisation(server: Emulator) -> None:
    """A session opened while the key was free must not overwrite an object created since."""
    bucket = _bucket(server)
    req = urllib.request.Request(
        server.endpoint + f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name=k2&ifGenerationMatch=0",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        location = resp.headers["Location"]
    # Remove the condition from the session URL: the server must remember it from initiation.
    location = location.replace("&ifGenerationMatch=0", "")
    assert _media(server, bucket, "k2", b"someone else")[0] == 200
    final = urllib.request.Request(location, data=b"mine", method="PUT", headers={"Content-Range": "bytes 0-3/4"})
    try:
        with urllib.request.urlopen(final, timeout=10) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    kept = _get(server, bucket, "k2")[1]
    if server.patched:
        assert _is_condition_not_met(status, body)
        assert kept == b"someone else"
    else:
        assert status == 200 and kept == b"mine"


def test_resumable_initiation_fails_fast_on_patched(patched: Emulator) -> None:
    bucket = _bucket(patched)
    assert _media(patched, bucket, "k", b"x")[0] == 200
    status, body = patched.request(
        "POST",
        f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name=k&ifGenerationMatch=0",
        b"{}",
        {"Content-Type": "application/json"},
    )
    assert _is_condition_not_met(status, body)


def _send_short_body(emulator: Emulator, bucket: str, name: str, declared: int, sent: bytes) -> None:
    """A client that dies mid-upload: announce ``declared`` bytes, send fewer, close."""
    head = (
        f"POST /upload/storage/v1/b/{bucket}/o?uploadType=media&name={name} HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{emulator.port}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {declared}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", emulator.port), timeout=10) as sock:
        sock.sendall(head + sent)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass


def test_short_body_creates_nothing(server: Emulator) -> None:
    bucket = _bucket(server)
    _send_short_body(server, bucket, "torn", 1000, b"x" * 400)
    status, body = _get(server, bucket, "torn")  # handled after the short request (one thread)
    if server.patched:
        assert status == 404
    else:  # the truncated upload became a complete-looking object
        assert status == 200 and body == b"x" * 400


def test_short_chunked_body_creates_nothing(patched: Emulator) -> None:
    bucket = _bucket(patched)
    head = (
        f"POST /upload/storage/v1/b/{bucket}/o?uploadType=media&name=c HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{patched.port}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", patched.port), timeout=10) as sock:
        sock.sendall(head + b"5\r\nhello\r\n10\r\nshort")  # dies inside the second chunk
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        while sock.recv(65536):
            pass
    assert _get(patched, bucket, "c")[0] == 404
    # A complete chunked body still works.
    with socket.create_connection(("127.0.0.1", patched.port), timeout=10) as sock:
        sock.sendall(head.replace(b"name=c", b"name=d") + b"5\r\nhello\r\n0\r\n\r\n")
        sock.settimeout(10)
        while sock.recv(65536):
            pass
    assert _get(patched, bucket, "d") == (200, b"hello")


def test_move_to_route(server: Emulator) -> None:
    bucket = _bucket(server)
    assert _media(server, bucket, "src", b"payload")[0] == 200
    assert _media(server, bucket, "taken", b"keep me")[0] == 200
    blocked = server.request("POST", f"/storage/v1/b/{bucket}/o/src/moveTo/o/taken?ifGenerationMatch=0")
    moved = server.request("POST", f"/storage/v1/b/{bucket}/o/src/moveTo/o/dst")
    if server.patched:
        assert _is_condition_not_met(*blocked)
        assert _get(server, bucket, "taken") == (200, b"keep me")
        assert moved[0] == 200 and json.loads(moved[1])["name"] == "dst"
        assert _get(server, bucket, "dst") == (200, b"payload")
        assert _get(server, bucket, "src")[0] == 404
    else:
        assert blocked[0] == 501 and moved[0] == 501


def test_gcsfs_mv_is_fast_on_patched(patched: Emulator) -> None:
    """Shipped, gcsfs retries the 501 for ~30 s before falling back to copy+delete."""
    bucket = _bucket(patched)
    fs = _fs(patched)
    fs.pipe_file(f"{bucket}/a", b"data")
    started = time.monotonic()
    fs.mv(f"{bucket}/a", f"{bucket}/b")
    assert time.monotonic() - started < 5
    assert fs.cat_file(f"{bucket}/b") == b"data"
    assert not fs.exists(f"{bucket}/a")


def test_generation_pinned_read_fails_after_replace(server: Emulator) -> None:
    bucket = _bucket(server)
    gen = json.loads(_media(server, bucket, "k", b"old")[1])["generation"]
    _media(server, bucket, "k", b"new")
    status, body = server.request("GET", f"/download/storage/v1/b/{bucket}/o/k?alt=media&generation={gen}")
    if server.patched:
        assert status == 404
    else:
        assert (status, body) == (200, b"new")  # a reader pinned to "old" silently got "new"


def test_new_objects_start_at_metageneration_1(server: Emulator) -> None:
    bucket = _bucket(server)
    body = (
        b'--b\r\nContent-Type: application/json\r\n\r\n{"name": "m"}\r\n--b\r\n'
        b"Content-Type: application/octet-stream\r\n\r\ndata\r\n--b--\r\n"
    )
    status, _ = server.request(
        "POST",
        f"/upload/storage/v1/b/{bucket}/o?uploadType=multipart",
        body,
        {"Content-Type": 'multipart/related; boundary="b"'},
    )
    assert status == 200
    assert _meta(server, bucket, "m")["metageneration"] == ("1" if server.patched else "2")


_RACER = r"""
import sys, time, urllib.request, urllib.error
endpoint, bucket, name, me, start_at = sys.argv[1:6]
req = urllib.request.Request(
    f"{endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}&ifGenerationMatch=0",
    data=me.encode() * 1000, method="POST", headers={"Content-Type": "application/octet-stream"})
while time.time() < float(start_at):
    time.sleep(0.001)
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        print(r.status)
except urllib.error.HTTPError as e:
    print(e.code)
"""


def _race(emulator: Emulator, bucket: str, name: str, n: int = 12) -> tuple[list[int], bytes]:
    start_at = time.time() + 1.0  # every racer is started and waiting by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, emulator.endpoint, bucket, name, f"p{i:02d}", str(start_at)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    statuses = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        statuses.append(int(out.strip()))
    return statuses, _get(emulator, bucket, name)[1]


def test_twelve_process_create_race_has_one_winner(patched: Emulator, unpatched: Emulator) -> None:
    bucket = _bucket(patched)
    for round_ in range(3):
        statuses, kept = _race(patched, bucket, f"race-{round_}")
        assert sorted(statuses) == [200] + [412] * 11, statuses
        assert len(kept) == 3000 and kept == kept[:3] * 1000  # whole, one racer's bytes
    # Unpatched, every racer "wins" and the last one silently overwrites the others.
    bucket = _bucket(unpatched)
    statuses, _ = _race(unpatched, bucket, "race")
    assert statuses.count(200) == 12


def _open_session(emulator: Emulator, bucket: str, name: str) -> str:
    req = urllib.request.Request(
        emulator.endpoint + f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name={name}",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.headers["Location"]


def _put(location: str, body: bytes, content_range: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(location, data=body, method="PUT", headers={"Content-Range": content_range})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_resumable_status_query(server: Emulator) -> None:
    """A client whose final reply was lost asks the session; GCS says "done" (200 + object)."""
    bucket = _bucket(server)
    empty = _open_session(server, bucket, "e")
    status, headers, _ = _put(empty, b"", "bytes */4")
    assert status == 308
    assert headers.get("Range") == (None if server.patched else "bytes=0-0")  # shipped: 1 byte "held"
    done = _open_session(server, bucket, "d")
    assert _put(done, b"data", "bytes 0-3/4")[0] == 200
    status, _, body = _put(done, b"", "bytes */4")
    if server.patched:
        assert status == 200 and json.loads(body)["name"] == "d"
    else:
        assert status == 404  # the client cannot learn that its upload completed
    assert _get(server, bucket, "d") == (200, b"data")


def test_listen_backlog(server: Emulator) -> None:
    """While the one server thread is busy, the kernel must still accept the next connections."""
    blocker = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        # A request whose body never comes keeps the single-threaded server busy reading it.
        blocker.sendall(
            b"POST /upload/storage/v1/b/x/o?uploadType=media&name=y HTTP/1.1\r\n"
            b"Host: 127.0.0.1\r\nContent-Length: 10\r\n\r\n"
        )
        time.sleep(0.2)  # left: nothing outside the server says it is now reading the blocker
        waiting, connected = [], 0
        for _ in range(20):
            sock = socket.socket()
            sock.settimeout(0.2)
            waiting.append(sock)
            try:
                sock.connect(("127.0.0.1", server.port))
                connected += 1
            except OSError:  # SYN dropped: the accept queue is full
                pass
    finally:
        blocker.close()  # the server sees a short body and moves on
        for sock in waiting:
            sock.close()
    if server.patched:
        assert connected == 20
    else:
        assert connected <= 8
    assert server.request("GET", "/") == (200, b"OK")


def test_server_exits_when_the_process_that_started_it_is_killed() -> None:
    code = (
        "from ckptsdk.testing.gcs_emulator import start_emulator; e = start_emulator(); "
        "print(e.proc.pid, flush=True); import time; time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()

    def gone() -> bool:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return True
        return False

    if poll_until(gone, 30):  # the watchdog polls every 0.5 s
        return
    os.kill(server_pid, 9)
    pytest.fail(f"emulator {server_pid} outlived the process that started it")
