"""open_backend(url): which backend each URL gets, and the errors for URLs that cannot work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptsdk.backends import open_backend
from ckptsdk.backends.drive import DriveBackend
from ckptsdk.backends.local import LocalBackend
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.errors import ConfigError, InvalidKey, StorageUnavailable, UnknownSchemeError

REPO = Path(__file__).resolve().parents[2]


def test_plain_path_is_local(tmp_path, monkeypatch):
    b = open_backend(str(tmp_path / "ckpt"))
    assert type(b) is LocalBackend and b.root == str(tmp_path / "ckpt")
    b.write("a", b"1")
    assert (tmp_path / "ckpt" / "a").read_bytes() == b"1"
    monkeypatch.chdir(tmp_path)
    rel = open_backend("relative/run")
    assert type(rel) is LocalBackend and rel.root == str(tmp_path / "relative" / "run")
    assert open_backend(tmp_path / "ckpt").read("a") == b"1"  # a PathLike works too


def test_file_url_is_local(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    b = open_backend(url)
    assert type(b) is LocalBackend and b.url == url and b.root == str(tmp_path / "ckpt")
    b.write("x/y", b"2")
    assert open_backend(str(tmp_path / "ckpt")).read("x/y") == b"2"


def test_drive_url_honours_ckptsdk_drive_root(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path / "mydrive"))
    (tmp_path / "mydrive").mkdir()
    b = open_backend("drive://runs/cifar")
    assert type(b) is DriveBackend and b.url == "drive://runs/cifar"
    assert b.root == str(tmp_path / "mydrive" / "runs" / "cifar")
    b.write("step/manifest.json", b"{}")
    assert (tmp_path / "mydrive" / "runs" / "cifar" / "step" / "manifest.json").read_bytes() == b"{}"
    assert open_backend("drive://").root == str(tmp_path / "mydrive")
    # The variable is read when a URL is opened; an open backend keeps its root.
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    assert b.read("step/manifest.json") == b"{}"
    assert open_backend("drive://mydrive/runs/cifar").read("step/manifest.json") == b"{}"


def test_drive_url_cannot_escape_the_mount(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    with pytest.raises(InvalidKey):
        open_backend("drive://../outside")


@pytest.mark.skipif(os.path.exists("/content/drive"), reason="a real Drive mount is here")
@pytest.mark.parametrize("url", ["/content/drive/MyDrive/run", "file:///content/drive/MyDrive/run"])
def test_path_under_content_drive_is_drive(url, monkeypatch):
    monkeypatch.delenv("CKPTSDK_DRIVE_ROOT", raising=False)
    # Detected as Drive: the Drive backend's own check says the mount is missing.
    with pytest.raises(StorageUnavailable, match="Google Drive is not mounted") as exc_info:
        open_backend(url)
    assert "drive.mount('/content/drive')" in str(exc_info.value)
    assert not os.path.exists("/content/drive")


def test_memory_url_shares_one_store_per_name():
    a = open_backend("memory://open-backend-test")
    b = open_backend("memory://open-backend-test/")
    other = open_backend("memory://open-backend-other")
    try:
        assert type(a) is MemoryBackend and a.url == "memory://open-backend-test"
        a.write("k", b"v")
        assert b.read("k") == b"v" and not other.exists("k")
    finally:
        MemoryBackend.discard_store("open-backend-test")
        MemoryBackend.discard_store("open-backend-other")


@pytest.mark.gcs
def test_gs_url_is_gcs(gcs_emulator):
    from ckptsdk.backends.cloud.gcs import GCSBackend

    gcs_emulator.make_bucket("open-backend-test")
    b = open_backend("gs://open-backend-test/runs/a", **gcs_emulator.storage_options)
    assert type(b) is GCSBackend and b.url == "gs://open-backend-test/runs/a"
    b.write("k", b"v")
    assert open_backend("gs://open-backend-test/runs", **gcs_emulator.storage_options).read("a/k") == b"v"


@pytest.mark.parametrize("url", ["s4://bucket/key", "http://127.0.0.1/x", "hdfs://x", "GS2://b"])
def test_unknown_scheme(url):
    with pytest.raises(UnknownSchemeError) as exc_info:
        open_backend(url)
    assert isinstance(exc_info.value, ConfigError) and isinstance(exc_info.value, ValueError)
    assert exc_info.value.url == url
    assert "unknown scheme" in str(exc_info.value) and "gs://" in str(exc_info.value)


def test_not_a_url():
    with pytest.raises(UnknownSchemeError):
        open_backend(42)  # type: ignore[arg-type]


def test_root_that_is_a_file_is_storage_unavailable(tmp_path, monkeypatch):
    path = tmp_path / "taken"
    path.write_bytes(b"precious")
    for url in (str(path), f"file://{path}"):
        with pytest.raises(StorageUnavailable, match="is a file, not a folder") as exc_info:
            open_backend(url)
        assert exc_info.value.url == url
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    with pytest.raises(StorageUnavailable):
        open_backend("drive://taken")
    assert path.read_bytes() == b"precious"


# A child interpreter where gcsfs is "not installed": a meta-path finder, loaded through
# sitecustomize on the child's PYTHONPATH, refuses it the way a missing package is refused.
_BLOCKER = """
import sys

