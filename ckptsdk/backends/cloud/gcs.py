"""Google Cloud Storage backend (``gs://bucket/prefix``): objects over the JSON API, with real preconditions.

What each request means lives here: objects, uploads (multipart, resumable), generations as
versions, 404/412 and lost replies. How a request travels (endpoint, credentials, retries,
deadlines) is ``gcs_transport.py``; chunking and CRC32C are ``gcs_payload.py``; seekable ranged
reads ``ranged.py``; sending one chunk of a resumable session (and resuming it) is ``gcs_upload.py``.
Requests are ours, not gcsfs's, because gcsfs has no public door for
``ifGenerationMatch=<generation>`` (compare-and-swap, conditional delete), turns every 412 into
``FileExistsError``, retries for ~30 s, and keeps a directory cache that never expires.
Checkpoint layout, leases and manifests do not belong here.
"""

from __future__ import annotations

import builtins
import io
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO
from urllib.parse import quote

from ckptsdk.backends.base import Capabilities, Data, ObjectInfo, check_prefix
from ckptsdk.backends.cloud.bucket import BucketRoot
from ckptsdk.backends.cloud.gcs_payload import b64crc, chain, crc32c, rechunk, rfc3339, slices
from ckptsdk.backends.cloud.gcs_transport import Reply, endpoint_of
from ckptsdk.backends.cloud.gcs_upload import ChunkedUploads
from ckptsdk.backends.cloud.ranged import RangedReader
from ckptsdk.errors import (
    BackendError,
    DeadlineExceeded,
    ObjectNotFound,
    PreconditionFailed,
    StorageUnavailable,
)

logger = logging.getLogger(__name__)

__all__ = ["GCSBackend"]

_MiB = 1 << 20


