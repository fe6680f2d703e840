"""The first hour of a new user (issue 13): each usual mistake fails early, with a clear error.

Every test here failed before its fix; the message each one checks is the one a user now reads.
"""

from __future__ import annotations

import socket

import pytest

import ckptsdk
from ckptsdk.backends import open_backend


# ---------------------------------------------------------------- storage URLs and roots


@pytest.mark.parametrize("url", ["", "   ", "file://"])
def test_an_empty_url_is_refused_instead_of_meaning_the_current_directory(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckptsdk.ConfigError, match="empty storage URL"):
        ckptsdk.CheckpointManager(url)
    assert list(tmp_path.iterdir()) == []  # no LEASE.json in the working directory


def test_a_root_that_cannot_be_created_says_so():
    with pytest.raises(ckptsdk.StorageUnavailable) as info:
        ckptsdk.CheckpointManager("/proc/ckptsdk-no-such-root")
    msg = str(info.value)
    assert "storage root /proc/ckptsdk-no-such-root does not exist and cannot be created" in msg
    assert "LEASE.json" not in msg


def test_a_root_that_cannot_be_created_is_not_created_by_reads(tmp_path):
    root = tmp_path / "not-yet"
    b = open_backend(str(root))
    assert not b.exists("LEASE.json") and not root.exists()


def test_gcs_that_cannot_be_reached_names_what_to_check():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = open_backend("gs://bucket/run", token="anon", endpoint_url=f"http://127.0.0.1:{port}")
    b.max_attempts, b.backoff_s = 1, 0.0
    with pytest.raises(ckptsdk.StorageUnavailable) as info:
        b.exists("LEASE.json")
    msg = str(info.value)
    assert f"cannot reach GCS at http://127.0.0.1:{port} for gs://bucket/run" in msg
    for hint in ("network", "gcloud auth application-default login", "GOOGLE_APPLICATION_CREDENTIALS",
                 "STORAGE_EMULATOR_HOST"):
        assert hint in msg
