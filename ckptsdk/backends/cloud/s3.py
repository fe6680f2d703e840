"""S3 and S3-compatible storage (``s3://bucket/prefix``: AWS S3, Cloudflare R2, MinIO), with real preconditions.

What each call means lives here: objects, single and multi-part uploads, ETags as versions,
``If-None-Match: *`` / ``If-Match`` for the lease, 404/412 and lost replies. How a call travels
(client, credentials, retries, deadlines) is ``s3_transport.py``. botocore directly, not s3fs:
s3fs sends ``IfNoneMatch`` only for ``mode="create"`` and has no compare-and-swap, and boto3's
managed transfer cannot pass either condition (boto3 #4366). Checkpoints, leases and manifests do
not belong here.
"""

from __future__ import annotations

import builtins
import io
import itertools
import logging
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ckptsdk.backends.base import Capabilities, Data, ObjectInfo, check_prefix, iter_chunks
from ckptsdk.backends.cloud.bucket import BucketRoot
from ckptsdk.backends.cloud.ranged import RangedReader
from ckptsdk.backends.cloud.s3_payload import crc_b64, etag_of, http_date, store_time
from ckptsdk.backends.cloud.s3_transport import Answer, S3Transport
from ckptsdk.errors import BackendError, DeadlineExceeded, ObjectNotFound, PreconditionFailed

logger = logging.getLogger(__name__)

__all__ = ["S3Backend"]

_MiB = 1 << 20
_MAX_PARTS = 10_000  # S3's limit per multi-part upload
_COPY_PART = 1 << 30  # UploadPartCopy copies at most 5 GiB per part; 1 GiB keeps each call short


