"""Folder fsyncs put off to one per folder (``posix.deferred_dir_sync``), and a new folder's name
made durable (``posix.make_folders``): which fsyncs a local publish and delete make, counted by
patching ``os.fsync``."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ckptsdk.backends.local import LocalBackend
from ckptsdk.backends.posix import deferred_dir_sync

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced files through /proc")


def _count(monkeypatch: pytest.MonkeyPatch, root: str) -> list[str]:
    """Folders fsynced from now on, relative to ``root`` ("." for it); files are left out."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            seen.append(os.path.relpath(path, root))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _backend(tmp_path: Any) -> tuple[LocalBackend, str]:
    root = str(tmp_path / "root")
    backend = LocalBackend(root)
    backend.write("seed", b"x")  # the root exists: its creation is not what these count
    return backend, root


def test_outside_a_block_every_publish_fsyncs_its_folder_and_a_new_folders_parent(tmp_path, monkeypatch):
    backend, root = _backend(tmp_path)
    dirs = _count(monkeypatch, root)
    backend.write("a/x", b"1")  # creates a/: the root records its name
    backend.write("a/y", b"2")
    assert dirs == [".", "a", "a"]


def test_a_block_fsyncs_each_folder_once_at_its_end(tmp_path, monkeypatch):
    backend, root = _backend(tmp_path)
    dirs = _count(monkeypatch, root)
    with deferred_dir_sync():
        backend.write("a/x", b"1")
        backend.write("a/y", b"2")
        backend.write("z", b"3")
        assert dirs == []  # nothing yet: the data was fsynced, the names wait for the block's end
    assert sorted(dirs) == [".", "a"]
    assert backend.read("a/x") == b"1" and backend.read("a/y") == b"2" and backend.read("z") == b"3"


def test_a_folder_removed_in_the_block_fsyncs_its_parent(tmp_path, monkeypatch):
    backend, root = _backend(tmp_path)
    backend.write("a/x", b"1")
    dirs = _count(monkeypatch, root)
    with deferred_dir_sync():
        backend.delete("a/x")  # empties a/, which is pruned: the root holds the removal
    assert dirs == ["."]
    assert not os.path.exists(os.path.join(root, "a"))


def test_a_block_without_sync_fsyncs_no_folder_and_loses_nothing_a_process_sees(tmp_path, monkeypatch):
    backend, root = _backend(tmp_path)
    backend.write("a/x", b"1")
    backend.write("a/y", b"2")
    dirs = _count(monkeypatch, root)
    with deferred_dir_sync(sync=False):
        backend.delete("a/x")
    assert dirs == []
    assert [o.key for o in backend.list("a/")] == ["a/y"]


def test_a_failing_block_still_fsyncs_what_it_published_and_raises_its_own_error(tmp_path, monkeypatch):
    backend, root = _backend(tmp_path)
    dirs = _count(monkeypatch, root)
    with pytest.raises(KeyError):
        with deferred_dir_sync():
            backend.write("z", b"3")
            raise KeyError("the caller's failure")
    assert dirs == ["."]
    assert backend.read("z") == b"3"


def test_blocks_nest_into_the_outermost_and_other_threads_are_not_deferred(tmp_path, monkeypatch):
    import threading

    backend, root = _backend(tmp_path)
    dirs = _count(monkeypatch, root)
    with deferred_dir_sync():
        with deferred_dir_sync(sync=False):
            backend.write("z", b"3")
        assert dirs == []  # the inner block belongs to the outer one
        other = threading.Thread(target=lambda: backend.write("w", b"4"))
        other.start()
        other.join()
        assert dirs == ["."]  # the other thread's publish fsynced at once
    assert dirs == [".", "."]


def test_the_backend_durability_block_is_the_deferred_one_on_local_disk(tmp_path, monkeypatch):
    # The upper layers say ``durable_batch(backend)`` and never import a file backend's module.
    from ckptsdk.backends.base import durable_batch

    backend, root = _backend(tmp_path)
    dirs = _count(monkeypatch, root)
    with durable_batch(backend):
        backend.write("a/x", b"1")
        backend.write("a/y", b"2")
        assert dirs == []
    assert sorted(dirs) == [".", "a"]


def test_a_store_without_durability_work_gets_a_block_that_does_nothing():
    from ckptsdk.backends import open_backend
    from ckptsdk.backends.base import Batching, durable_batch

    memory = open_backend("memory://durable-batch")
    assert not isinstance(memory, Batching)
    with durable_batch(memory):
        memory.write("k", b"v")
    assert memory.read("k") == b"v"


def test_no_layer_above_the_backends_imports_a_file_backend_module():
    import pathlib

    package = pathlib.Path(__file__).resolve().parents[2] / "ckptsdk"
    offenders = [
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.parent.name != "backends" and "backends.posix" in p.read_text()
    ]
    assert offenders == []
