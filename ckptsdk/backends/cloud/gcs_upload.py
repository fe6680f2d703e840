"""One chunk of a GCS resumable upload for ``gcs.py``: PUT it, and after a lost reply resume it.

``ChunkedUploads._put_chunk`` asks the server how far a session got (``Content-Range: bytes */N``)
and resends only the rest. Starting, finishing or cancelling a session, and what its answer means
for the object (preconditions, ObjectInfo), belong to ``gcs.py``; retrying one request belongs
to ``gcs_transport.py``.
"""

from __future__ import annotations

from ckptsdk.backends.cloud.gcs_payload import b64crc, persisted
from ckptsdk.backends.cloud.gcs_transport import JsonApiTransport, Reply
from ckptsdk.errors import BackendError, DeadlineExceeded

__all__ = ["ChunkedUploads"]


class ChunkedUploads(JsonApiTransport):
    """The JSON-API transport plus the chunk PUT of a resumable session (``GCSBackend``'s base)."""

    def _put_chunk(self, key: str, location: str, chunk: bytes, offset: int, total: int | None, crc: int) -> Reply:
        """PUT ``chunk`` at ``offset``; after a lost reply ask the server how far it got and resume."""
        end = offset + len(chunk)
        size = "*" if total is None else str(total)
        headers = {"Content-Type": "application/octet-stream"}
        if total is not None:
            headers["X-Goog-Hash"] = f"crc32c={b64crc(crc)}"  # GCS verifies the whole object
        ambiguous = False
        sent_from = offset
        for attempt in range(self.max_attempts):
            if attempt:
                status = self._request("PUT", location, key=key, headers={"Content-Range": f"bytes */{size}"})
                if status.status in (200, 201, 412):  # finished (or refused) at finalisation
                    return Reply(status.status, status.headers, status.body, True)
                if status.status != 308:
                    raise self._fail(status, "PUT", location, key, "resume uploading")
                sent_from = persisted(status.headers)
                if not offset <= sent_from <= end:
                    raise BackendError(
                        f"upload of {key!r} to {self.url}: server holds {sent_from} bytes, "
                        f"expected {offset}..{end}; retry the write",
                        url=self.url,
                        key=key,
                    )
                if sent_from == end and total is None:
                    return status
            part = chunk[sent_from - offset :]
            last = sent_from + len(part) - 1
            crange = f"bytes {sent_from}-{last}/{size}" if part else f"bytes */{size}"
            try:
                reply = self._request(
                    "PUT",
                    location,
                    key=key,
                    headers={**headers, "Content-Range": crange},
                    data=part,
                    attempts=1,
                )
            except DeadlineExceeded:
                raise  # the save is over: asking the server how far it got would wait again
            except BackendError:
                ambiguous = True  # maybe (partly) stored: ask the server before resending
                continue
            reply.ambiguous = reply.ambiguous or ambiguous
            if reply.status == 308 and (total is not None or persisted(reply.headers) < end):
                ambiguous = True  # GCS kept only part of the chunk: resume from where it stopped
                continue
            return reply
        raise BackendError(
            f"upload of {key!r} to {self.url} made no progress after {self.max_attempts} attempts; "
            "check the network and retry the write",
            url=self.url,
            key=key,
        )