class _NoGcsfs:
    def find_spec(self, name, path=None, target=None):
        if name == "gcsfs" or name.startswith("gcsfs."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoGcsfs())
sys.modules.pop("gcsfs", None)
"""

_CHILD = """
import json, sys, tempfile
from ckptsdk.backends import open_backend
from ckptsdk.errors import MissingDependencyError
try:
    import gcsfs
    print(json.dumps({"blocked": False}))
    sys.exit(0)
except ImportError:
    pass
try:
    open_backend("gs://bucket/prefix", endpoint_url="http://127.0.0.1:9", token="anon")
except MissingDependencyError as exc:
    ok = open_backend(tempfile.mkdtemp()).write("k", b"v").size == 1
    print(json.dumps({"blocked": True, "type": type(exc).__name__, "extra": exc.extra,
                      "message": str(exc), "import_error": isinstance(exc, ImportError),
                      "local_still_works": ok}))
"""


def test_missing_gcsfs_names_the_extra(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(_BLOCKER))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["blocked"], "the blocker did not hide gcsfs"
    assert result["type"] == "MissingDependencyError" and result["import_error"]
    assert result["extra"] == "gcs"
    assert "gcsfs" in result["message"] and "pip install 'ckptsdk[gcs]'" in result["message"]
    assert result["local_still_works"]


def test_preconditions_advisory_is_the_users_word_and_anything_else_is_refused(monkeypatch):
    """``preconditions="advisory"`` (or $CKPTSDK_PRECONDITIONS) makes a store claim no condition:
    the lease then works as on Drive; a misspelt value is a ConfigError, not silently ignored."""
    plain = open_backend("memory://preconditions-a")
    declared = open_backend("memory://preconditions-a", preconditions="advisory")
    assert plain.capabilities.compare_and_swap and not declared.capabilities.compare_and_swap
    assert not declared.capabilities.exclusive_create and not declared.capabilities.immediately_consistent
    assert type(plain).capabilities.compare_and_swap  # the class's record is untouched
    monkeypatch.setenv("CKPTSDK_PRECONDITIONS", "advisory")
    assert not open_backend("memory://preconditions-a").capabilities.compare_and_swap
    with pytest.raises(ConfigError, match="preconditions='trust-me'"):
        open_backend("memory://preconditions-a", preconditions="trust-me")


@pytest.mark.s3
def test_s3_url_opens_the_s3_backend(s3_server):
    from ckptsdk.backends.cloud.s3 import S3Backend

    s3_server.make_bucket("open-backend-s3")
    b = open_backend("s3://open-backend-s3/runs/a", **s3_server.storage_options)
    assert type(b) is S3Backend and b.url == "s3://open-backend-s3/runs/a" and b.prefix == "runs/a"
    b.write("k", b"v")
    assert open_backend("s3://open-backend-s3/runs", **s3_server.storage_options).read("a/k") == b"v"
    with pytest.raises(ConfigError, match="names no bucket"):
        open_backend("s3://", **s3_server.storage_options)


# A stand-in gcsfs that records the switch it saw when imported (gcsfs reads it only then).
_FAKE_GCSFS = {
    "gcsfs/__init__.py": "import os\nSEEN = os.environ.get('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT')\n",
    "gcsfs/core.py": "class GCSFileSystem:\n    def __init__(self, **options):\n        self.credentials = None\n",
}

_ENV_CHILD = """
import json, os, sys
before = dict(os.environ)
import ckptsdk.backends.cloud.gcs_transport as transport
imported = dict(os.environ)
assert "gcsfs" not in sys.modules  # imported when a GCS backend is opened, not before
core = transport._gcsfs_core()
import gcsfs
print(json.dumps({"import_untouched": imported == before, "seen": gcsfs.SEEN,
                  "open_untouched": dict(os.environ) == before, "core": core.__name__}))
"""


@pytest.mark.parametrize("users", [None, "true"])
def test_the_gcs_transport_leaves_the_environment_as_the_user_set_it(tmp_path, users):
    for name, text in _FAKE_GCSFS.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    if users is not None:
        env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = users
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    proc = subprocess.run(
        [sys.executable, "-c", _ENV_CHILD], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["import_untouched"] and result["open_untouched"], result
    assert result["core"] == "gcsfs.core"
    # gcsfs imported with its experimental class off, unless the user said otherwise.
    assert result["seen"] == (users or "false")
