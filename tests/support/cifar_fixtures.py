"""Fixtures for CIFAR-10 data tests: a small synthetic set, its files in both layouts, and a
loopback HTTP server serving them. Import the fixtures into a test module to use them.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from adapters.cifar10.data import CifarData, load_cifar10
from adapters.cifar10.sources import HF_TEST_FILE, HF_TRAIN_FILE
from adapters.cifar10.synthetic import synthetic_cifar10, write_both
from ckptsdk.testing.http_server import FileServer

# 100 images per data_batch file keeps every test under a second or two.
N_TRAIN, N_TEST = 500, 100


@dataclass(frozen=True)
class CifarFiles:
    data: CifarData
    hf_train: pathlib.Path
    hf_test: pathlib.Path
    tarball: pathlib.Path


@dataclass(frozen=True)
class CifarServer:
    server: FileServer
    files: CifarFiles
    hf_base: str  # prefix holding plain_text/...
    tv_url: str  # full tarball URL
    hf_train_path: str  # server paths, for request counts
    hf_test_path: str
    tv_path: str

    def downloads(self) -> int:
        return self.server.requests()

    def load(
        self, local: pathlib.Path, *, cache: str | None, hf_base: str | None = None, tv_url: str | None = None
    ) -> CifarData:
        """``load_cifar10`` into ``local`` from this server's two sources (or the ones given), quietly."""
        return load_cifar10(
            cache=cache,
            local=str(local),
            hf_base=self.hf_base if hf_base is None else hf_base,
            tv_url=self.tv_url if tv_url is None else tv_url,
            progress=False,
        )


@pytest.fixture(scope="session")
def small_cifar() -> CifarData:
    return synthetic_cifar10(n_train=N_TRAIN, n_test=N_TEST, seed=1)


@pytest.fixture(scope="session")
def cifar_files(small_cifar: CifarData, tmp_path_factory: pytest.TempPathFactory) -> CifarFiles:
    root = tmp_path_factory.mktemp("cifar_files")
    p = write_both(small_cifar, str(root))
    return CifarFiles(small_cifar, pathlib.Path(p["hf_train"]), pathlib.Path(p["hf_test"]), pathlib.Path(p["tarball"]))


def serve_cifar(server: FileServer, files: CifarFiles, *, tarball: bytes | None = None) -> CifarServer:
    """Serve ``files`` (or a replacement tarball) on ``server`` under /hf/ and /tv/."""
    hf_train, hf_test, tv = "/hf/" + HF_TRAIN_FILE, "/hf/" + HF_TEST_FILE, "/tv/cifar-10-python.tar.gz"
    server.add(hf_train, files.hf_train.read_bytes())
    server.add(hf_test, files.hf_test.read_bytes())
    server.add(tv, tarball if tarball is not None else files.tarball.read_bytes())
    return CifarServer(server, files, server.url("/hf/"), server.url(tv), hf_train, hf_test, tv)


@pytest.fixture
def http_server() -> Iterator[FileServer]:
    with FileServer() as srv:
        yield srv


@pytest.fixture
def cifar_server(http_server: FileServer, cifar_files: CifarFiles) -> CifarServer:
    return serve_cifar(http_server, cifar_files)
