"""A verified artifact cache on any backend: download once, copy back with a checksum after.

``DataCache.fetch`` finds an artifact by name and digest in a local folder, then in the cache
(Drive, GCS, disk, memory: anything ``open_backend`` opens), then at each source URL, verifying
every copy before it is used, and publishes what it downloaded. Small JSON records (a dataset's
recorded tensor hash) live here too. Parsing what the bytes mean belongs to adapters.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import xxhash

from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend, check_key
from ckptsdk.data.download import DownloadError, download, progress_bar
from ckptsdk.data.entry import CacheEntry, DataRecord, Fetched, file_digest, parse_entry, parse_record, pinned_digest
from ckptsdk.data.sidecar import TMP_MARK, read_sidecar, write_sidecar
from ckptsdk.errors import (
    AllSourcesFailedError,
    BackendError,
    ConfigError,
    DataError,
    DigestMismatchError,
    ObjectNotFound,
    PreconditionFailed,
)
from ckptsdk.format.digest import DEFAULT, new_hasher

logger = logging.getLogger(__name__)

# CacheEntry, Fetched, file_digest and pinned_digest are ckptsdk.data.entry's: import them from there.
__all__ = ["DataCache"]

_CHUNK = 8 << 20


def _file_chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _speed(size: int, seconds: float) -> float:
    return size / (1 << 20) / max(seconds, 1e-9)


class DataCache:
    """A verified artifact cache under ``url`` (any backend), plus local copies.

    Layout under the backend root: ``{prefix}/blobs/{name}`` (the bytes), ``{prefix}/meta/{name}.json``
    (size, digest, source; written only after the blob was read back and verified, so it is the
    commit marker) and ``{prefix}/records/{name}.json`` (small JSON records, first writer wins).
    Local copies live at ``{local_dir}/{name}`` with a sidecar ``{local_dir}/.ckptsdk/{name}.json``.

    Args:
        url: the cache location (``gs://b/p``, ``drive://data``, a path, ``memory://x``), or None
            for no shared cache (local copies and sources only).
        prefix: folder inside the backend root for everything this cache writes.
        timeout: per-request socket timeout for downloads, seconds.
        retries: retries per source after the first attempt.
        backoff: first retry delay in seconds (doubles each retry).
        progress: show tqdm bars for downloads and cache copies.
        **storage_options: passed to ``open_backend`` (fsspec/gcsfs options for ``gs://``).

    Example:
        >>> import os, tempfile
        >>> made, fresh = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> with open(os.path.join(made, "x.bin"), "wb") as f:
        ...     _ = f.write(b"some bytes")
        >>> cache = DataCache("memory://datacache-doc", progress=False)
        >>> cache.adopt("x.bin", local_dir=made).algorithm  # recorded, and published
        'xxh3-128'
        >>> got = cache.fetch("x.bin", local_dir=fresh)  # another runtime: from the cache, verified
        >>> got.source, got.size
        ('cache', 10)
        >>> got = cache.fetch("y.bin", local_dir=fresh, sources=["https://example.org/y.bin"],
        ...                   digest="sha256:ab12...")  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str | None,
        *,
        prefix: str = "datacache",
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.5,
        progress: bool = True,
        **storage_options: Any,
    ) -> None:
        self.url = url
        self.backend: Backend | None = open_backend(url, **storage_options) if url else None
        self.prefix = check_key(prefix.strip("/"), url=url or "")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.progress = progress

    # ------------------------------------------------------------------ keys
    def _blob_key(self, name: str) -> str:
        return f"{self.prefix}/blobs/{name}"

    def _meta_key(self, name: str) -> str:
        return f"{self.prefix}/meta/{name}.json"

    def _record_key(self, name: str) -> str:
        return f"{self.prefix}/records/{name}.json"

    # ------------------------------------------------------------ metadata
    def entry(self, name: str) -> CacheEntry | None:
        """The cache's committed entry for ``name``, or None (no cache, absent, or unreadable meta)."""
        check_key(name, url=self.url or "")
        if self.backend is None:
            return None
        try:
            raw = self.backend.read(self._meta_key(name))
        except ObjectNotFound:
            return None
        try:
            return parse_entry(raw, self._meta_key(name))
        except DataError as exc:
            logger.warning(
                "cache meta for %r under %s is unreadable (%s); treating the entry as absent", name, self.url, exc
            )
            return None

    def get_record(self, name: str) -> dict[str, Any] | None:
        """The JSON record ``name`` stored in the cache, or None (absent, or no cache).

        Raises:
            DataError: the stored record is unreadable; the message says which object to delete.
        """
        check_key(name, url=self.url or "")
        if self.backend is None:
            return None
        try:
            data = self.backend.read(self._record_key(name))
        except ObjectNotFound:
            return None
        return parse_record(data, f"{self.url}/{self._record_key(name)}")

    def record_once(self, name: str, record: dict[str, Any]) -> dict[str, Any]:
        """Store ``record`` under ``name`` unless one exists; return the record that stands.

        Create-if-absent, so when two fresh runtimes race, the first one's record wins and the
        second one gets it back to compare against (trust on first use, once).
        """
        check_key(name, url=self.url or "")
        if self.backend is None:
            return record
        try:
            self.backend.create(self._record_key(name), DataRecord(record=record).to_json())
            logger.info("recorded %r in the data cache %s", name, self.url)
            return record
        except PreconditionFailed:
            existing = self.get_record(name)
            return existing if existing is not None else record

    # ------------------------------------------------------------- publish
    def publish(
        self, name: str, path: str, *, algorithm: str | None = None, digest: str | None = None, source: str = "local"
    ) -> CacheEntry:
        """Copy the local file ``path`` into the cache as ``name``, read it back, verify, commit.

        The blob is written first (every backend publishes atomically), then read back and
        hashed; only if it matches is the meta object written, which is what readers trust.

        Args:
            name: artifact name (a relative key).
            path: local file.
            algorithm: the digest's algorithm; None: ``digest``'s own (``"sha256:<hex>"``), else
                ``digest.DEFAULT``.
            digest: the file's digest if already known (skips hashing it twice); it says its
                algorithm (see :func:`pinned_digest`).
            source: where the bytes came from, recorded in the meta.

        Returns:
            The committed :class:`CacheEntry`.

        Raises:
            DigestMismatchError: what the cache returned differs from what was written.
            BackendError: the cache could not be written.
            ConfigError: a ``digest`` that does not say its algorithm.
        """
        check_key(name, url=self.url or "")
        if self.backend is None:
            raise ConfigError("this DataCache has no cache URL; nothing to publish into")
        start = time.monotonic()
        if digest is not None:
            algorithm, digest = pinned_digest(digest, algorithm)
        else:
            algorithm = algorithm or DEFAULT
            digest = file_digest(path, algorithm)
        size = os.path.getsize(path)
        self.backend.write(self._blob_key(name), _file_chunks(path))
        back = self._hash_blob(name, algorithm)
        if back != digest:
            raise DigestMismatchError(
                f"the cache {self.url} returned different bytes for {name!r} right after writing them "
                f"({algorithm} {back} != {digest}); the storage is unreliable",
                source=self.url or "",
                expected=digest,
                actual=back,
            )
        entry = CacheEntry(
            name=name, size=size, algorithm=algorithm, digest=digest, source=source, stored_at=time.time()
        )
        self.backend.write(self._meta_key(name), entry.to_json())
        seconds = time.monotonic() - start
        logger.info(
            "published %r into the cache %s: %d bytes in %.2f s (%.1f MiB/s, verified)",
            name,
            self.url,
            size,
            seconds,
            _speed(size, seconds),
        )
        return entry

    def adopt(
        self, name: str, *, local_dir: str, algorithm: str = DEFAULT, source: str = "derived", publish: bool = True
    ) -> Fetched:
        """Register a file this runtime produced at ``{local_dir}/{name}`` (e.g. decoded tensors).

        Records its digest (``algorithm``, by default ``digest.DEFAULT``) next to it, so the next
        ``fetch`` can verify the local copy, and with ``publish`` copies it into the cache (best
        effort: a failing cache is logged, not raised).
        """
        check_key(name, url=self.url or "")
        start = time.monotonic()
        path = os.path.join(local_dir, *name.split("/"))
        digest = file_digest(path, algorithm)
        size = os.path.getsize(path)
        write_sidecar(local_dir, name, algorithm=algorithm, digest=digest, size=size, source=source)
        if publish and self.backend is not None:
            self._try_publish(name, path, algorithm, digest, source)
        return self._done(name, path, source, size, algorithm, digest, start, {})

    def _hash_blob(self, name: str, algorithm: str) -> str:
        assert self.backend is not None
        h = new_hasher(algorithm)
        with self.backend.open(self._blob_key(name)) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    # --------------------------------------------------------------- fetch
    def fetch(
        self,
        name: str,
        *,
        local_dir: str,
        sources: Sequence[str] = (),
        digest: str | None = None,
        algorithm: str | None = None,
        publish: bool = True,
    ) -> Fetched:
        """Return a verified local copy of artifact ``name``.

        Tries, in order: the local copy ``{local_dir}/{name}``; the cache (copied through a temp
        name, verified, renamed); each URL of ``sources`` (downloaded with progress, retries and
        resume, verified, renamed), then published into the cache when ``publish``.

        The expected digest is ``digest`` when given (pinned). Without one, the cache's entry is
        the record (trust on first use): the first source to deliver is trusted and recorded,
        every later copy must match it.

        Args:
            name: artifact name, a relative ``/``-separated key (e.g. ``"cifar10/train.parquet"``).
            local_dir: folder for local copies (created if missing).
            sources: URLs to try in order.
            digest: the pinned digest, saying its algorithm (``"sha256:<hex>"``, or the hex with
                ``algorithm=``; see :func:`pinned_digest`), or None.
            algorithm: the algorithm of ``digest``, or (without one) of the digest recorded on
                first use; None: ``digest.DEFAULT`` (``sha256``, ``md5``, ``xxh3-128``).
            publish: copy a downloaded artifact into the cache.

        Returns:
            A :class:`Fetched` record.

        Raises:
            AllSourcesFailedError: no copy could be had; ``failures`` says, per source, why.
            ConfigError: a ``digest`` that does not say its algorithm, or an unknown algorithm.
        """
        check_key(name, url=self.url or "")
        if digest is not None:
            algorithm, digest = pinned_digest(digest, algorithm)
        else:
            algorithm = algorithm or DEFAULT
            new_hasher(algorithm)  # fail fast on an unknown algorithm
        start = time.monotonic()
        path = os.path.join(local_dir, *name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        failures: dict[str, str] = {}

        entry = None
        if self.backend is not None:
            try:
                entry = self.entry(name)
            except BackendError as exc:
                failures["cache"] = f"cache unreadable: {exc}"
        if entry is not None and digest is not None and (entry.algorithm, entry.digest) != (algorithm, digest):
            failures["cache"] = (
                f"cache entry has {entry.algorithm} {entry.digest}, not the pinned "
                f"{algorithm} {digest}; it will be replaced"
            )
            logger.warning("data cache %s: %s", self.url, failures["cache"])
            entry = None
        # What every copy must match: pinned, else the cache's record, else this runtime's sidecar.
        expect: tuple[str, str] | None = (algorithm, digest) if digest else None
        if expect is None and entry is not None:
            expect = (entry.algorithm, entry.digest)

        # 1. local copy
        if os.path.exists(path):
            local_expect = expect
            if local_expect is None:
                side = read_sidecar(local_dir, name)
                local_expect = (side.algorithm, side.digest) if side else None
            if local_expect is None:
                failures["local"] = f"{path} exists but no digest is known to verify it; ignoring it"
                logger.warning("%s", failures["local"])
            else:
                actual = file_digest(path, local_expect[0])
                if actual == local_expect[1]:
                    size = os.path.getsize(path)
                    if publish and self.backend is not None and entry is None:
                        self._try_publish(name, path, local_expect[0], actual, "local")
                    return self._done(name, path, "local", size, local_expect[0], actual, start, failures)
                failures["local"] = f"{path}: {local_expect[0]} {actual} != expected {local_expect[1]}"
                logger.warning("local copy is corrupt, fetching again: %s", failures["local"])

        # 2. the cache
        if entry is not None and expect is not None:
            try:
                got = self._copy_from_cache(name, path, expect)
            except (BackendError, OSError) as exc:
                failures["cache"] = f"cache copy failed: {exc}"
                logger.warning("data cache %s: %s", self.url, failures["cache"])
            else:
                if got is None:
                    write_sidecar(
                        local_dir,
                        name,
                        algorithm=expect[0],
                        digest=expect[1],
                        size=os.path.getsize(path),
                        source="cache",
                    )
                    return self._done(name, path, "cache", os.path.getsize(path), expect[0], expect[1], start, failures)
                failures["cache"] = got
        elif self.backend is not None and "cache" not in failures:
            failures["cache"] = f"not in the cache {self.url}"

        # 3. sources
        for url in sources:
            tmp = f"{path}{TMP_MARK}{xxhash.xxh64_hexdigest(url.encode())}"
            try:
                dl = download(
                    url, tmp, timeout=self.timeout, retries=self.retries, backoff=self.backoff, progress=self.progress
                )
            except DownloadError as exc:
                failures[url] = str(exc)
                logger.warning("source %s failed: %s", url, exc)
                continue
            alg = expect[0] if expect else algorithm
            actual = file_digest(tmp, alg)
            if expect is not None and actual != expect[1]:
                err = DigestMismatchError(
                    f"{url} gave wrong bytes for {name!r}: {alg} {actual}, expected {expect[1]} "
                    f"({dl.size} bytes); trying the next source",
                    source=url,
                    expected=expect[1],
                    actual=actual,
                )
                failures[url] = str(err)
                logger.warning("%s", err)
                os.remove(tmp)  # wrong bytes must not seed a later resume
                continue
            os.replace(tmp, path)
            if expect is None:
                logger.info("no digest pinned for %r: trusting %s on first use (%s %s)", name, url, alg, actual)
            write_sidecar(local_dir, name, algorithm=alg, digest=actual, size=dl.size, source=url)
            if publish and self.backend is not None:
                self._try_publish(name, path, alg, actual, url)
            return self._done(name, path, url, dl.size, alg, actual, start, failures)

        if not sources:
            failures.setdefault("sources", "no source URL was given")
        lines = "\n".join(f"  - {src}: {why}" for src, why in failures.items())
        raise AllSourcesFailedError(
            f"could not get a verified copy of {name!r}; every source failed:\n{lines}\n"
            "Check the network and the URLs, or pass a mirror",
            name=name,
            failures=failures,
        )

    def _try_publish(self, name: str, path: str, algorithm: str, digest: str, source: str) -> None:
        # A cache that cannot be written must not fail a job that already has its data.
        try:
            self.publish(name, path, algorithm=algorithm, digest=digest, source=source)
        except (BackendError, DigestMismatchError) as exc:
            logger.warning("could not publish %r into the cache %s (the job continues): %s", name, self.url, exc)

    def _copy_from_cache(self, name: str, path: str, expect: tuple[str, str]) -> str | None:
        """Copy the blob to ``path`` through a temp name; None on success, else why it was rejected."""
        assert self.backend is not None
        start = time.monotonic()
        tmp = f"{path}{TMP_MARK}cache.{os.getpid()}"
        h = new_hasher(expect[0])
        size = 0
        try:
            total = self.backend.stat(self._blob_key(name)).size
            with (
                self.backend.open(self._blob_key(name)) as src,
                open(tmp, "wb") as out,
                progress_bar(total, 0, os.path.basename(path), self.progress) as bar,
            ):
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
        except ObjectNotFound:
            if os.path.exists(tmp):
                os.remove(tmp)
            return f"cache meta for {name!r} exists but its blob is missing"
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        actual = h.hexdigest()
        if actual != expect[1]:
            os.remove(tmp)
            why = (
                f"cache entry {self._blob_key(name)!r} is corrupt: {expect[0]} {actual} != recorded "
                f"{expect[1]}; it will be fetched again and repaired"
            )
            logger.warning("data cache %s: %s", self.url, why)
            return why
        os.replace(tmp, path)
        seconds = time.monotonic() - start
        logger.info(
            "copied %r from the cache %s: %d bytes in %.2f s (%.1f MiB/s, verified)",
            name,
            self.url,
            size,
            seconds,
            _speed(size, seconds),
        )
        return None

    @staticmethod
    def _done(
        name: str,
        path: str,
        source: str,
        size: int,
        algorithm: str,
        digest: str,
        start: float,
        failures: dict[str, str],
    ) -> Fetched:
        seconds = time.monotonic() - start
        logger.info(
            "%r ready from %s: %s (%d bytes, %.2f s, %.1f MiB/s)",
            name,
            source,
            path,
            size,
            seconds,
            _speed(size, seconds),
        )
        return Fetched(name, path, source, size, algorithm, digest, seconds, dict(failures))
