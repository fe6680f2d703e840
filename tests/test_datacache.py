"""The verified data cache: local -> cache -> sources, on real backends and a real HTTP server."""

from __future__ import annotations

import hashlib
import os

import pytest

from ckptsdk.datacache import DataCache
from ckptsdk.download import DownloadError, download
from ckptsdk.errors import AllSourcesFailedError
from tests.http_server import Behaviour, FileServer

PAYLOAD = os.urandom(1_000_003)
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()
NAME = "sets/payload.bin"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _cache(url, **kw) -> DataCache:
    kw.setdefault("backoff", 0.01)
    kw.setdefault("retries", 2)
    kw.setdefault("progress", False)
    return DataCache(url.url, **url.options, **kw) if hasattr(url, "options") else DataCache(url, **kw)


def test_chain_source_then_local_then_cache_on_a_fresh_runtime(backend_url, http_server, tmp_path):
    url = http_server.add("/a/payload.bin", PAYLOAD)
    cache = _cache(backend_url)

    first = cache.fetch(NAME, local_dir=str(tmp_path / "rt1"), sources=[url], digest=DIGEST)
    assert (first.source, first.size, first.digest) == (url, len(PAYLOAD), DIGEST)
    assert _read(first.path) == PAYLOAD
    entry = cache.entry(NAME)
    assert entry is not None and entry.digest == DIGEST and entry.source == url

    again = cache.fetch(NAME, local_dir=str(tmp_path / "rt1"), sources=[url], digest=DIGEST)
    assert again.source == "local"

    # A fresh runtime: new local folder, new DataCache object, same cache URL.
    fresh = _cache(backend_url).fetch(NAME, local_dir=str(tmp_path / "rt2"), sources=[url], digest=DIGEST)
    assert fresh.source == "cache"
    assert _read(fresh.path) == PAYLOAD
    assert http_server.requests("/a/payload.bin") == 1  # one download, ever
    assert not [p for p in os.listdir(os.path.dirname(fresh.path)) if ".ckptsdk-tmp." in p]


