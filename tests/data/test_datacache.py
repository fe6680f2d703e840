"""The verified data cache: local -> cache -> sources, on real backends and a real HTTP server."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import xxhash

from ckptsdk.data.cache import DataCache
from ckptsdk.data.download import DownloadError, download
from ckptsdk.errors import AllSourcesFailedError, ConfigError, DataError
from ckptsdk.testing.http_server import Behaviour, FileServer

PAYLOAD = os.urandom(1_000_003)
HEX = hashlib.sha256(PAYLOAD).hexdigest()
DIGEST = "sha256:" + HEX  # a digest the caller pins says its algorithm
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
    assert (first.source, first.size, first.algorithm, first.digest) == (url, len(PAYLOAD), "sha256", HEX)
    assert _read(first.path) == PAYLOAD
    entry = cache.entry(NAME)
    assert entry is not None and (entry.algorithm, entry.digest, entry.source) == ("sha256", HEX, url)

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
    got = _cache("memory://" + tmp_path.name).fetch(NAME, local_dir=str(tmp_path), sources=[bad, good], digest=DIGEST)
    assert got.source == good
    assert _read(got.path) == PAYLOAD
    wrong = list(got.failures)
    assert bad in wrong and "wrong bytes" in got.failures[bad] and HEX in got.failures[bad]
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
        cache.fetch(NAME, local_dir=str(tmp_path / "l"), sources=[missing, corrupt, truncated, broken], digest=DIGEST)
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
    recorded = xxhash.xxh3_128_hexdigest(PAYLOAD)
    assert first.source == url and (first.algorithm, first.digest) == ("xxh3-128", recorded)  # digest.DEFAULT

    # The mirror now serves other bytes, and the cached copy rots: the record still rules.
    http_server.add("/mirror/p.bin", PAYLOAD[::-1])
    _cache(cache_url).backend.write(f"datacache/blobs/{NAME}", b"rot")
    with pytest.raises(AllSourcesFailedError) as info:
        _cache(cache_url).fetch(NAME, local_dir=str(tmp_path / "rt2"), sources=[url])
    assert "corrupt" in info.value.failures["cache"]
    assert "wrong bytes" in info.value.failures[url] and recorded in info.value.failures[url]


def test_record_once_keeps_the_first_record(tmp_path):
    cache = _cache("memory://" + tmp_path.name)
    assert cache.record_once("x/y", {"v": 1}) == {"v": 1}
    assert _cache("memory://" + tmp_path.name).record_once("x/y", {"v": 2}) == {"v": 1}
    assert cache.get_record("x/y") == {"v": 1}
    assert cache.get_record("x/none") is None


def test_records_follow_the_version_rule_and_bare_old_ones_are_still_read(tmp_path):
    cache = _cache("memory://" + tmp_path.name)
    cache.record_once("new", {"format": "the caller's own field", "v": 1})
    stored = json.loads(cache.backend.read(cache._record_key("new")))
    assert stored["format"] == "ckptsdk.datarecord/1.0"
    assert cache.get_record("new") == {"format": "the caller's own field", "v": 1}
    # What ckptsdk stored before records had a format: the caller's dict, bare.
    cache.backend.write(cache._record_key("old"), b'{"format": 7, "sha256": "ab12", "v": 2}')
    assert cache.get_record("old") == {"format": 7, "sha256": "ab12", "v": 2}
    cache.backend.write(cache._record_key("newer"), b'{"format": "ckptsdk.datarecord/2.0", "record": {}}')
    with pytest.raises(DataError, match="upgrade ckptsdk") as info:
        cache.get_record("newer")
    assert "delete" in str(info.value)
    assert cache.backend.read(cache._record_key("newer"))  # nothing was lost


def test_dropped_server_mid_body_without_retries_leaves_a_part_file_that_resumes(tmp_path):
    with FileServer() as srv:
        url = srv.add("/p.bin", PAYLOAD, Behaviour(drop_times=1, drop_after=400_000))
        with pytest.raises(DownloadError):
            download(url, str(tmp_path / "p.bin"), retries=0, progress=False)
        assert (tmp_path / "p.bin.part").stat().st_size == 400_000
        result = download(url, str(tmp_path / "p.bin"), retries=0, progress=False)
        assert result.resumed_bytes == 400_000 and (tmp_path / "p.bin").read_bytes() == PAYLOAD


# ---------------------------------------------------------------- one digest rule, one document


def test_a_pinned_digest_must_say_its_algorithm(http_server, tmp_path):
    url = http_server.add("/p.bin", PAYLOAD)
    cache = _cache("memory://" + tmp_path.name)
    with pytest.raises(ConfigError, match="does not say its algorithm.*'sha256:"):
        cache.fetch(NAME, local_dir=str(tmp_path), sources=[url], digest=HEX)
    with pytest.raises(ConfigError, match="drop one of them"):
        cache.fetch(NAME, local_dir=str(tmp_path), sources=[url], digest=DIGEST, algorithm="md5")
    with pytest.raises(ConfigError, match="unknown digest algorithm 'sha1'"):
        cache.fetch(NAME, local_dir=str(tmp_path), sources=[url], digest="sha1:" + HEX[:40])
    assert http_server.requests("/p.bin") == 0  # refused before any download
    # The other spelling of the same pin: the bare hex with algorithm= (what adapters pass).
    got = cache.fetch(NAME, local_dir=str(tmp_path), sources=[url], digest=HEX, algorithm="sha256")
    assert (got.algorithm, got.digest) == ("sha256", HEX)
    md5 = hashlib.md5(PAYLOAD).hexdigest()
    again = cache.fetch("other.bin", local_dir=str(tmp_path), sources=[url], digest="md5:" + md5)
    assert (again.algorithm, again.digest) == ("md5", md5)


def test_publish_and_adopt_compute_the_default_digest(tmp_path):
    path = tmp_path / "d" / "x.bin"
    path.parent.mkdir()
    path.write_bytes(PAYLOAD)
    cache = _cache("memory://" + tmp_path.name)
    assert cache.publish("p.bin", str(path)).algorithm == "xxh3-128"
    assert cache.adopt("x.bin", local_dir=str(path.parent), publish=False).algorithm == "xxh3-128"
    assert cache.publish("q.bin", str(path), digest=DIGEST).algorithm == "sha256"
    with pytest.raises(ConfigError, match="does not say its algorithm"):
        cache.publish("r.bin", str(path), digest=HEX)


# Written by ckptsdk before format ckptsdk.datacache/1.0: meta said "format": 1 (an int), the
# local sidecar said nothing.
_OLD_META = (
    '{{"algorithm": "sha256", "digest": "{hex}", "format": 1, "name": "sets/payload.bin", '
    '"size": 1000003, "source": "https://mirror.example/p.bin", "stored_at": 1764483000.25}}'
)
_OLD_SIDECAR = (
    '{{"name": "sets/payload.bin", "algorithm": "sha256", "digest": "{hex}", "size": 1000003, '
    '"source": "https://mirror.example/p.bin"}}'
)


def test_meta_and_sidecars_of_the_previous_version_are_still_read(tmp_path):
    cache = _cache("memory://" + tmp_path.name)
    cache.backend.write(f"datacache/blobs/{NAME}", PAYLOAD)
    cache.backend.write(f"datacache/meta/{NAME}.json", _OLD_META.format(hex=HEX).encode())
    entry = cache.entry(NAME)
    assert entry is not None and (entry.algorithm, entry.digest, entry.size) == ("sha256", HEX, len(PAYLOAD))
    assert entry.stored_at == 1764483000.25
    got = cache.fetch(NAME, local_dir=str(tmp_path / "rt"), sources=[])  # no source: the record rules
    assert (got.source, got.digest) == ("cache", HEX)
    # A local copy recorded by the previous version verifies without the cache.
    local = tmp_path / "old"
    (local / "sets").mkdir(parents=True)
    (local / "sets" / "payload.bin").write_bytes(PAYLOAD)
    (local / ".ckptsdk" / "sets").mkdir(parents=True)
    (local / ".ckptsdk" / "sets" / "payload.bin.json").write_text(_OLD_SIDECAR.format(hex=HEX))
    assert _cache(None).fetch(NAME, local_dir=str(local)).source == "local"
    # What this version writes: the document's string format.
    cache.publish(NAME, str(local / "sets" / "payload.bin"), digest=DIGEST)
    written = json.loads(cache.backend.read(f"datacache/meta/{NAME}.json"))
    assert written["format"] == "ckptsdk.datacache/1.0" and written["digest"] == HEX


def test_meta_of_a_newer_major_version_is_not_trusted(tmp_path, caplog):
    cache = _cache("memory://" + tmp_path.name)
    newer = json.loads(_OLD_META.format(hex=HEX))
    newer["format"] = "ckptsdk.datacache/2.0"
    cache.backend.write(f"datacache/meta/{NAME}.json", json.dumps(newer).encode())
    assert cache.entry(NAME) is None
    assert "upgrade ckptsdk" in caplog.text
