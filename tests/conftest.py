"""Shared fixtures: fresh storage of every backend kind, and the GCS emulator server.

Fixtures (all storage is fresh per test and lives under ``tmp_path`` or in the emulator):

- ``gcs_emulator`` (session): the running ``ckptsdk.testing.gcs_emulator.Emulator`` (patched), started on
  first use and stopped at the end of the session (one per pytest-xdist worker, each on its own
  free port).
- ``s3_server`` (session): the running ``ckptsdk.testing.s3_server.S3Server`` (moto, patched to be
  atomic); ``make_backend_target("s3")`` gives ``s3://<fresh bucket>/run`` on it.
- ``backend_url`` (parametrized, ids ``memory``/``local``/``drive``/``gcs``/``s3``; the gcs one is
  marked ``gcs``, the s3 one ``s3``): a :class:`BackendTarget`, which *is* the URL (a ``str``) and also carries
  ``.url`` (the same str), ``.kind`` (the id), ``.options`` (storage options for
  ``open_backend(url, **options)`` / ``CheckpointManager(url, storage_options=options)``: ``{}``
  except for gcs and s3) and ``.env`` (environment variables a child process needs to open the
  URL: ``CKPTSDK_DRIVE_ROOT`` for drive, ``STORAGE_EMULATOR_HOST``... for gcs, the S3 server's
  endpoint and keys for s3). URLs:
  memory ``memory://test-<hex>-run`` (store dropped at teardown), local ``<tmp_path>/local-run``,
  drive ``drive://run`` with ``CKPTSDK_DRIVE_ROOT`` monkeypatched to ``<tmp_path>/drive``
  (so children inherit it), gcs ``gs://<fresh bucket>/run``, s3 ``s3://<fresh bucket>/run``.
- ``storage_options``: ``backend_url.options`` (a dict).
- ``backend``: ``open_backend(backend_url.url, **backend_url.options)``.
- ``make_backend_target``: a factory ``(kind, name="run") -> BackendTarget`` for tests that want
  one kind, or two roots in one test (each call with a new ``name`` gives fresh storage).
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tests.support.hypothesis_profiles  # noqa: F401  (registers the ci/deep profiles: --hypothesis-profile=deep)
from ckptsdk.backends import open_backend
from ckptsdk.backends.memory import MemoryBackend

# The local HTTP server and CIFAR fixtures (tests/support/cifar_fixtures.py), shared here so test files
# take them by argument name without importing names their arguments then shadow (ruff F811).
from tests.support.cifar_fixtures import cifar_files, cifar_server, http_server, small_cifar  # noqa: F401


def pytest_configure(config: pytest.Config) -> None:
    """Under CI (CKPTSDK_REQUIRE_ALL=1, set by .ci/run) a missing optional package is a failure.

    The dev extra installs every framework the integration tests need; an install that silently
    lost one would otherwise turn those tests into skips and CI would stay green.
    """
    if os.environ.get("CKPTSDK_REQUIRE_ALL") != "1":
        return

    def importorskip(modname: str, *args: Any, **kwargs: Any) -> Any:
        return importlib.import_module(modname)  # ImportError: the test errors, it is not skipped

    pytest.importorskip = importorskip  # type: ignore[assignment]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/test.sh), hand out the ``slow`` tests first.

    The workers take tests in collection order, one after another as they finish; a 40 s test
    picked up last would leave the other worker idle for most of that time. Marked ``slow`` are
    the end-to-end tests, seconds to tens of seconds each; the rest take milliseconds to a few
    seconds. Every worker sorts alike (xdist requires the same collection on each); a run without
    workers keeps the file order, so module-scoped fixtures are set up once.
    """
    if hasattr(config, "workerinput"):  # set on xdist workers only
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order within


KINDS = ("memory", "local", "drive", "gcs", "s3")


class BackendTarget(str):
    """A storage URL (the str itself) plus what is needed to open it: ``.options``, ``.env``."""

    kind: str
    options: dict[str, Any]
    env: dict[str, str]

    def __new__(
        cls, url: str, *, kind: str, options: dict[str, Any] | None = None, env: dict[str, str] | None = None
    ) -> BackendTarget:
        self = super().__new__(cls, url)
        self.kind = kind
        self.options = dict(options or {})
        self.env = dict(env or {})
        return self

    @property
    def url(self) -> str:
        return str.__str__(self)

    def open(self) -> Any:
        """``open_backend(self.url, **self.options)``."""
        return open_backend(self.url, **self.options)


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[Any]:
    """The GCS emulator on 127.0.0.1 (patched to answer like GCS), one per session."""
    # Both come with the dev extra: skipped without it, a failure under CKPTSDK_REQUIRE_ALL=1.
    pytest.importorskip("gcp_storage_emulator")
    pytest.importorskip("gcsfs")
    from ckptsdk.testing.gcs_emulator import start_emulator

    emulator = start_emulator()
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """The S3 server (moto, patched to be atomic: ckptsdk.testing.s3_server) on 127.0.0.1, one per session."""
    pytest.importorskip("moto")
    pytest.importorskip("botocore")
    from ckptsdk.testing.s3_server import start_s3_server

    server = start_s3_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_backend_target(
    request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., BackendTarget]]:
    """Factory: ``make_backend_target(kind, name="run") -> BackendTarget`` on fresh storage."""
    memory_names: list[str] = []

    def make(kind: str, name: str = "run") -> BackendTarget:
        if kind == "memory":
            store = f"test-{uuid.uuid4().hex[:12]}-{name}"
            memory_names.append(store)
            return BackendTarget(f"memory://{store}", kind=kind)
        if kind == "local":
            return BackendTarget(str(tmp_path / f"local-{name}"), kind=kind)
        if kind == "drive":
            root = tmp_path / "drive"
            root.mkdir(exist_ok=True)
            monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(root))
            return BackendTarget(f"drive://{name}", kind=kind, env={"CKPTSDK_DRIVE_ROOT": str(root)})
        if kind == "gcs":
            emulator = request.getfixturevalue("gcs_emulator")
            bucket = f"ckpt-{uuid.uuid4().hex[:16]}"
            emulator.make_bucket(bucket)
            return BackendTarget(
                emulator.url(bucket, name), kind=kind, options=emulator.storage_options, env=emulator.env
            )
        if kind == "s3":
            server = request.getfixturevalue("s3_server")
            bucket = f"ckpt-{uuid.uuid4().hex[:16]}"
            server.make_bucket(bucket)
            return BackendTarget(server.url(bucket, name), kind=kind, options=server.storage_options, env=server.env)
        raise ValueError(f"unknown backend kind {kind!r}; kinds are {KINDS}")

    yield make
    for store in memory_names:
        MemoryBackend.discard_store(store)


@pytest.fixture(
    params=[
        "memory",
        "local",
        "drive",
        pytest.param("gcs", marks=pytest.mark.gcs),
        pytest.param("s3", marks=pytest.mark.s3),
    ]
)
def backend_url(request: pytest.FixtureRequest, make_backend_target: Callable[..., BackendTarget]) -> BackendTarget:
    """Fresh storage of each kind: a str URL with ``.url``, ``.kind``, ``.options``, ``.env``."""
    return make_backend_target(request.param)


@pytest.fixture
def storage_options(backend_url: BackendTarget) -> dict[str, Any]:
    """The storage options that go with ``backend_url``."""
    return backend_url.options


@pytest.fixture
def backend(backend_url: BackendTarget) -> Any:
    """``open_backend(backend_url.url, **backend_url.options)``."""
    return backend_url.open()