def test_wrong_bytes_are_rejected_and_the_next_source_is_used(http_server, tmp_path):
    bad = http_server.add("/bad/payload.bin", PAYLOAD, Behaviour(corrupt=True))
    good = http_server.add("/good/payload.bin", PAYLOAD)
    got = _cache("memory://" + tmp_path.name).fetch(NAME, local_dir=str(tmp_path), sources=[bad, good],
                                                    digest=DIGEST)
    assert got.source == good
    assert _read(got.path) == PAYLOAD
    wrong = list(got.failures)
    assert bad in wrong and "wrong bytes" in got.failures[bad] and DIGEST in got.failures[bad]
    # The rejection names the digest it did get.
    corrupt = bytearray(PAYLOAD)
    corrupt[len(PAYLOAD) // 2] ^= 0xFF
    assert hashlib.sha256(corrupt).hexdigest() in got.failures[bad]


def test_all_sources_failing_lists_each_one_and_why(http_server, tmp_path):
    missing = http_server.url("/missing.bin")
    corrupt = http_server.add("/corrupt.bin", PAYLOAD, Behaviour(corrupt=True))
    truncated = http_server.add("/short.bin", PAYLOAD, Behaviour(truncate_to=1000))
    broken = http_server.add("/broken.bin", PAYLOAD, Behaviour(fail_times=100))
    cache = _cache("memory://" + tmp_path.name, retries=1)
    with pytest.raises(AllSourcesFailedError) as info:
        cache.fetch(NAME, local_dir=str(tmp_path / "l"), sources=[missing, corrupt, truncated, broken],
                    digest=DIGEST)
    err = info.value
    assert err.name == NAME
    assert set(err.failures) == {"cache", missing, corrupt, truncated, broken}
    assert "HTTP 404" in err.failures[missing]
    assert "wrong bytes" in err.failures[corrupt]
    assert "wrong bytes" in err.failures[truncated] and "1000 bytes" in err.failures[truncated]
    assert "HTTP 500" in err.failures[broken] and "2 attempt" in err.failures[broken]
    for src in (missing, corrupt, truncated, broken):
        assert src in str(err)
    assert http_server.requests("/missing.bin") == 1  # a 404 is not retried
    assert http_server.requests("/broken.bin") == 2
    assert not os.path.exists(tmp_path / "l" / "sets" / "payload.bin")
    assert cache.entry(NAME) is None
    assert [p for p in os.listdir(tmp_path / "l" / "sets")] == []  # no temp or partial files left


def test_resume_with_range_after_a_dropped_connection(http_server, tmp_path):
    url = http_server.add("/p.bin", PAYLOAD, Behaviour(drop_times=1, drop_after=300_000))
    got = _cache(None, progress=True).fetch(NAME, local_dir=str(tmp_path), sources=[url], digest=DIGEST)
    assert _read(got.path) == PAYLOAD
    assert http_server.requests("/p.bin") == 2
    assert http_server.range_requests == [("/p.bin", 300_000)]


def test_server_without_ranges_restarts_from_zero(http_server, tmp_path):
    url = http_server.add("/p.bin", PAYLOAD, Behaviour(drop_times=1, drop_after=300_000, ranges=False))
    result = download(url, str(tmp_path / "p.bin"), retries=2, backoff=0.01, progress=False)
    assert (tmp_path / "p.bin").read_bytes() == PAYLOAD
    assert (result.attempts, result.resumed_bytes) == (2, 0)
    assert http_server.range_requests == []


def test_transient_500s_are_retried_with_backoff(http_server, tmp_path):
    url = http_server.add("/p.bin", PAYLOAD, Behaviour(fail_times=2))
    waits: list[float] = []
    result = download(url, str(tmp_path / "p.bin"), retries=3, backoff=0.5, progress=False, sleep=waits.append)
    assert result.attempts == 3 and waits == [0.5, 1.0]
    assert (tmp_path / "p.bin").read_bytes() == PAYLOAD


def test_a_stalled_server_times_out_instead_of_hanging(http_server, tmp_path):
    url = http_server.add("/p.bin", PAYLOAD, Behaviour(stall_seconds=3, stall_times=5))
    with pytest.raises(DownloadError) as info:
        download(url, str(tmp_path / "p.bin"), timeout=0.3, retries=1, backoff=0.01, progress=False)
    assert info.value.attempts == 2 and "timed out" in str(info.value)
    assert not (tmp_path / "p.bin").exists()


def test_throttled_source_still_completes(http_server, tmp_path):
    url = http_server.add("/slow.bin", PAYLOAD[:200_000], Behaviour(throttle_bps=1_000_000))
    result = download(url, str(tmp_path / "s.bin"), progress=False)
    assert result.size == 200_000 and result.seconds >= 0.15


def test_corrupt_cache_entry_is_detected_refetched_and_repaired(backend_url, http_server, tmp_path):
    url = http_server.add("/a/payload.bin", PAYLOAD)
    cache = _cache(backend_url)
    cache.fetch(NAME, local_dir=str(tmp_path / "rt1"), sources=[url], digest=DIGEST)
    backend = backend_url.open()
    blob_key = f"datacache/blobs/{NAME}"
    backend.write(blob_key, b"\x00" * len(PAYLOAD))  # bit rot, a bad sync, a meddling user

    got = _cache(backend_url).fetch(NAME, local_dir=str(tmp_path / "rt2"), sources=[url], digest=DIGEST)
    assert got.source == url and "corrupt" in got.failures["cache"]
    assert _read(got.path) == PAYLOAD
    assert backend.read(blob_key) == PAYLOAD  # repaired

    third = _cache(backend_url).fetch(NAME, local_dir=str(tmp_path / "rt3"), sources=[url], digest=DIGEST)
    assert third.source == "cache"
    assert http_server.requests("/a/payload.bin") == 2


def test_corrupt_local_copy_is_replaced_from_the_cache(http_server, tmp_path):
    url = http_server.add("/a/payload.bin", PAYLOAD)
    cache = _cache("memory://" + tmp_path.name)
    first = cache.fetch(NAME, local_dir=str(tmp_path), sources=[url], digest=DIGEST)
    with open(first.path, "r+b") as f:
        f.write(b"garbage")
    got = cache.fetch(NAME, local_dir=str(tmp_path), sources=[url], digest=DIGEST)
    assert got.source == "cache" and "local" in got.failures
    assert _read(got.path) == PAYLOAD
    assert http_server.requests("/a/payload.bin") == 1


def test_without_a_pinned_digest_the_first_source_is_trusted_and_recorded(http_server, tmp_path):
    url = http_server.add("/mirror/p.bin", PAYLOAD)
    cache_url = "memory://" + tmp_path.name
    first = _cache(cache_url).fetch(NAME, local_dir=str(tmp_path / "rt1"), sources=[url])
    assert first.source == url and first.digest == DIGEST  # sha256 by default

    # The mirror now serves other bytes, and the cached copy rots: the record still rules.
    http_server.add("/mirror/p.bin", PAYLOAD[::-1])
    _cache(cache_url).backend.write(f"datacache/blobs/{NAME}", b"rot")
    with pytest.raises(AllSourcesFailedError) as info:
        _cache(cache_url).fetch(NAME, local_dir=str(tmp_path / "rt2"), sources=[url])
    assert "corrupt" in info.value.failures["cache"]
    assert "wrong bytes" in info.value.failures[url] and DIGEST in info.value.failures[url]


def test_record_once_keeps_the_first_record(tmp_path):
    cache = _cache("memory://" + tmp_path.name)
    assert cache.record_once("x/y", {"v": 1}) == {"v": 1}
    assert _cache("memory://" + tmp_path.name).record_once("x/y", {"v": 2}) == {"v": 1}
    assert cache.get_record("x/y") == {"v": 1}
    assert cache.get_record("x/none") is None


def test_dropped_server_mid_body_without_retries_leaves_a_part_file_that_resumes(tmp_path):
    with FileServer() as srv:
        url = srv.add("/p.bin", PAYLOAD, Behaviour(drop_times=1, drop_after=400_000))
        with pytest.raises(DownloadError):
            download(url, str(tmp_path / "p.bin"), retries=0, progress=False)
        assert (tmp_path / "p.bin.part").stat().st_size == 400_000
        result = download(url, str(tmp_path / "p.bin"), retries=0, progress=False)
        assert result.resumed_bytes == 400_000 and (tmp_path / "p.bin").read_bytes() == PAYLOAD
