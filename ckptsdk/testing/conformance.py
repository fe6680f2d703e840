"""The backend conformance suite: pytest base classes a backend author subclasses (fsspec style).

Subclass :class:`BackendConformance` in a test file and override its ``backend`` and ``reopen``
fixtures; pytest then runs every contract test of ``ckptsdk/backends/base.py`` against your
backend. Needs pytest (a test dependency, not one of ckptsdk's). ckptsdk runs it against its own
backends in tests/backends/test_backends.py. What only one backend has belongs in that backend's tests.
"""

from __future__ import annotations

import dataclasses
import io
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

import pytest

from ckptsdk.backends.base import Backend, Browsable, Capabilities, Copyable, Data, ObjectInfo, browser, copier
from ckptsdk.errors import BackendError, InvalidKey, ObjectNotFound, PreconditionFailed

__all__ = ["BackendConformance"]

MIB = 1 << 20
BIG = random.Random(7).randbytes(3 * MIB + 12345)

# Each case builds its data afresh: a generator can be consumed only once.
ROUND_TRIPS: dict[str, tuple[Callable[[], Data], bytes]] = {
    "empty": (lambda: b"", b""),
    "one-byte": (lambda: b"x", b"x"),
    "chunks": (lambda: [b"ab", bytearray(b"cd"), memoryview(b"ef")], b"abcdef"),
    "generator": (lambda: (bytes([i]) * 1000 for i in range(5)), b"".join(bytes([i]) * 1000 for i in range(5))),
    "no-chunks": (lambda: [], b""),
    "3MiB": (lambda: BIG, BIG),
    "3MiB-chunked": (lambda: (memoryview(BIG)[i : i + MIB] for i in range(0, len(BIG), MIB)), BIG),
}


