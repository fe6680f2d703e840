"""The shipped conformance suite (ckptsdk.testing.conformance) run on every backend of ours (memory,
local, drive on a folder, gcs on the emulator, s3 on the patched moto server).

Then what only the file backends (local, Drive) have: temp files, sweep, folders, the lock, errno
mapping; and the fault-injecting wrapper of ckptsdk.testing.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from typing import ClassVar

import pytest

from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend, Capabilities, browser
from ckptsdk.backends.drive import DriveBackend
from ckptsdk.backends.local import LOCK_NAME, RESERVED_PREFIX, TMP_PREFIX, LocalBackend
from ckptsdk.errors import (
    BackendError,
    InvalidKey,
    ObjectNotFound,
    PreconditionFailed,
    StorageUnavailable,
)
from ckptsdk.testing import FaultyBackend, SimulatedCrash, fail_nth
from ckptsdk.testing.conformance import BackendConformance

MIB = 1 << 20
BIG = random.Random(7).randbytes(3 * MIB + 12345)  # the same bytes as the suite's

# What each kind honestly promises (docs/DRIVE.md: no cross-VM exclusion, write-back cache, trash).
EXPECTED_CAPABILITIES = {
    "memory": Capabilities(exclusive_create=True, compare_and_swap=True, durable_on_return=False, cheap_copy=True),
    "local": Capabilities(exclusive_create=True, compare_and_swap=True, cheap_copy=True),
    "drive": Capabilities(
        exclusive_create=False,
        compare_and_swap=False,
        durable_on_return=False,
        immediately_consistent=False,
        trash_on_delete=True,
        rewrite_in_place=True,
    ),
    "gcs": Capabilities(exclusive_create=True, compare_and_swap=True, cheap_copy=True, remote_conditions=True),
    "s3": Capabilities(exclusive_create=True, compare_and_swap=True, cheap_copy=True, remote_conditions=True),
}


# -- conformance: every backend, through the suite shipped to backend authors ------------------


class _OurBackend(BackendConformance):
    """The shipped suite (ckptsdk.testing.conformance) on fresh storage of one of our kinds."""

    kind: ClassVar[str]

    @pytest.fixture
    def target(self, make_backend_target):
        return make_backend_target(self.kind)

    @pytest.fixture
    def backend(self, target):
        return target.open()

    @pytest.fixture
    def reopen(self, target):
        return target.open

    @pytest.fixture
    def expected_capabilities(self):
        return EXPECTED_CAPABILITIES[self.kind]


class TestMemoryBackend(_OurBackend):
    kind = "memory"


class TestLocalBackend(_OurBackend):
    kind = "local"


class TestDriveBackend(_OurBackend):
    kind = "drive"


@pytest.mark.gcs
class TestGCSBackend(_OurBackend):
    kind = "gcs"


@pytest.mark.s3
class TestS3Backend(_OurBackend):
    kind = "s3"
    versions_name_content = True  # the ETag is the bytes' MD5
    reports_mtime = False  # PutObject answers no time; stat/list do (tests/backends/test_s3_backend.py)


def test_the_suite_runs_on_every_kind():
    """No kind of ours is left out of the shipped suite (a new backend gets a Test class)."""
    covered = {cls.kind for cls in _OurBackend.__subclasses__()}
    assert covered == set(EXPECTED_CAPABILITIES) == {"memory", "local", "drive", "gcs", "s3"}


def test_is_a_backend_with_its_url(backend, backend_url):
    assert isinstance(backend, Backend)
    assert backend.url == backend_url.url


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


def test_folder_names_of_a_file_root(file_backend, tmp_path):
    """``list_folders`` reads the root once: a folder holding only a temp file (a write under way)
    is named, its listing empty; reserved names and symlinked folders are not; a missing root
    has none and a root that became a file is unavailable, as ``list`` says."""
    b = file_backend
    b.write("step-1/a", b"1")
    os.makedirs(os.path.join(b.root, "step-2"))
    with open(os.path.join(b.root, "step-2", TMP_PREFIX + "a.x"), "wb") as f:
        f.write(b"half")
    os.makedirs(os.path.join(b.root, RESERVED_PREFIX + "x"))
    os.symlink(os.path.join(b.root, "step-1"), os.path.join(b.root, "step-3"))
    assert b.list_folders("step-") == ["step-1", "step-2"] and b.list("step-2/") == []
    assert [o.key for o in b.list("step-")] == ["step-1/a"]
    assert LocalBackend(str(tmp_path / "not" / "yet")).list_folders("") == []
    gone = LocalBackend(str(tmp_path / "root"))
    (tmp_path / "root").write_bytes(b"oops")
    with pytest.raises(StorageUnavailable):
        gone.list_folders("")
    assert (tmp_path / "root").read_bytes() == b"oops"


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
            for op, args, *kw in (
                ("list", ()),
                ("read", ("x",)),
                ("stat", ("x",)),
                ("write", ("y", b"2")),
                ("exists", ("x",)),
                ("delete", ("x",)),
                ("create", ("z", b"3")),
                ("replace", ("x", b"4", "1-1-1")),
                ("delete", ("x",), {"version": "1-1-1"}),
                ("sweep", (0,)),
            ):
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


def test_faulty_backend_names_folders_only_where_its_store_does_and_as_a_listing(backend):
    """``list_folders`` through FaultyBackend is a "list" call (a fault aimed at the listings hits
    it too), and exists only where the wrapped store has it (``browser`` finds it, or not)."""
    backend.write("f/a", b"1")

    class Plain:  # a store without list_folders: forwards the rest
        url, capabilities = backend.url, backend.capabilities

        def __getattr__(self, name: str) -> object:
            if name == "list_folders":
                raise AttributeError(name)
            return getattr(backend, name)

    plain = FaultyBackend(Plain())
    assert browser(plain) is None and not hasattr(plain, "list_folders") and plain.list("f/")[0].key == "f/a"
    b = FaultyBackend(backend, fail_on=fail_nth("list", 1))
    assert browser(backend) is backend and browser(b) is b
    with pytest.raises(BackendError, match="injected fault: list #1"):
        b.list_folders("")
    assert b.list_folders("") == ["f"] and b.calls["list"] == 2 and backend.read("f/a") == b"1"


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
        "write",
        "read",
        "stat",
        "exists",
        "list",
        "open",
        "replace",
        "delete",
        "create",
        "sweep",
    ]
    assert all(n == 1 for _, _, n in seen)
    with pytest.raises(ValueError):
        fail_nth("wirte", 1)
    with pytest.raises(ValueError):
        fail_nth("write", 0)
