"""One conformance suite for every backend (memory, local, drive on a folder, gcs on the emulator).

Then what only the file backends (local, Drive) have: temp files, sweep, folders, the lock, errno
mapping; and the fault-injecting wrapper of ckptsdk.testing.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import threading
import time

import pytest

from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend, Capabilities, ObjectInfo
from ckptsdk.backends.drive import DriveBackend
from ckptsdk.backends.local import LOCK_NAME, TMP_PREFIX, LocalBackend
from ckptsdk.errors import (
    BackendError,
    InvalidKey,
    ObjectNotFound,
    PreconditionFailed,
    StorageUnavailable,
)
from ckptsdk.testing import FaultyBackend, SimulatedCrash, fail_nth

MIB = 1 << 20
BIG = random.Random(7).randbytes(3 * MIB + 12345)

# What each kind honestly promises (docs/DRIVE.md: no cross-VM exclusion, write-back cache, trash).
EXPECTED_CAPABILITIES = {
    "memory": Capabilities(exclusive_create=True, compare_and_swap=True, durable_on_return=False,
                           cheap_copy=True),
    "local": Capabilities(exclusive_create=True, compare_and_swap=True, cheap_copy=True),
    "drive": Capabilities(exclusive_create=False, compare_and_swap=False, durable_on_return=False,
                          immediately_consistent=False, trash_on_delete=True,
                          rewrite_in_place=True),
    "gcs": Capabilities(exclusive_create=True, compare_and_swap=True, cheap_copy=True),
}


# -- conformance: every backend ------------------------------------------------------------------

# Each case builds its data afresh: a generator can be consumed only once.
ROUND_TRIPS = {
    "empty": (lambda: b"", b""),
    "one-byte": (lambda: b"x", b"x"),
    "chunks": (lambda: [b"ab", bytearray(b"cd"), memoryview(b"ef")], b"abcdef"),
    "generator": (lambda: (bytes([i]) * 1000 for i in range(5)),
                  b"".join(bytes([i]) * 1000 for i in range(5))),
    "no-chunks": (lambda: [], b""),
    "3MiB": (lambda: BIG, BIG),
    "3MiB-chunked": (lambda: (memoryview(BIG)[i:i + MIB] for i in range(0, len(BIG), MIB)), BIG),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_round_trip(backend, case):
    make, expected = ROUND_TRIPS[case]
    info = backend.write("dir/obj.bin", make())
    assert isinstance(info, ObjectInfo)
    assert (info.key, info.size) == ("dir/obj.bin", len(expected))
    assert backend.read("dir/obj.bin") == expected
    assert backend.stat("dir/obj.bin") == info
    assert backend.list("dir/") == [info]
    again = backend.write("dir/obj.bin", make())  # overwrite with the same content
    assert again.version != info.version and backend.read("dir/obj.bin") == expected


def test_is_a_backend_with_its_url(backend, backend_url):
    assert isinstance(backend, Backend)
    assert backend.url == backend_url.url


def test_open_streams_with_readinto_and_seek(backend):
    backend.write("big", BIG)
    buf = bytearray(MIB)
    got = bytearray()
    with backend.open("big") as f:
        while n := f.readinto(buf):
            got += buf[:n]
        assert f.readinto(buf) == 0
        f.seek(len(BIG) - 5)
        assert f.read() == BIG[-5:]
        f.seek(0)
        assert f.read(10) == BIG[:10]
    assert bytes(got) == BIG


def test_list_prefix_semantics(backend):
    sizes = {"a/b/1": 1, "a/b/2": 2, "a/b/c/d": 3, "a/bc": 4, "ab": 5, "z": 0, "a/b0": 6}
    for key, size in sizes.items():
        backend.write(key, b"q" * size)

    def keys(prefix: str = "") -> list[str]:
        infos = backend.list(prefix)
        for info in infos:
            assert info.size == sizes[info.key]
            assert info.version == backend.stat(info.key).version
        return [info.key for info in infos]

    assert keys() == sorted(sizes)
    assert keys("a/b/") == ["a/b/1", "a/b/2", "a/b/c/d"]            # folder: recursive
    assert keys("a/b") == ["a/b/1", "a/b/2", "a/b/c/d", "a/b0", "a/bc"]  # string prefix
    assert keys("a") == ["a/b/1", "a/b/2", "a/b/c/d", "a/b0", "a/bc", "ab"]
    assert keys("a/b/c/d") == ["a/b/c/d"]
    assert keys("nothing/") == [] and keys("q") == []
    assert backend.list("") == backend.list()


def test_stat_and_exists(backend):
    assert not backend.exists("k/v")
    info = backend.write("k/v", b"12345")
    assert backend.exists("k/v")
    assert backend.stat("k/v") == ObjectInfo("k/v", 5, info.version)
    assert not backend.exists("k")  # a folder-like prefix is not an object
    with pytest.raises(ObjectNotFound):
        backend.stat("k")


def test_cheap_copy_where_the_store_has_one(backend):
    """Where ``cheap_copy`` is claimed, ``copy`` duplicates inside the store, refuses an existing
    target and a missing source, and the copies part ways cleanly; Drive says it has none."""
    backend.write("c/src", BIG)
    if not backend.capabilities.cheap_copy:
        with pytest.raises(BackendError):
            backend.copy("c/src", "c/dst")
        assert not backend.exists("c/dst")
        return
    info = backend.copy("c/src", "c/dst")
    assert (info.key, info.size) == ("c/dst", len(BIG)) and backend.stat("c/dst").size == len(BIG)
    assert backend.read("c/dst") == BIG
    with pytest.raises(PreconditionFailed):
        backend.copy("c/src", "c/dst")
    with pytest.raises(ObjectNotFound):
        backend.copy("c/absent", "c/other")
    backend.write("c/src", b"new")  # a write publishes a new object: the copy keeps the old bytes
    assert backend.read("c/dst") == BIG
    backend.delete("c/src")
    assert backend.read("c/dst") == BIG


def test_drive_moves_and_overwrites_a_file_in_place(make_backend_target):
    """The ring retention's primitives: a move keeps the file (same inode: no new upload, no
    trash), an overwrite rewrites that same file to any length; both refuse what they must."""
    b = make_backend_target("drive").open()
    b.write("step-1/tensors", BIG)
    ino = os.stat(os.path.join(b.root, "step-1", "tensors")).st_ino
    moved = b.move("step-1/tensors", "step-2/tensors")
    assert moved.size == len(BIG) and not b.exists("step-1/tensors")
    assert not os.path.exists(os.path.join(b.root, "step-1"))  # the emptied folder is pruned
    for data in (b"short", BIG + b"longer"):
        info = b.overwrite("step-2/tensors", [data[:3], data[3:]])
        assert b.read("step-2/tensors") == data and info == b.stat("step-2/tensors")
        assert os.stat(os.path.join(b.root, "step-2", "tensors")).st_ino == ino
    b.write("step-3/tensors", b"x")
    with pytest.raises(PreconditionFailed):
        b.move("step-2/tensors", "step-3/tensors")
    with pytest.raises(ObjectNotFound):
        b.move("step-9/tensors", "step-8/tensors")
    with pytest.raises(ObjectNotFound):
        b.overwrite("step-9/tensors", b"x")
    assert b.read("step-3/tensors") == b"x"


def test_objects_carry_the_time_the_store_reports(backend):
    """``mtime`` is the store's own time of the last write: the same through write, stat and
    list, moving forward with a later write, and this store's clock (here: 127.0.0.1's)."""
    first = backend.write("t/a", b"1")
    time.sleep(0.02)
    second = backend.write("t/b", b"22")
    for info in (first, second):
        assert isinstance(info.mtime, float)
        assert abs(info.mtime - time.time()) < 120
    listed = {o.key: o for o in backend.list("t/")}
    assert listed["t/a"].mtime == backend.stat("t/a").mtime == first.mtime
    assert listed["t/b"].mtime == second.mtime
    assert second.mtime >= first.mtime
    time.sleep(0.02)
    rewritten = backend.write("t/a", b"333")
    assert rewritten.mtime >= second.mtime and backend.stat("t/a").mtime == rewritten.mtime
    # Equality stays the version's business: a record without a time equals one with it.
    assert ObjectInfo("t/b", 2, second.version) == second


@pytest.mark.parametrize("op", ["read", "open", "stat", "delete"])
def test_missing_key_is_object_not_found(backend, op):
    backend.write("present", b"1")
    with pytest.raises(ObjectNotFound) as exc_info:
        getattr(backend, op)("absent/key")
    assert isinstance(exc_info.value, FileNotFoundError)
    assert exc_info.value.key == "absent/key"
    assert backend.read("present") == b"1"


def test_every_write_gets_a_new_version(backend):
    versions = {backend.write("v", b"same-size").version for _ in range(30)}
    versions.add(backend.create("w", b"same-size").version)
    assert len(versions) == 31


def test_delete_and_delete_with_version(backend):
    backend.write("keep", b"k")
    v1 = backend.write("d", b"1").version
    v2 = backend.write("d", b"2").version
    with pytest.raises(PreconditionFailed) as exc_info:
        backend.delete("d", version=v1)
    assert (exc_info.value.expected, exc_info.value.actual) == (v1, v2)
    assert backend.read("d") == b"2"
    backend.delete("d", version=v2)
    assert not backend.exists("d")
    with pytest.raises(ObjectNotFound):
        backend.delete("d")
    with pytest.raises(ObjectNotFound):
        backend.delete("d", version=v2)
    backend.write("d", b"3")
    backend.delete("d")
    assert [i.key for i in backend.list()] == ["keep"]


def test_create_twice_fails_and_keeps_the_first(backend):
    first = backend.create("lease/LEASE.json", b"first")
    with pytest.raises(PreconditionFailed) as exc_info:
        backend.create("lease/LEASE.json", [b"sec", b"ond"])
    assert exc_info.value.expected is None
    assert exc_info.value.actual == first.version
    assert exc_info.value.key == "lease/LEASE.json"
    assert backend.read("lease/LEASE.json") == b"first"
    assert backend.list() == [first]


def test_replace_checks_the_version(backend):
    v1 = backend.write("r", b"one").version
    v2 = backend.replace("r", b"two", v1)
    assert v2.version != v1 and v2.size == 3
    assert backend.stat("r") == v2 and backend.read("r") == b"two"
    with pytest.raises(PreconditionFailed) as exc_info:
        backend.replace("r", b"three", v1)  # stale
    assert (exc_info.value.expected, exc_info.value.actual) == (v1, v2.version)
    assert backend.read("r") == b"two" and backend.stat("r") == v2
    with pytest.raises(PreconditionFailed) as exc_info:
        backend.replace("never-written", b"x", v1)
    assert (exc_info.value.expected, exc_info.value.actual) == (v1, None)
    assert not backend.exists("never-written")


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a\\b", "", "a/./b", "a/../b", "a/"])
def test_invalid_keys_are_refused_everywhere(backend, key):
    backend.write("ok", b"1")
    calls = [
        lambda: backend.read(key), lambda: backend.open(key), lambda: backend.stat(key),
        lambda: backend.exists(key), lambda: backend.write(key, b"x"),
        lambda: backend.create(key, b"x"), lambda: backend.replace(key, b"x", "1"),
        lambda: backend.delete(key),
    ]
    for call in calls:
        with pytest.raises(InvalidKey) as exc_info:
            call()
        assert isinstance(exc_info.value, ValueError) and exc_info.value.key == key
    assert [i.key for i in backend.list()] == ["ok"]


@pytest.mark.parametrize("prefix", ["../", "/abs", "a//"])
def test_invalid_list_prefix(backend, prefix):
    with pytest.raises(InvalidKey):
        backend.list(prefix)


def test_capabilities_are_an_honest_frozen_record(backend, backend_url):
    caps = backend.capabilities
    assert isinstance(caps, Capabilities) and caps.atomic_publish
    assert caps == EXPECTED_CAPABILITIES[backend_url.kind]
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.exclusive_create = not caps.exclusive_create  # type: ignore[misc]


def test_a_failing_data_iterable_publishes_nothing(backend):
    old = backend.write("obj", b"old")

    class Boom(Exception):
        pass

    def chunks():
        yield b"x" * MIB
        raise Boom("producer failed")

    with pytest.raises(Boom):
        backend.write("obj", chunks())
    with pytest.raises(Boom):
        backend.create("fresh", chunks())
    assert backend.list() == [old]
    assert backend.read("obj") == b"old"
    assert backend.sweep(0) == []  # nothing was left behind either


def test_concurrent_creates_from_threads_have_one_winner(backend):
    results: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def racer(i: int) -> None:
        start.wait(timeout=30)
        try:
            backend.create("one", f"writer-{i}".encode())
            outcome = f"won-{i}"
        except PreconditionFailed:
            outcome = "lost"
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [r for r in results if r.startswith("won")]
    assert len(results) == 6 and len(winners) == 1
    assert backend.read("one") == f"writer-{winners[0][4:]}".encode()


def test_sweep_on_a_clean_store_removes_nothing(backend):
    backend.write("a/b", b"1")
    assert backend.sweep(0) == []
    assert backend.read("a/b") == b"1"


def test_same_name_opens_the_same_store(backend_url):
    a, b = backend_url.open(), backend_url.open()
    a.write("shared", b"1")
    assert b.read("shared") == b"1"


# -- the file backends (local disk, Drive mount) ---------------------------------------------------

@pytest.fixture(params=["local", "drive"])
def file_backend(request, make_backend_target) -> LocalBackend:
    return make_backend_target(request.param).open()


def test_file_backend_classes(make_backend_target):
    assert type(make_backend_target("local").open()) is LocalBackend
    assert type(make_backend_target("drive").open()) is DriveBackend


def test_temp_files_are_not_listed_and_sweep_honours_age(file_backend):
    b = file_backend
    b.write("d/obj", b"1")
    folder = os.path.join(b.root, "d")
    old = os.path.join(folder, f"{TMP_PREFIX}obj.123.deadbeef")
    new = os.path.join(folder, f"{TMP_PREFIX}obj.124.cafef00d")
    for path in (old, new):
        with open(path, "wb") as f:
            f.write(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert [i.key for i in b.list()] == ["d/obj"]
    assert b.sweep(600) == [f"d/{TMP_PREFIX}obj.123.deadbeef"]
    assert os.path.exists(new) and not os.path.exists(old)
    assert b.sweep(0) == [f"d/{TMP_PREFIX}obj.124.cafef00d"]
    assert sorted(os.listdir(folder)) == ["obj"] and b.read("d/obj") == b"1"


def test_reserved_names_are_invalid_keys(file_backend):
    for key in (LOCK_NAME, f"a/{TMP_PREFIX}x", ".ckptsdk-anything"):
        with pytest.raises(InvalidKey):
            file_backend.write(key, b"x")
    # Ordinary dot files are fine.
    file_backend.write(".hidden", b"h")
    assert [i.key for i in file_backend.list()] == [".hidden"]


def test_lock_file_is_never_listed(file_backend):
    v = file_backend.write("x", b"1").version
    file_backend.replace("x", b"2", v)
    assert os.path.exists(os.path.join(file_backend.root, LOCK_NAME))
    assert [i.key for i in file_backend.list()] == ["x"]


def test_missing_root_lists_empty_and_is_not_created_by_reads(tmp_path):
    b = LocalBackend(str(tmp_path / "not" / "yet"))
    assert b.list() == [] and b.list("a/") == [] and not b.exists("a")
    with pytest.raises(ObjectNotFound):
        b.read("a")
    with pytest.raises(ObjectNotFound):
        b.delete("a")
    assert b.sweep(0) == []
    assert not os.path.exists(tmp_path / "not")
    b.write("a/b/c", b"1")  # parents are created on write
    assert b.read("a/b/c") == b"1"


def test_delete_prunes_empty_folders_but_not_the_root(file_backend):
    b = file_backend
    b.write("s/t/u/obj", b"1")
    b.write("s/keep", b"2")
    b.delete("s/t/u/obj")
    assert not os.path.exists(os.path.join(b.root, "s", "t"))
    assert os.path.isdir(os.path.join(b.root, "s"))
    b.delete("s/keep")
    assert os.path.isdir(b.root) and not os.path.exists(os.path.join(b.root, "s"))


def test_writing_under_an_object_is_a_backend_error(file_backend):
    file_backend.write("a", b"file")
    with pytest.raises(BackendError) as exc_info:
        file_backend.write("a/b", b"x")
    assert type(exc_info.value) is BackendError and isinstance(exc_info.value.__cause__, OSError)
    with pytest.raises(ObjectNotFound):
        file_backend.read("a/b")
    assert file_backend.read("a") == b"file"


def test_root_that_is_a_file_is_unavailable(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"not a folder")
    with pytest.raises(StorageUnavailable, match="is a file"):
        LocalBackend(str(path))
    with pytest.raises(StorageUnavailable, match="inside a file"):
        LocalBackend(str(path / "sub"))


def test_root_turned_into_a_file_later_is_unavailable(tmp_path):
    b = LocalBackend(str(tmp_path / "root"))
    (tmp_path / "root").write_bytes(b"oops")
    with pytest.raises(StorageUnavailable):
        b.list()
    with pytest.raises(StorageUnavailable):
        b.write("x", b"1")
    assert (tmp_path / "root").read_bytes() == b"oops"


@pytest.mark.parametrize("code", [errno.ENOTCONN, errno.EIO])
def test_dropped_mount_is_storage_unavailable_with_what_to_do(make_backend_target, monkeypatch, code):
    drive = make_backend_target("drive").open()
    local = make_backend_target("local").open()
    drive.write("x", b"1")
    local.write("x", b"1")

    def dropped(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    # The mount answers every call with this errno once it drops (docs/DRIVE.md: Errno 107).
    with monkeypatch.context() as m:
        for name in ("scandir", "stat", "open", "mkdir"):
            m.setattr(os, name, dropped)
        m.setattr("builtins.open", dropped)
        for b, hint in ((drive, "force_remount=True"), (local, "mounted, readable and writable")):
            for op, args, *kw in (("list", ()), ("read", ("x",)), ("stat", ("x",)), ("write", ("y", b"2")),
                             ("exists", ("x",)), ("delete", ("x",)), ("create", ("z", b"3")),
                             ("replace", ("x", b"4", "1-1-1")), ("delete", ("x",), {"version": "1-1-1"}),
                             ("sweep", (0,))):
                with pytest.raises(StorageUnavailable, match=hint) as exc_info:
                    getattr(b, op)(*args, **(kw[0] if kw else {}))
                assert exc_info.value.__cause__.errno == code
    assert drive.read("x") == b"1" and local.read("x") == b"1"


def test_drive_create_does_not_need_link(make_backend_target, monkeypatch):
    """The mount refuses link() with Errno 38; Drive's create must not use it, local's does."""
    drive = make_backend_target("drive").open()
    local = make_backend_target("local").open()

    def no_link(*args, **kwargs):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "link", no_link)
    drive.create("lease", b"1")
    with pytest.raises(PreconditionFailed):
        drive.create("lease", b"2")
    assert drive.read("lease") == b"1" and drive.sweep(0) == []
    with pytest.raises(BackendError) as exc_info:
        local.create("lease", b"1")
    assert exc_info.value.__cause__.errno == errno.ENOSYS
    assert not local.exists("lease") and local.sweep(0) == []


def test_without_flock_drive_still_works_and_local_refuses(make_backend_target, monkeypatch, caplog):
    """A FUSE mount may refuse flock: Drive (which promises no exclusion) carries on, excluding
    this process's threads; local disk (which promises compare-and-swap) says so instead."""
    drive = make_backend_target("drive").open()
    local = make_backend_target("local").open()

    def no_flock(*args, **kwargs):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr("fcntl.flock", no_flock)
    v = drive.write("x", b"1").version
    assert drive.replace("x", b"2", v).version != v
    winners: list[int] = []
    threads = [threading.Thread(target=_try_create, args=(drive, "one", i, winners)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(winners) == 1 and drive.read("one") == str(winners[0]).encode()
    assert sum("no flock" in r.getMessage() for r in caplog.records) == 1  # told once, not per write
    with pytest.raises(BackendError) as exc_info:
        local.write("x", b"1")
    assert exc_info.value.__cause__.errno == errno.ENOSYS
    assert not local.exists("x") and local.sweep(0) == []


def _try_create(backend, key: str, i: int, winners: list[int]) -> None:
    try:
        backend.create(key, str(i).encode())
        winners.append(i)
    except PreconditionFailed:
        pass


def test_drive_not_mounted(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path / "no-mount"))
    with pytest.raises(StorageUnavailable, match="not mounted"):
        open_backend("drive://run")


# -- FaultyBackend ---------------------------------------------------------------------------------

def test_faulty_backend_fails_the_nth_write_before_it_happens(backend):
    b = FaultyBackend(backend, fail_on=fail_nth("write", 2))
    b.write("a", b"1")
    with pytest.raises(BackendError, match="injected fault: write #2 of 'b'") as exc_info:
        b.write("b", b"2")
    assert exc_info.value.key == "b" and type(exc_info.value) is BackendError
    b.write("c", b"3")  # only the second one
    assert [i.key for i in backend.list()] == ["a", "c"]
    assert b.calls["write"] == 3 and b.calls["list"] == 0
    assert b.log[:2] == [("write", "a"), ("write", "b")]
    assert b.url == backend.url and b.capabilities == backend.capabilities
    assert isinstance(b, Backend)


def test_faulty_backend_fail_after_lands_the_write(backend):
    b = FaultyBackend(backend, fail_after=fail_nth(["create", "replace"], 1, TimeoutError))
    with pytest.raises(TimeoutError, match="create #1"):
        b.create("lease", b"1")
    assert backend.read("lease") == b"1"  # the call did happen
    with pytest.raises(PreconditionFailed):
        b.create("lease", b"2")
    assert b.calls["create"] == 2


def test_faulty_backend_prefix_persist_and_crash(backend):
    crash = SimulatedCrash("killed while writing the manifest")
    b = FaultyBackend(backend, fail_on=fail_nth("write", 2, crash, key_prefix="step-", persist=True))
    b.write("step-1/tensors", b"t")
    b.write("other", b"o")  # does not count: other prefix
    for key in ("step-1/manifest.json", "step-2/tensors"):
        with pytest.raises(SimulatedCrash) as exc_info:
            b.write(key, b"m")
        assert exc_info.value is crash
    assert not isinstance(crash, Exception)
    assert [i.key for i in backend.list()] == ["other", "step-1/tensors"]
    b.fail_on = None
    b.write("step-1/manifest.json", b"m")
    assert b.exists("step-1/manifest.json") and b.calls["write"] == 5 and b.calls["exists"] == 1


def test_faulty_backend_counts_every_op_and_checks_arguments(backend):
    seen = []
    b = FaultyBackend(backend, fail_on=lambda op, key, n: seen.append((op, key, n)))
    v = b.write("k", b"1").version
    b.read("k"), b.stat("k"), b.exists("k"), b.list("k"), b.open("k").close()
    b.replace("k", b"2", v)
    b.delete("k")
    b.create("k", b"3")
    assert b.sweep(0) == []
    assert [op for op, _, _ in seen] == [
        "write", "read", "stat", "exists", "list", "open", "replace", "delete", "create", "sweep"]
    assert all(n == 1 for _, _, n in seen)
    with pytest.raises(ValueError):
        fail_nth("wirte", 1)
    with pytest.raises(ValueError):
        fail_nth("write", 0)