class BackendConformance:
    """Contract tests for one backend; subclass it as ``Test<YourBackend>`` and override fixtures.

    Required fixtures (the defaults raise ``NotImplementedError``):

    - ``backend``: a fresh, empty backend (a new folder, bucket prefix or store per test).
    - ``reopen``: a callable that opens the *same* store again, as a second process would.

    Optional:

    - ``expected_capabilities``: the exact :class:`Capabilities` your backend must report;
      ``None`` (the default) only checks that it is a frozen record with ``atomic_publish``.

    Class attributes: ``reports_mtime`` (default True): the store reports the time of each write
    in ``ObjectInfo.mtime``; set False where it reports none. ``versions_name_content`` (default
    False): the version token is a hash of the bytes (S3's ETag), so writing the same bytes again
    gives the same token; the suite then checks that different bytes get different tokens.

    Example (in your ``tests/test_mybackend.py``)::

        import pytest
        from ckptsdk.testing.conformance import BackendConformance

        class TestMyBackend(BackendConformance):
            @pytest.fixture
            def backend(self, tmp_path):
                return MyBackend(tmp_path / "root")

            @pytest.fixture
            def reopen(self, tmp_path):
                return lambda: MyBackend(tmp_path / "root")
    """

    reports_mtime = True
    versions_name_content = False

    @pytest.fixture
    def backend(self) -> Backend:
        """A fresh, empty backend: override this fixture."""
        raise NotImplementedError(
            f"{type(self).__name__}: override the `backend` fixture (return a fresh, empty backend)"
        )

    @pytest.fixture
    def reopen(self) -> Callable[[], Backend]:
        """Opens the same store as ``backend`` again: override this fixture."""
        raise NotImplementedError(
            f"{type(self).__name__}: override the `reopen` fixture "
            "(return a callable that opens the backend's store again)"
        )

    @pytest.fixture
    def expected_capabilities(self) -> Capabilities | None:
        """The exact capabilities to expect, or None to check only their shape."""
        return None

    def test_is_a_backend(self, backend: Backend) -> None:
        assert isinstance(backend, Backend)
        assert isinstance(backend.url, str) and backend.url

    def test_capabilities_are_an_honest_frozen_record(
        self, backend: Backend, expected_capabilities: Capabilities | None
    ) -> None:
        caps = backend.capabilities
        assert isinstance(caps, Capabilities) and caps.atomic_publish
        if expected_capabilities is not None:
            assert caps == expected_capabilities
        with pytest.raises(dataclasses.FrozenInstanceError):
            caps.exclusive_create = not caps.exclusive_create  # type: ignore[misc]

    def test_same_store_opened_twice(self, backend: Backend, reopen: Callable[[], Backend]) -> None:
        a, b = backend, reopen()
        a.write("shared", b"1")
        assert b.read("shared") == b"1"

    @pytest.mark.parametrize("case", list(ROUND_TRIPS))
    def test_round_trip(self, backend: Backend, case: str) -> None:
        make, expected = ROUND_TRIPS[case]
        info = backend.write("dir/obj.bin", make())
        assert isinstance(info, ObjectInfo)
        assert (info.key, info.size) == ("dir/obj.bin", len(expected))
        assert backend.read("dir/obj.bin") == expected
        assert backend.stat("dir/obj.bin") == info
        assert backend.list("dir/") == [info]
        again = backend.write("dir/obj.bin", make())  # overwrite with the same content
        assert (again.version == info.version) if self.versions_name_content else (again.version != info.version)
        assert backend.read("dir/obj.bin") == expected

    def test_open_streams_with_readinto_and_seek(self, backend: Backend) -> None:
        backend.write("big", BIG)
        buf = bytearray(MIB)
        got = bytearray()
        with backend.open("big") as stream:
            f = cast(io.BufferedIOBase, stream)  # the contract: open() supports readinto and seek
            while n := f.readinto(buf):
                got += buf[:n]
            assert f.readinto(buf) == 0
            f.seek(len(BIG) - 5)
            assert f.read() == BIG[-5:]
            f.seek(0)
            assert f.read(10) == BIG[:10]
        assert bytes(got) == BIG

    def test_list_prefix_semantics(self, backend: Backend) -> None:
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
        assert keys("a/b/") == ["a/b/1", "a/b/2", "a/b/c/d"]  # folder: recursive
        assert keys("a/b") == ["a/b/1", "a/b/2", "a/b/c/d", "a/b0", "a/bc"]  # string prefix
        assert keys("a") == ["a/b/1", "a/b/2", "a/b/c/d", "a/b0", "a/bc", "ab"]
        assert keys("a/b/c/d") == ["a/b/c/d"]
        assert keys("nothing/") == [] and keys("q") == []
        assert backend.list("") == backend.list()

    def test_folders_are_named_without_their_files(self, backend: Backend) -> None:
        """Where the store names its top-level folders (``browser``), they are the first parts of
        the keys ``list`` shows under the prefix, sorted; a prefix with a ``/`` is refused."""
        for key in ("a/1", "a/b/2", "ab/3", "b/4", "top", "abc"):
            backend.write(key, b"x")
        naming = browser(backend)
        if naming is None:
            assert not isinstance(backend, Browsable)
            return
        assert naming.list_folders("") == ["a", "ab", "b"]
        assert naming.list_folders("a") == ["a", "ab"]
        assert naming.list_folders("q") == []
        backend.delete("b/4")
        assert naming.list_folders("") == ["a", "ab"]  # its last object gone: no folder left
        with pytest.raises(InvalidKey):
            naming.list_folders("a/")
        assert [i.key for i in backend.list()] == ["a/1", "a/b/2", "ab/3", "abc", "top"]

    def test_stat_and_exists(self, backend: Backend) -> None:
        assert not backend.exists("k/v")
        info = backend.write("k/v", b"12345")
        assert backend.exists("k/v")
        assert backend.stat("k/v") == ObjectInfo("k/v", 5, info.version)
        assert not backend.exists("k")  # a folder-like prefix is not an object
        with pytest.raises(ObjectNotFound):
            backend.stat("k")

    def test_cheap_copy_where_the_store_has_one(self, backend: Backend) -> None:
        """Where ``cheap_copy`` is claimed, ``copy`` duplicates inside the store, refuses an existing
        target and a missing source, and the copies part ways cleanly; Drive says it has none."""
        backend.write("c/src", BIG)
        copying = copier(backend)
        if copying is None:
            assert not backend.capabilities.cheap_copy
            if isinstance(backend, Copyable):  # Drive has the method, only to say it cannot
                with pytest.raises(BackendError):
                    backend.copy("c/src", "c/dst")
            assert not backend.exists("c/dst")
            return
        info = copying.copy("c/src", "c/dst")
        assert (info.key, info.size) == ("c/dst", len(BIG)) and backend.stat("c/dst").size == len(BIG)
        assert backend.read("c/dst") == BIG
        with pytest.raises(PreconditionFailed):
            copying.copy("c/src", "c/dst")
        with pytest.raises(ObjectNotFound):
            copying.copy("c/absent", "c/other")
        backend.write("c/src", b"new")  # a write publishes a new object: the copy keeps the old bytes
        assert backend.read("c/dst") == BIG
        backend.delete("c/src")
        assert backend.read("c/dst") == BIG

    def test_objects_carry_the_time_the_store_reports(self, backend: Backend) -> None:
        """``mtime`` is the store's own time of the last write: the same through write, stat and
        list, moving forward with a later write, and this store's clock (here: 127.0.0.1's)."""
        first = backend.write("t/a", b"1")
        time.sleep(0.02)
        second = backend.write("t/b", b"22")
        # Equality stays the version's business: a record without a time equals one with it.
        assert ObjectInfo("t/b", 2, second.version) == second
        if not self.reports_mtime:
            assert first.mtime is None and second.mtime is None
            return
        for mtime in (first.mtime, second.mtime):
            assert isinstance(mtime, float)
            assert abs(mtime - time.time()) < 120
        assert first.mtime is not None and second.mtime is not None
        listed = {o.key: o for o in backend.list("t/")}
        assert listed["t/a"].mtime == backend.stat("t/a").mtime == first.mtime
        assert listed["t/b"].mtime == second.mtime
        assert second.mtime >= first.mtime
        time.sleep(0.02)
        rewritten = backend.write("t/a", b"333")
        assert rewritten.mtime is not None and rewritten.mtime >= second.mtime
        assert backend.stat("t/a").mtime == rewritten.mtime

    @pytest.mark.parametrize("op", ["read", "open", "stat", "delete"])
    def test_missing_key_is_object_not_found(self, backend: Backend, op: str) -> None:
        backend.write("present", b"1")
        with pytest.raises(ObjectNotFound) as exc_info:
            getattr(backend, op)("absent/key")
        assert isinstance(exc_info.value, FileNotFoundError)
        assert exc_info.value.key == "absent/key"
        assert backend.read("present") == b"1"

    def test_every_write_gets_a_new_version(self, backend: Backend) -> None:
        if self.versions_name_content:  # same bytes, same token: every *different* write differs
            versions = {backend.write("v", b"size-%02d" % i).version for i in range(30)}
            versions.add(backend.create("w", b"size-99").version)
        else:
            versions = {backend.write("v", b"same-size").version for _ in range(30)}
            versions.add(backend.create("w", b"same-size").version)
        assert len(versions) == 31

    def test_delete_and_delete_with_version(self, backend: Backend) -> None:
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

    def test_create_twice_fails_and_keeps_the_first(self, backend: Backend) -> None:
        first = backend.create("lease/LEASE.json", b"first")
        with pytest.raises(PreconditionFailed) as exc_info:
            backend.create("lease/LEASE.json", [b"sec", b"ond"])
        assert exc_info.value.expected is None
        assert exc_info.value.actual == first.version
        assert exc_info.value.key == "lease/LEASE.json"
        assert backend.read("lease/LEASE.json") == b"first"
        assert backend.list() == [first]

    def test_replace_checks_the_version(self, backend: Backend) -> None:
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
    def test_invalid_keys_are_refused_everywhere(self, backend: Backend, key: str) -> None:
        backend.write("ok", b"1")
        calls: list[Callable[[], object]] = [
            lambda: backend.read(key),
            lambda: backend.open(key),
            lambda: backend.stat(key),
            lambda: backend.exists(key),
            lambda: backend.write(key, b"x"),
            lambda: backend.create(key, b"x"),
            lambda: backend.replace(key, b"x", "1"),
            lambda: backend.delete(key),
        ]
        for call in calls:
            with pytest.raises(InvalidKey) as exc_info:
                call()
            assert isinstance(exc_info.value, ValueError) and exc_info.value.key == key
        assert [i.key for i in backend.list()] == ["ok"]

    @pytest.mark.parametrize("prefix", ["../", "/abs", "a//"])
    def test_invalid_list_prefix(self, backend: Backend, prefix: str) -> None:
        with pytest.raises(InvalidKey):
            backend.list(prefix)

    def test_a_failing_data_iterable_publishes_nothing(self, backend: Backend) -> None:
        old = backend.write("obj", b"old")

        class Boom(Exception):
            pass

        def chunks() -> Iterator[bytes]:
            yield b"x" * MIB
            raise Boom("producer failed")

        with pytest.raises(Boom):
            backend.write("obj", chunks())
        with pytest.raises(Boom):
            backend.create("fresh", chunks())
        assert backend.list() == [old]
        assert backend.read("obj") == b"old"
        assert backend.sweep(0) == []  # nothing was left behind either

    def test_concurrent_creates_from_threads_have_one_winner(self, backend: Backend) -> None:
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

    def test_sweep_on_a_clean_store_removes_nothing(self, backend: Backend) -> None:
        backend.write("a/b", b"1")
        assert backend.sweep(0) == []
        assert backend.read("a/b") == b"1"