class S3Backend(S3Transport, BucketRoot):
    """Objects under ``s3://bucket/prefix`` through the S3 API (botocore).

    ``write``/``create``/``replace`` publish with one PutObject up to ``multipart_threshold``
    bytes, else through a multi-part upload in ``part_size`` parts, each checked by the store
    (CRC32), completed with the CRC32 of the whole object (``ChecksumType=FULL_OBJECT``) and that
    checksum compared with what the store reports: end to end. ``create`` sends
    ``If-None-Match: *``, ``replace``/``delete(version=)`` ``If-Match: <ETag>``, on the PutObject or
    on the CompleteMultipartUpload. A crashed multi-part upload never becomes an object; ``sweep``
    aborts its parts.

    The version is the ETag, which S3 derives from the bytes: writing the same bytes again gives
    the same version (a replace conditioned on it then also succeeds: harmless, the bytes are
    the ones the caller saw). The lease never writes the same record twice (a renewal counter and a
    nonce), so its compare-and-swap is exact. Writes report no ``mtime`` (PutObject answers none);
    ``stat`` and ``list`` report the store's LastModified (whole seconds).

    Args:
        path: ``"bucket"`` or ``"bucket/prefix"``.
        url: the URL it was opened as (for messages); default ``s3://<path>``.
        **storage_options: ``endpoint_url`` (MinIO, R2, a local server; else ``AWS_ENDPOINT_URL_S3``
            or AWS), ``region``, ``profile``, ``aws_access_key_id``, ``aws_secret_access_key``,
            ``aws_session_token``, ``anon`` (unsigned, public reads), ``max_pool_connections``.
            Credentials otherwise come from the standard AWS chain.

    Raises:
        ConfigError: no bucket in the URL, an unknown option, or no credentials anywhere.

    Example:
        >>> b = S3Backend("my-bucket/runs/a", endpoint_url="http://127.0.0.1:9000")  # doctest: +SKIP
        >>> b.create("LEASE.json", b"{...}").version  # doctest: +SKIP
        'a1b2c3...'
    """

    scheme = "s3"
    capabilities = Capabilities(
        exclusive_create=True,
        compare_and_swap=True,
        cheap_copy=True,  # UploadPartCopy: the bytes stay in the store (see copy)
        remote_conditions=True,
    )
    multipart_threshold = 16 * _MiB
    part_size = 16 * _MiB  # >= 5 MiB (S3's minimum part but the last); grown to fit 10,000 parts
    read_block = 16 * _MiB  # one ranged GET per block when streaming through open()

    def __init__(self, path: str, *, url: str | None = None, **storage_options: Any) -> None:
        self._init_root(path, url)
        self._init_transport(dict(storage_options))

    def __repr__(self) -> str:
        return f"S3Backend({self.url!r}, endpoint={self.endpoint!r})"

    # -- names -------------------------------------------------------------------------------

    def _bucket_exists(self, key: str | None) -> bool | None:
        answer = self._call("head_bucket", key)
        return False if answer.status == 404 else (True if answer.ok else None)

    def _check(self, answer: Answer, key: str, doing: str) -> dict[str, Any]:
        if answer.response is not None:
            self._bucket_seen = True
            return answer.response
        if answer.code == "NoSuchBucket":
            raise self._missing_bucket(key)
        if answer.status == 404:
            raise self._not_found(key, doing)
        raise self._fail(answer, doing, key, doing)

    # -- reads -------------------------------------------------------------------------------

    def _head(self, key: str, *, checksum: bool = False) -> dict[str, Any]:
        extra: dict[str, Any] = {"ChecksumMode": "ENABLED"} if checksum else {}
        return self._check(self._call("head_object", key, Key=self._name(key), **extra), key, "stat")

    def stat(self, key: str) -> ObjectInfo:
        """Size, ETag and LastModified of ``key``; ``ObjectNotFound`` if absent."""
        head = self._head(key)
        return ObjectInfo(key, int(head["ContentLength"]), etag_of(head["ETag"]), store_time(head.get("LastModified")))

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists now (S3 is strongly consistent)."""
        try:
            self._head(key)
        except ObjectNotFound:
            return False
        return True

    def _current(self, key: str) -> str | None:
        try:
            return self.stat(key).version
        except ObjectNotFound:
            return None

    def read(self, key: str) -> bytes:
        """The whole object in one GET (its CRC32, where stored, checked by botocore as it arrives)."""
        answer = self._call("get_object", key, read_body=True, Key=self._name(key), ChecksumMode="ENABLED")
        return bytes(self._check(answer, key, "read")["Data"])

    def open(self, key: str) -> BinaryIO:
        """Stream the object: ranged GETs of ``read_block`` bytes, each ``If-Match`` today's ETag.

        If the object is replaced while being read, the next GET fails with ``ObjectNotFound``
        instead of mixing bytes of two versions.
        """
        head = self._head(key)
        etag, name = head["ETag"], self._name(key)

        def fetch(offset: int, n: int) -> bytes:
            answer = self._call(
                "get_object", key, read_body=True, Key=name, IfMatch=etag, Range=f"bytes={offset}-{offset + n - 1}"
            )
            if answer.status in (404, 412):
                raise ObjectNotFound(
                    f"{key!r} in {self.url} was replaced or deleted while being read (ETag {etag_of(etag)} "
                    "is gone); open it again",
                    url=self.url,
                    key=key,
                )
            return bytes(self._check(answer, key, "read")["Data"])

        raw = RangedReader(fetch, int(head["ContentLength"]), store="S3", url=self.url, key=key)
        return io.BufferedReader(raw, buffer_size=self.read_block)

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted; always a fresh listing."""
        check_prefix(prefix, url=self.url)
        root = self._root
        out: list[ObjectInfo] = []
        for page in self._pages(prefix, {}):
            for item in page.get("Contents") or []:
                name = item["Key"]
                if name.endswith("/"):  # folder placeholders made by consoles, not objects of ours
                    continue
                out.append(
                    ObjectInfo(
                        name[len(root) :], int(item["Size"]), etag_of(item["ETag"]), store_time(item["LastModified"])
                    )
                )
        out.sort(key=lambda info: info.key)
        return out

    def _subfolders(self, prefix: str) -> Iterator[str]:
        pages = self._pages(prefix, {"Delimiter": "/"})
        return (c["Prefix"] for page in pages for c in page.get("CommonPrefixes") or [])

    def _pages(self, prefix: str, extra: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The pages of the bucket's listing of ``prefix`` under the root (``extra``: more parameters)."""
        params: dict[str, Any] = {"Prefix": self._root + prefix, "MaxKeys": 1000, **extra}
        for _ in range(1_000_000):  # pages; bounded so a server that loops cannot hang us
            answer = self._call("list_objects_v2", prefix or None, **params)
            if answer.response is None:
                if answer.status == 404:
                    raise self._missing_bucket(prefix or None)
                raise self._fail(answer, "list_objects_v2", prefix or None, "list")
            self._bucket_seen = True
            page = answer.response
            yield page
            if not page.get("IsTruncated"):
                return
            params["ContinuationToken"] = page["NextContinuationToken"]

    # -- writes ------------------------------------------------------------------------------

    def write(self, key: str, data: Data) -> ObjectInfo:
        """Publish ``data`` at ``key`` (one PutObject, or a multi-part upload: S3 makes either atomic)."""
        return self._upload(key, data, {})

    def create(self, key: str, data: Data) -> ObjectInfo:
        """Publish only if ``key`` is absent (``If-None-Match: *``); else ``PreconditionFailed``."""
        return self._upload(key, data, {"IfNoneMatch": "*"})

    def replace(self, key: str, data: Data, version: str) -> ObjectInfo:
        """Publish only if ``key``'s ETag is still ``version`` (``If-Match``); else ``PreconditionFailed``."""
        if not isinstance(version, str) or not version or '"' in version or "*" in version:
            raise PreconditionFailed(
                f"cannot replace {key!r} in {self.url}: {version!r} is not an S3 ETag "
                "(use the version returned by stat/write/create)",
                url=self.url,
                key=key,
                expected=str(version),
                actual=self._current(key),
            )
        return self._upload(key, data, {"IfMatch": f'"{version}"'})

    def _upload(self, key: str, data: Data, cond: dict[str, Any]) -> ObjectInfo:
        name = self._name(key)
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            if view.nbytes <= self.multipart_threshold:
                return self._put(key, name, bytes(view), cond)
            return self._multipart(key, name, self._parts(iter([view]), view.nbytes), cond)
        # An iterable of chunks: copy into our own buffer (the producer may reuse its buffers),
        # and go multi-part only once it outgrows one PutObject.
        buffered = bytearray()
        chunks = iter(data)
        for chunk in chunks:
            buffered += memoryview(chunk).cast("B")
            if len(buffered) > self.multipart_threshold:
                return self._multipart(
                    key, name, self._parts(itertools.chain([memoryview(buffered)], iter_chunks(chunks)), None), cond
                )
        return self._put(key, name, bytes(buffered), cond)

    def _put(self, key: str, name: str, body: bytes, cond: dict[str, Any]) -> ObjectInfo:
        # botocore sends the body's CRC32 (x-amz-checksum-crc32) and the store verifies it.
        answer = self._call("put_object", key, Key=name, Body=body, ChecksumAlgorithm="CRC32", **cond)
        if answer.response is not None:
            self._bucket_seen = True
            return ObjectInfo(key, len(body), etag_of(answer.response["ETag"]))
        return self._refused(answer, key, cond, len(body), zlib.crc32(body), body)

    def _parts(self, pieces: Iterator[memoryview], total: int | None) -> Iterator[bytes]:
        """Regroup ``pieces`` into parts of ``part_size`` (grown so ``total`` fits 10,000 parts)."""
        size = self.part_size if total is None else max(self.part_size, -(-total // _MAX_PARTS))
        buf = bytearray()
        for piece in pieces:
            buf += piece
            while len(buf) >= size:
                yield bytes(buf[:size])
                del buf[:size]
        if buf:
            yield bytes(buf)

    def _multipart(self, key: str, name: str, parts: Iterator[bytes], cond: dict[str, Any]) -> ObjectInfo:
        if "IfNoneMatch" in cond and self.exists(key):  # fail fast; the completion decides for real
            raise self._precondition(key, cond)
        start = self._call(
            "create_multipart_upload", key, Key=name, ChecksumAlgorithm="CRC32", ChecksumType="FULL_OBJECT"
        )
        upload_id = self._check(start, key, "start uploading")["UploadId"]
        try:
            crc, size, done = 0, 0, []
            for number, part in enumerate(parts, start=1):
                if number > _MAX_PARTS:
                    raise BackendError(f"{key!r} in {self.url}: more than {_MAX_PARTS} parts", url=self.url, key=key)
                crc, size = zlib.crc32(part, crc), size + len(part)
                answer = self._call(
                    "upload_part",
                    key,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=part,
                    ChecksumAlgorithm="CRC32",
                )
                got = self._check(answer, key, "upload a part of")
                done.append({"PartNumber": number, "ETag": got["ETag"], "ChecksumCRC32": got["ChecksumCRC32"]})
            answer = self._call(
                "complete_multipart_upload",
                key,
                Key=name,
                UploadId=upload_id,
                MultipartUpload={"Parts": done},
                ChecksumCRC32=crc_b64(crc),
                ChecksumType="FULL_OBJECT",
                **cond,
            )
            if answer.response is None:
                return self._refused(answer, key, cond, size, crc, None)
            self._bucket_seen = True
            self._verify(key, answer.response, size, crc)
            return ObjectInfo(key, size, etag_of(answer.response["ETag"]))
        except BaseException as failure:
            # Abort so the parts stop costing storage now, not when a lifecycle rule runs; not past
            # the save's deadline (the store is not answering): ``sweep`` aborts them later.
            if isinstance(failure, DeadlineExceeded):
                logger.info("multi-part upload of %r in %s left for sweep() to abort", key, self.url)
                raise
            try:
                self._call("abort_multipart_upload", key, Key=name, UploadId=upload_id)
            except BackendError as exc:
                logger.warning("could not abort the upload of %r in %s: %s", key, self.url, exc)
            raise

    def _verify(self, key: str, done: dict[str, Any], size: int, crc: int) -> None:
        """The end-to-end check: the store's CRC32 of the assembled object is the one of our bytes."""
        reported = done.get("ChecksumCRC32")
        if reported is None:
            head = self._head(key, checksum=True)
            reported = head.get("ChecksumCRC32")
            if int(head["ContentLength"]) != size:
                reported = "size " + str(head["ContentLength"])
        if reported is not None and reported != crc_b64(crc):
            raise BackendError(
                f"S3 assembled {key!r} in {self.url} with checksum {reported}, but the bytes sent have "
                f"CRC32 {crc_b64(crc)} ({size} bytes): the object is corrupt; write it again",
                url=self.url,
                key=key,
            )

    def _refused(
        self, answer: Answer, key: str, cond: dict[str, Any], size: int, crc: int, body: bytes | None
    ) -> ObjectInfo:
        """A write that did not answer 200: a lost precondition, our own earlier attempt, or an error."""
        if answer.code == "NoSuchBucket":
            raise self._missing_bucket(key)
        if answer.status == 412 or (answer.status == 404 and "IfMatch" in cond):
            if answer.ambiguous:
                # An earlier attempt may have landed and its reply been lost; then the 412 is our
                # own object answering. Ours iff it holds exactly the bytes we sent.
                mine = self._holds(key, size, crc, body)
                if mine is not None:
                    logger.info("write of %r to %s: reply was lost, but the object is ours", key, self.url)
                    return mine
            raise self._precondition(key, cond)
        raise self._fail(answer, "write", key, "write")

    def _holds(self, key: str, size: int, crc: int, body: bytes | None) -> ObjectInfo | None:
        try:
            head = self._head(key, checksum=True)
        except ObjectNotFound:
            return None
        if int(head["ContentLength"]) != size or head.get("ChecksumCRC32") not in (None, crc_b64(crc)):
            return None
        if body is not None and self.read(key) != body:
            return None
        return ObjectInfo(key, size, etag_of(head["ETag"]), store_time(head.get("LastModified")))

    def _precondition(self, key: str, cond: dict[str, Any]) -> PreconditionFailed:
        actual = self._current(key)
        if "IfNoneMatch" in cond:
            msg = f"{key!r} already exists in {self.url} (ETag {actual}); create() publishes only new keys"
            expected = None
        else:
            expected = etag_of(cond.get("IfMatch"))
            msg = (
                f"{key!r} in {self.url} is no longer version {expected} (now {actual or 'absent'}): "
                "another writer changed it; re-read and decide"
            )
        return PreconditionFailed(msg, url=self.url, key=key, expected=expected, actual=actual)

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Server-side copy, published only if ``dst`` is absent: no byte passes through here.

        CopyObject takes no ``If-None-Match`` for its target, so the copy is a multi-part upload
        of ``UploadPartCopy`` parts (each ``CopySourceIfMatch`` the source's ETag: one version
        throughout) completed with ``If-None-Match: *``.

        Raises:
            ObjectNotFound: ``src`` does not exist.
            PreconditionFailed: ``dst`` exists already.
        """
        head, name, source = self._head(src), self._name(dst), f"{self.bucket}/{self._name(src)}"
        size = int(head["ContentLength"])
        cond: dict[str, Any] = {"IfNoneMatch": "*"}
        if size == 0:  # UploadPartCopy cannot copy an empty range
            return self.create(dst, b"")
        if self.exists(dst):
            raise self._precondition(dst, cond)
        upload_id = self._check(self._call("create_multipart_upload", dst, Key=name), dst, "start copying")["UploadId"]
        try:
            step = max(_COPY_PART, -(-size // _MAX_PARTS))
            done = []
            for number, start in enumerate(range(0, size, step), start=1):
                answer = self._call(
                    "upload_part_copy",
                    dst,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=source,
                    CopySourceIfMatch=head["ETag"],
                    CopySourceRange=f"bytes={start}-{min(start + step, size) - 1}",
                )
                if answer.status in (404, 412):
                    raise self._not_found(src, "copy")  # gone or replaced while being copied
                etag = self._check(answer, dst, "copy")["CopyPartResult"]["ETag"]
                done.append({"PartNumber": number, "ETag": etag})
            answer = self._call(
                "complete_multipart_upload", dst, Key=name, UploadId=upload_id, MultipartUpload={"Parts": done}, **cond
            )
            if answer.response is None:
                if answer.status == 412 and not answer.ambiguous:
                    raise self._precondition(dst, cond)
                if answer.status != 412:
                    raise self._fail(answer, "complete_multipart_upload", dst, "copy")
            info = self.stat(dst)
            if info.size != size:
                raise PreconditionFailed(f"{dst!r} exists in {self.url} with other bytes", url=self.url, key=dst)
            return info
        except BaseException:
            try:
                self._call("abort_multipart_upload", dst, Key=name, UploadId=upload_id)
            except BackendError as exc:
                logger.warning("could not abort the copy to %r in %s: %s", dst, self.url, exc)
            raise

    def delete(self, key: str, *, version: str | None = None) -> None:
        """Delete ``key``; with ``version``, only if that is still its ETag (``If-Match``)."""
        name = self._name(key)
        if version is None:
            self._head(key)  # S3 answers 204 for an absent key: the contract wants ObjectNotFound
            answer = self._call("delete_object", key, Key=name)
        else:
            if not isinstance(version, str) or not version or '"' in version:
                raise self._precondition(key, {"IfMatch": str(version)})
            answer = self._call("delete_object", key, Key=name, IfMatch=f'"{version}"')
        if answer.ok:
            return
        if answer.status == 404 and answer.code != "NoSuchBucket":
            if answer.ambiguous:  # our first attempt deleted it and its reply was lost
                logger.info("delete of %r in %s: reply was lost, the object is gone", key, self.url)
                return
            raise self._not_found(key, "delete")
        if answer.status == 412:
            raise self._precondition(key, {"IfMatch": str(version)})
        raise self._fail(answer, "delete_object", key, "delete")

    def sweep(
        self, older_than: float, *, only: Callable[[str], bool] | None = None
    ) -> builtins.list[str]:  # `list`: the method above
        """Abort multi-part uploads under the root started more than ``older_than`` s ago.

        A crashed writer's upload never becomes an object, but its parts cost storage until
        aborted. Ages are judged on the store's clock (its ``Date`` against ``Initiated``).
        Returns the keys whose uploads were aborted.
        """
        answer = self._call("list_multipart_uploads", None, Prefix=self._root)
        page = self._check(answer, "", "list uploads")
        now = http_date(answer.response["ResponseMetadata"]["HTTPHeaders"].get("date") if answer.response else None)
        removed = []
        for upload in page.get("Uploads") or []:
            key = upload["Key"][len(self._root) :]
            started = store_time(upload.get("Initiated"))
            if only is not None and not only(key):
                continue
            if older_than > 0 and (now is None or started is None or now - started < older_than):
                continue
            done = self._call("abort_multipart_upload", key, Key=upload["Key"], UploadId=upload["UploadId"])
            if done.ok or done.status == 404:
                removed.append(key)
        return sorted(removed)