class GCSBackend(BucketRoot, ChunkedUploads):
    """Objects under ``gs://bucket/prefix`` through the GCS JSON API.

    One upload per write (GCS publishes an object whole or not at all): a single multipart request
    up to ``multipart_max`` bytes, else a resumable session in ``chunk_size`` pieces, with a CRC32C
    the server verifies. ``create`` sends ``ifGenerationMatch=0``; ``replace``/``delete(version=)``
    send ``ifGenerationMatch=<generation>``; the version is the object generation.

    A reply lost in transit is retried; if the retry of a conditional write gets 412, the object is
    re-read and, when it holds exactly the bytes we sent, the write is reported as ours. So two
    writers that ``create`` identical bytes can both "win": callers that need exclusivity (a
    lease) put a nonce in the data.

    Args:
        path: ``"bucket"`` or ``"bucket/prefix"``.
        url: the URL it was opened as (for messages); default ``gs://<path>``.
        **storage_options: gcsfs's options: ``endpoint_url``, ``token``, ``project``, ``access``,
            ``session_kwargs`` (for the aiohttp session)... With ``STORAGE_EMULATOR_HOST`` set and
            no ``token`` (or with a plain-http ``endpoint_url``: an emulator), ``token="anon"`` is used.

    Example:
        >>> b = GCSBackend("my-bucket/runs/a", token="anon", endpoint_url="http://127.0.0.1:9023")
        >>> b.create("LEASE.json", b"{...}").version  # doctest: +SKIP
        '1764481112345678'
    """

    scheme = "gs"
    capabilities = Capabilities(
        exclusive_create=True,
        compare_and_swap=True,
        durable_on_return=True,
        immediately_consistent=True,
        cheap_copy=True,  # rewriteTo: the bytes never leave Google
        remote_conditions=True,  # an emulator may ignore them: proven at open (probe.py)
    )
    # Tunables (class attributes so a test can shrink them on one instance).
    # Bigger objects go through a resumable session (as google-cloud-storage does): fewer bytes
    # to resend after a failure, and GCS's own recommendation for large objects.
    multipart_max = 8 * _MiB
    chunk_size = 64 * _MiB  # resumable piece; a multiple of 256 KiB as GCS requires
    read_block = 16 * _MiB  # one ranged GET per block when streaming through open()
    # Request retries and deadlines: see JsonApiTransport (max_attempts, request_deadline_s...).

    def __init__(self, path: str, *, url: str | None = None, **storage_options: Any) -> None:
        self._init_root(path, url)
        options = dict(storage_options)
        emulated = os.environ.get("STORAGE_EMULATOR_HOST") or endpoint_of(options.get("endpoint_url")).startswith(
            "http://"
        )
        if emulated and "token" not in options:
            # An emulator takes no credentials: never wait for their discovery (Google's APIs are
            # https only, so a plain-http endpoint_url is an emulator too).
            options["token"] = "anon"
        self._init_transport(options)
        if "token" not in options and self.credentials_method == "anon":
            # gcsfs falls back to anonymous access silently; a checkpoint root needs writes.
            logger.warning(
                "no Google credentials found for %s: anonymous access reads public "
                "buckets only and cannot write checkpoints; run `gcloud auth "
                "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, or pass "
                "storage_options token=... (STORAGE_EMULATOR_HOST for a local emulator)",
                self.url,
            )

    def __repr__(self) -> str:
        return f"GCSBackend({self.url!r}, endpoint={self.endpoint!r})"

    # -- names and URLs ------------------------------------------------------------------------

    def _object_url(self, name: str, *, media: bool = False) -> str:
        base = self.endpoint
        kind = "download/storage" if media else "storage"
        return f"{base}/{kind}/v1/b/{quote(self.bucket, safe='')}/o/{quote(name, safe='')}"

    def _upload_url(self) -> str:
        return f"{self.endpoint}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"

    def _missing_bucket(self, key: str | None) -> StorageUnavailable:
        return StorageUnavailable(
            f"GCS bucket {self.bucket!r} does not exist (at {self.endpoint}), so {self.url} "
            f"cannot be used: create the bucket (gcloud storage buckets create gs://{self.bucket}) "
            "or fix the URL",
            url=self.url,
            key=key,
        )

    def _bucket_exists(self, key: str | None) -> bool | None:
        reply = self._request("GET", f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}", key=key)
        return {404: False, 200: True}.get(reply.status)  # 403 and such: cannot tell

    def _info(self, key: str, meta: dict[str, Any]) -> ObjectInfo:
        return ObjectInfo(
            key=key, size=int(meta["size"]), version=str(meta["generation"]), mtime=rfc3339(meta.get("updated"))
        )

    def _current_generation(self, key: str) -> str | None:
        try:
            return self.stat(key).version
        except ObjectNotFound:
            return None

    # -- reads ---------------------------------------------------------------------------------

    def _stat_meta(self, key: str) -> dict[str, Any]:
        url = self._object_url(self._name(key))
        reply = self._request("GET", url, key=key)
        if reply.status == 200:
            self._bucket_seen = True
            meta: dict[str, Any] = json.loads(reply.body)
            return meta
        if reply.status == 404:
            raise self._not_found(key, "stat")
        raise self._fail(reply, "GET", url, key, "stat")

    def stat(self, key: str) -> ObjectInfo:
        """Size and generation of ``key``; ``ObjectNotFound`` if absent."""
        return self._info(key, self._stat_meta(key))

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists now (GCS is strongly consistent)."""
        try:
            self._stat_meta(key)
        except ObjectNotFound:
            return False
        return True

    def read(self, key: str) -> bytes:
        """The whole object, in one GET."""
        url = self._object_url(self._name(key), media=True)
        reply = self._request("GET", url, key=key, params={"alt": "media"})
        if reply.status == 200:
            return reply.body
        if reply.status == 404:
            raise self._not_found(key, "read")
        raise self._fail(reply, "GET", url, key, "read")

    def open(self, key: str) -> BinaryIO:
        """Stream the object: ranged GETs of ``read_block`` bytes, pinned to today's generation.

        If the object is replaced or deleted while being read, the next GET fails with
        ``ObjectNotFound`` instead of mixing bytes of two versions.
        """
        meta = self._stat_meta(key)
        generation, url = str(meta["generation"]), self._object_url(self._name(key), media=True)

        def fetch(offset: int, n: int) -> bytes:
            reply = self._request(
                "GET",
                url,
                key=key,
                params={"alt": "media", "generation": generation},
                headers={"Range": f"bytes={offset}-{offset + n - 1}"},
            )
            if reply.status == 404:
                raise ObjectNotFound(
                    f"{key!r} in {self.url} was replaced or deleted while being read "
                    f"(generation {generation} is gone); open it again",
                    url=self.url,
                    key=key,
                )
            if reply.status not in (200, 206):
                raise self._fail(reply, "GET", url, key, "read")
            # 200: the server ignored Range and sent everything.
            return reply.body[offset : offset + n] if reply.status == 200 else reply.body

        raw = RangedReader(fetch, int(meta["size"]), store="GCS", url=self.url, key=key)
        return io.BufferedReader(raw, buffer_size=self.read_block)

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted; always a fresh listing."""
        check_prefix(prefix, url=self.url)
        root = self._root
        out: list[ObjectInfo] = []
        for page in self._pages(prefix, {}):
            for item in page.get("items") or []:
                name = item["name"]
                if name.endswith("/"):  # folder placeholders made by consoles, not objects of ours
                    continue
                out.append(self._info(name[len(root) :], item))
        out.sort(key=lambda info: info.key)
        return out

    def _subfolders(self, prefix: str) -> Iterator[str]:
        return (p for page in self._pages(prefix, {"delimiter": "/"}) for p in page.get("prefixes") or [])

    def _pages(self, prefix: str, extra: dict[str, str]) -> Iterator[dict[str, Any]]:
        """The pages of the bucket's listing of ``prefix`` under the root (``extra``: more parameters)."""
        url = f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        params = {"prefix": self._root + prefix, "maxResults": "1000", **extra}
        for _ in range(1_000_000):  # pages; bounded so a server that loops cannot hang us
            reply = self._request("GET", url, key=prefix or None, params=params)
            if reply.status == 404:
                raise self._missing_bucket(prefix or None)
            if reply.status != 200:
                raise self._fail(reply, "GET", url, prefix, "list")
            self._bucket_seen = True
            page = json.loads(reply.body)
            yield page
            token = page.get("nextPageToken")
            if not token:
                return
            params["pageToken"] = token

    # -- writes --------------------------------------------------------------------------------

    def write(self, key: str, data: Data) -> ObjectInfo:
        """Publish ``data`` at ``key`` in one upload (GCS makes it atomic)."""
        return self._upload(key, data, None)

    def create(self, key: str, data: Data) -> ObjectInfo:
        """Publish only if ``key`` is absent (``ifGenerationMatch=0``); else ``PreconditionFailed``."""
        return self._upload(key, data, "0")

    def replace(self, key: str, data: Data, version: str) -> ObjectInfo:
        """Publish only if ``key``'s generation is still ``version``; else ``PreconditionFailed``."""
        if not (isinstance(version, str) and version.isdigit() and version != "0"):
            raise PreconditionFailed(
                f"cannot replace {key!r} in {self.url}: {version!r} is not a GCS generation "
                "(use the version returned by stat/write/create)",
                url=self.url,
                key=key,
                expected=str(version),
                actual=self._current_generation(key),
            )
        return self._upload(key, data, version)

    def _upload(self, key: str, data: Data, if_generation: str | None) -> ObjectInfo:
        name = self._name(key)
        params = {} if if_generation is None else {"ifGenerationMatch": if_generation}
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            if view.nbytes <= self.multipart_max:
                return self._multipart(key, name, view, params, if_generation)
            return self._resumable(key, name, slices(view, self.chunk_size), params, if_generation, view)
        # An iterable of chunks: copy into our own buffer (the producer may reuse its buffers),
        # and go resumable only once it outgrows one multipart request.
        buffered = bytearray()
        chunks = iter(data)
        for chunk in chunks:
            buffered += memoryview(chunk).cast("B")
            if len(buffered) > self.multipart_max:
                pieces = rechunk(chain(buffered, chunks), self.chunk_size)
                return self._resumable(key, name, pieces, params, if_generation, None)
        return self._multipart(key, name, memoryview(buffered), params, if_generation)

    def _multipart(
        self, key: str, name: str, view: memoryview, params: dict[str, str], if_generation: str | None
    ) -> ObjectInfo:
        crc = crc32c(0, view)
        meta = json.dumps({"name": name, "crc32c": b64crc(crc)}).encode()
        boundary = "ckptsdk-" + secrets.token_hex(16)
        body = b"".join(
            [
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                meta,
                f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                view,
                f"\r\n--{boundary}--\r\n".encode(),
            ]
        )
        url = self._upload_url()
        reply = self._request(
            "POST",
            url,
            key=key,
            params={"uploadType": "multipart", **params},
            data=body,
            headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
        )
        del body
        return self._finished(reply, "POST", url, key, if_generation, view.nbytes, crc, view)

    def _resumable(
        self,
        key: str,
        name: str,
        pieces: Iterable[tuple[Any, bool]],
        params: dict[str, str],
        if_generation: str | None,
        view: memoryview | None,
    ) -> ObjectInfo:
        """Upload ``pieces`` (chunk, is_last) through one resumable session."""
        url = self._upload_url()
        reply = self._request(
            "POST",
            url,
            key=key,
            params={"uploadType": "resumable", "name": name, **params},
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json", "X-Upload-Content-Type": "application/octet-stream"},
        )
        if reply.status == 412:  # checked at initiation: nothing was written, the answer is final
            raise self._precondition(key, if_generation)
        if reply.status == 404:
            raise self._missing_bucket(key)
        if reply.status != 200 or "Location" not in reply.headers:
            raise self._fail(reply, "POST", url, key, "start uploading")
        location = reply.headers["Location"]
        try:
            crc, offset = 0, 0
            for chunk, last in pieces:
                crc = crc32c(crc, chunk)
                total = offset + len(chunk) if last else None
                reply = self._put_chunk(key, location, chunk, offset, total, crc)
                offset += len(chunk)
                if last:
                    return self._finished(reply, "PUT", location, key, if_generation, offset, crc, view)
            raise AssertionError("chunk producer ended without a last chunk")  # _slices/_rechunk bug
        except BaseException as failure:
            # Cancel the session so the half-sent bytes are dropped now, not in a week; not past
            # the save's deadline (the store is not answering, and the caller is done waiting).
            if isinstance(failure, DeadlineExceeded):
                logger.info("upload session for %r in %s left to expire (GCS drops it in a week)", key, self.url)
                raise
            try:
                self._request("DELETE", location, key=key, attempts=1)
            except BackendError as exc:
                logger.warning("could not cancel upload session for %r in %s: %s", key, self.url, exc)
            raise

    def _finished(
        self,
        reply: Reply,
        method: str,
        url: str,
        key: str,
        if_generation: str | None,
        size: int,
        crc: int,
        view: memoryview | None,
    ) -> ObjectInfo:
        """Turn the answer to the request that finished an upload into ObjectInfo or an error."""
        if reply.status in (200, 201):
            self._bucket_seen = True
            return self._info(key, json.loads(reply.body))
        if reply.status == 412:
            if reply.ambiguous:
                # An earlier attempt may have been applied and its reply lost; then the 412 is
                # our own object answering. Ours iff it holds exactly the bytes we sent.
                mine = self._holds(key, size, crc, view)
                if mine is not None:
                    logger.info("write of %r to %s: reply was lost, but the object is ours", key, self.url)
                    return mine
            raise self._precondition(key, if_generation)
        if reply.status == 404:
            raise self._missing_bucket(key)
        raise self._fail(reply, method, url, key, "write")

    def _holds(self, key: str, size: int, crc: int, view: memoryview | None) -> ObjectInfo | None:
        try:
            meta = self._stat_meta(key)
        except ObjectNotFound:
            return None
        if int(meta["size"]) != size or meta.get("crc32c") not in (None, b64crc(crc)):
            return None
        if view is not None and self.read(key) != view:
            return None
        return self._info(key, meta)

    def _precondition(self, key: str, if_generation: str | None) -> PreconditionFailed:
        actual = self._current_generation(key)
        if if_generation == "0":
            msg = f"{key!r} already exists in {self.url} (generation {actual}); create() publishes only new keys"
        else:
            msg = (
                f"{key!r} in {self.url} is no longer generation {if_generation} "
                f"(now {actual or 'absent'}): another writer changed it; re-read and decide"
            )
        return PreconditionFailed(
            msg,
            url=self.url,
            key=key,
            expected=None if if_generation == "0" else if_generation,
            actual=actual,
        )

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Server-side copy (``rewriteTo``, ``ifGenerationMatch=0``): no byte passes through here.

        Large objects may take several calls (GCS answers with a ``rewriteToken`` until done).

        Raises:
            ObjectNotFound: ``src`` does not exist.
            PreconditionFailed: ``dst`` exists already.
        """
        src_name, dst_name = self._name(src), self._name(dst)
        url = f"{self._object_url(src_name)}/rewriteTo/b/{quote(self.bucket, safe='')}/o/{quote(dst_name, safe='')}"
        params = {"ifGenerationMatch": "0"}
        for _ in range(10_000):  # one call per rewritten chunk; bounded so a server cannot loop us
            reply = self._request("POST", url, key=dst, params=params)
            if reply.status == 404:
                raise self._not_found(src, "copy")
            if reply.status == 412:
                if reply.ambiguous:  # a lost reply of a rewrite that landed: ours iff same bytes
                    mine, theirs = self._stat_meta(src), self._stat_meta(dst)
                    if (mine.get("crc32c"), mine["size"]) == (theirs.get("crc32c"), theirs["size"]):
                        return self._info(dst, theirs)
                raise self._precondition(dst, "0")
            if reply.status != 200:
                raise self._fail(reply, "POST", url, dst, "copy")
            answer = json.loads(reply.body)
            if answer.get("done", True):
                return self._info(dst, answer["resource"])
            params = {"ifGenerationMatch": "0", "rewriteToken": answer["rewriteToken"]}
        raise BackendError(f"copy of {src!r} to {dst!r} in {self.url} never finished", url=self.url, key=dst)

    def delete(self, key: str, *, version: str | None = None) -> None:
        """Delete ``key``; with ``version``, only if that is still its generation."""
        url = self._object_url(self._name(key))
        params = None
        if version is not None:
            if not (isinstance(version, str) and version.isdigit()):
                raise self._precondition(key, str(version))
            params = {"ifGenerationMatch": version}
        reply = self._request("DELETE", url, key=key, params=params)
        if reply.status in (200, 204):
            return
        if reply.status == 404:
            if reply.ambiguous:
                # Our first attempt deleted it and its reply was lost.
                logger.info("delete of %r in %s: reply was lost, the object is gone", key, self.url)
                return
            raise self._not_found(key, "delete")
        if reply.status == 412:
            raise self._precondition(key, version)
        raise self._fail(reply, "DELETE", url, key, "delete")

    def sweep(
        self, older_than: float, *, only: Callable[[str], bool] | None = None
    ) -> builtins.list[str]:  # `list`: the method above
        """Nothing to sweep: an unfinished GCS upload is never an object."""
        return []
