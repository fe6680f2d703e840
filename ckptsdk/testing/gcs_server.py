"""A GCS JSON-API server on 127.0.0.1 for tests: gcp-storage-emulator, patched to answer like GCS.

``ckptsdk.testing.gcs_emulator.start_emulator()`` runs ``python -m ckptsdk.testing.gcs_server`` as a
subprocess (in-memory, free port, ready-checked with a bounded wait). The emulator as shipped
ignores every precondition, accepts truncated request bodies and has no ``moveTo`` route;
``_install_patches`` (the server side, this module) fixes exactly that, and ``--unpatched`` runs it
as shipped so tests can prove the patch matters. Client-side code (the backend, and the
``Emulator`` handle in ``gcs_emulator``) does not belong here.

The patch, against gcp-storage-emulator ``PINNED_VERSION`` (its handlers are patched by name, so a
new release must be re-read before the pin moves):

1. Preconditions. ``ifGenerationMatch``, ``ifGenerationNotMatch``, ``ifMetagenerationMatch`` and
   ``ifMetagenerationNotMatch`` (query parameters, as the JSON API takes them) are evaluated
   against the live object *right before each mutation*: in ``Storage.create_file`` (media,
   multipart and XML uploads, the finalising PUT of a resumable upload, the destination of
   copy/rewrite/compose/moveTo), ``Storage.delete_file`` (DELETE) and before PATCH (whose
   handler edits the live record in place). Resumable uploads are also checked at initiation
   (fail fast); the conditions given at initiation are remembered per session, so the check at
   finalisation does not depend on the client keeping them in the session URL. ``ifSource*``
   conditions are checked against the source of copy/rewrite/moveTo. A failed check answers 412
   with GCS's error body (``reason: conditionNotMet``) and changes nothing. The server is
   single-threaded (``http.server.HTTPServer``), so a check and the write after it cannot
   interleave with another request: that is what makes the check atomic.
2. ``POST .../o/SRC/moveTo/o/DST`` (gcsfs ``mv`` uses it; shipped: 501, and gcsfs falls back to
   copy+delete after ~30 s of retries).
3. Short bodies are rejected: a request whose body ends before its ``Content-Length`` (or before
   the last chunk of a chunked body) creates nothing. Shipped, a client killed mid-upload leaves
   a truncated object that looks complete. A client that stalls mid-body times out after
   ``BODY_TIMEOUT_S`` instead of blocking the single-threaded server forever.
4. The listen backlog is raised from 5 to 128 (more than 5 concurrent clients stalled ~1 s).
5. New generations start at metageneration "1" (shipped: "2" for multipart/resumable creates).
6. A GET with ``generation=G`` answers 404 once G is no longer live (shipped: serves whatever is
   live), so a reader pinned to a generation notices a replacement instead of mixing versions.
7. A resumable status query (``Content-Range: bytes */N``) on a finished session answers 200
   with the object, and on an empty one 308 without ``Range`` (shipped: 404, and "bytes=0-0"),
   so a client whose final reply was lost can learn that its upload completed.

Not patched (our backend does not use them): preconditions inside batch requests, and ``if*``
conditions on GETs.
Buckets made by ``Emulator.make_bucket`` have soft delete off, so deleted objects free memory.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import logging
import re
import threading
from http import HTTPStatus
from typing import Any

from ckptsdk.testing.child_server import exit_when_orphaned
from ckptsdk.testing.gcs_emulator import Emulator

PINNED_VERSION = "2026.7.19"
BODY_TIMEOUT_S = 60.0
BACKLOG = 128

logger = logging.getLogger(__name__)

_CONDITION_NOT_MET_MESSAGE = "At least one of the pre-conditions you specified did not hold."
_CONDITION_KEYS = (
    "ifGenerationMatch",
    "ifGenerationNotMatch",
    "ifMetagenerationMatch",
    "ifMetagenerationNotMatch",
)


# ---------------------------------------------------------------------------------------------
# Server side: the patch (runs only inside the emulator subprocess)
# ---------------------------------------------------------------------------------------------


class _ConditionNotMet(Exception):
    """A precondition did not hold against the live object."""


class _ShortBody(Exception):
    """The request body ended (or stalled) before the length the client announced."""


# Preconditions of the request being handled. One global is enough because the server handles
# one request at a time (HTTPServer, not ThreadingHTTPServer).
_current: dict[str, dict[str, str]] = {"conds": {}}
# Conditions given when a resumable session was opened, by upload id: checked at finalisation.
_session_conds: dict[str, dict[str, str]] = {}
# Resumable sessions that produced an object, by upload id: a later status query gets the object.
_finished_sessions: dict[str, dict[str, Any]] = {}


def _conditions(query: dict[str, list[str]], prefix: str = "") -> dict[str, str]:
    out = {}
    for key in _CONDITION_KEYS:
        name = prefix + key[2:] if prefix else key  # ifGenerationMatch -> ifSourceGenerationMatch
        if query.get(name):
            out[key] = query[name][0]
    return out


def _check(live: dict[str, Any] | None, conds: dict[str, str]) -> None:
    """Raise ``_ConditionNotMet`` unless every condition holds for ``live`` (None: absent)."""
    gen = str(live["generation"]) if live else None
    meta = str(live.get("metageneration", "1")) if live else None
    if "ifGenerationMatch" in conds:
        want = conds["ifGenerationMatch"]
        if (want == "0" and live is not None) or (want != "0" and gen != want):
            raise _ConditionNotMet(f"ifGenerationMatch={want}, live generation {gen}")
    if "ifGenerationNotMatch" in conds:
        want = conds["ifGenerationNotMatch"]
        if (want == "0" and live is None) or (want != "0" and gen == want):
            raise _ConditionNotMet(f"ifGenerationNotMatch={want}, live generation {gen}")
    if "ifMetagenerationMatch" in conds and meta != conds["ifMetagenerationMatch"]:
        raise _ConditionNotMet(f"ifMetagenerationMatch={conds['ifMetagenerationMatch']}, live {meta}")
    if "ifMetagenerationNotMatch" in conds and live is not None and meta == conds["ifMetagenerationNotMatch"]:
        raise _ConditionNotMet(f"ifMetagenerationNotMatch={conds['ifMetagenerationNotMatch']}, live {meta}")


def _live(storage: Any, bucket: str | None, name: str | None) -> dict[str, Any] | None:
    live: dict[str, Any] | None = storage.objects.get(bucket, {}).get(name)
    return live


def _strict_read_raw_data(request_handler: Any) -> bytes | None:
    """Like the shipped ``_read_raw_data``, but a body shorter than announced is an error."""
    rfile = request_handler.rfile
    try:
        length = request_handler.headers.get("Content-Length")
        if length:
            want = int(length)
            data: bytes = rfile.read(want)
            if len(data) != want:
                raise _ShortBody(f"body ended after {len(data)} of {want} bytes")
            return data
        encoding = request_handler.headers.get("Transfer-Encoding")
        if encoding and encoding.lower() == "chunked":
            parts: list[bytes] = []
            for _ in range(1 << 30):  # bounded by the stream ending, not by this count
                line = rfile.readline()
                if not line:
                    raise _ShortBody("chunked body ended before its last chunk")
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    for _ in range(1000):  # trailer lines, until the blank one
                        if rfile.readline() in (b"\r\n", b"\n", b""):
                            break
                    return b"".join(parts)
                chunk = rfile.read(size)
                if len(chunk) != size:
                    raise _ShortBody(f"chunk ended after {len(chunk)} of {size} bytes")
                parts.append(chunk)
                rfile.readline()
        return None
    except TimeoutError as exc:
        raise _ShortBody(f"client stalled mid-body for {BODY_TIMEOUT_S} s") from exc


def _error_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "error": {
            "code": code,
            "message": message,
            "errors": [{"message": message, "domain": "global", "reason": reason}],
        }
    }


def _guard(handler: Any) -> Any:
    """Wrap a route handler: record its preconditions; turn our exceptions into GCS answers."""

    @functools.wraps(handler)
    def guarded(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        query = request.query
        _current["conds"] = _conditions(query)
        try:
            params = request.params or {}
            bucket, name = params.get("bucket_name"), params.get("object_id")
            if name and params.get("dest_object_id"):
                # copy/rewrite/moveTo: ifSource* conditions are about the source object.
                _check(_live(storage, bucket, name), _conditions(query, prefix="ifSource"))
            if request.method == "GET" and name and query.get("generation"):
                # Reads pinned to a generation: GCS answers 404 once that generation is gone
                # (shipped, the emulator ignores the parameter and serves whatever is live).
                live = _live(storage, bucket, name)
                if live is None or str(live["generation"]) != query["generation"][0]:
                    response.status = HTTPStatus.NOT_FOUND
                    response.json(_error_body(404, "notFound", f"No such object: {bucket}/{name}"))
                    return None
            if request.method == "PUT" and query.get("upload_id"):
                if _resumable_status(request, response, storage, query["upload_id"][0]):
                    return None
            if request.method == "PATCH" and name:
                live = _live(storage, bucket, name)
                if live is not None:  # absent: the handler answers 404, as GCS does
                    _check(live, _current["conds"])
            return handler(request, response, storage, *args, **kwargs)
        except _ConditionNotMet as exc:
            logger.info("412 for %s %s: %s", request.method, request.path, exc)
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json(_error_body(412, "conditionNotMet", _CONDITION_NOT_MET_MESSAGE))
            response["X-Condition-Detail"] = str(exc)
        except _ShortBody as exc:
            logger.warning("rejected %s %s: %s", request.method, request.path, exc)
            request._request_handler.close_connection = True
            response.status = HTTPStatus.BAD_REQUEST
            response.json(_error_body(400, "invalid", f"Incomplete request body: {exc}"))
        finally:
            _current["conds"] = {}
        return None

    return guarded


def _resumable_status(request: Any, response: Any, storage: Any, upload_id: str) -> bool:
    """Answer a resumable status query (``Content-Range: bytes */N``) the way GCS does.

    Shipped, a query on a finished session answers 404 (so a client whose final reply was lost
    cannot learn it succeeded), and one on an empty session claims 1 byte received.
    Returns whether it answered.
    """
    from gcp_storage_emulator.handlers.objects import GoogleHTTPStatus

    crange = request.get_header("Content-Range") or ""
    if not crange.startswith("bytes */"):
        return False
    if upload_id in _finished_sessions:
        response.json(_finished_sessions[upload_id])
        return True
    total = crange[len("bytes */") :]
    if storage.get_resumable_byte_count(upload_id) == 0 and total != "0":
        response.status = GoogleHTTPStatus.RESUME_INCOMPLETE  # no Range header: nothing held
        return True
    return False


def _move(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
    """``objects.move``: one atomic rename inside a bucket (the dest keeps its conditions)."""
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    bucket = request.params["bucket_name"]
    src, dst = request.params["object_id"], request.params["dest_object_id"]
    try:
        src_obj = storage.get_file_obj(bucket, src)
        content = storage.get_file(bucket, src)
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        response.json(_error_body(404, "notFound", f"No such object: {bucket}/{src}"))
        return
    dest = objects._make_object_resource(
        request.base_url, bucket, dst, src_obj["contentType"], src_obj["size"], src_obj
    )
    dest = objects._checksums(content, dest)
    storage.create_file(bucket, dst, content, dest)  # dest preconditions checked in there
    saved, _current["conds"] = _current["conds"], {}  # they were about dst, not src
    try:
        storage.delete_file(bucket, src)
    finally:
        _current["conds"] = saved
    response.json(dest)


def _install_patches() -> None:
    """Patch the emulator's handlers and storage in this process (see the module docstring)."""
    import importlib.metadata

    from gcp_storage_emulator import server, settings
    from gcp_storage_emulator.handlers import objects
    from gcp_storage_emulator.storage import Storage

    installed = importlib.metadata.version("gcp-storage-emulator")
    if installed != PINNED_VERSION:
        logger.warning(
            "gcp-storage-emulator %s installed, the patch was written for %s: re-read its "
            "handlers before trusting the precondition tests",
            installed,
            PINNED_VERSION,
        )

    original_create = Storage.create_file
    original_delete = Storage.delete_file
    original_resumable = Storage.create_resumable_upload

    def create_file(
        self: Any, bucket_name: str, file_name: str, content: Any, file_obj: dict[str, Any], file_id: str | None = None
    ) -> None:
        if bucket_name in self.buckets:
            conds = dict(_current["conds"])
            if file_id is not None:
                conds.update(_session_conds.get(file_id, {}))
            _check(_live(self, bucket_name, file_name), conds)
            file_obj["metageneration"] = "1"  # a new generation; shipped code said "2"
        original_create(self, bucket_name, file_name, content, file_obj, file_id)
        if file_id is not None:
            _session_conds.pop(file_id, None)
            _finished_sessions[file_id] = file_obj

    def delete_file(self: Any, bucket_name: str, file_name: str) -> Any:
        live = _live(self, bucket_name, file_name)
        if live is not None:  # absent: the original raises NotFound (404), as GCS does
            _check(live, _current["conds"])
        return original_delete(self, bucket_name, file_name)

    def create_resumable_upload(self: Any, bucket_name: str, file_name: str, file_obj: dict[str, Any]) -> str:
        conds = dict(_current["conds"])
        if bucket_name in self.buckets:
            _check(_live(self, bucket_name, file_name), conds)  # fail fast; finalisation rechecks
        upload_id: str = original_resumable(self, bucket_name, file_name, file_obj)
        _session_conds[upload_id] = conds
        return upload_id

    Storage.create_file = create_file
    Storage.delete_file = delete_file
    Storage.create_resumable_upload = create_resumable_upload
    server._read_raw_data = _strict_read_raw_data

    move_routes = tuple(
        (
            rf"^{re.escape(p)}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
            rf"(?P<dest_object_id>.*[^/]+)$",
            {"POST": _move},
        )
        for p in (settings.API_ENDPOINT, "")
    )
    routes = move_routes + tuple(server.HANDLERS)
    for _regex, methods in routes:
        for method, handler in list(methods.items()):
            methods[method] = _guard(handler)
    server.HANDLERS = routes
    objects.insert = _guard(objects.insert)  # the Router's fallback for uploads without /upload


def serve(port: int, *, patched: bool = True, exit_with_parent: bool = False, bucket: str | None = None) -> None:
    """Run the emulator in this process until killed; print ``PORT <n>`` once listening."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.storage import Storage

    if exit_with_parent:
        exit_when_orphaned()

    logging.basicConfig(level=logging.WARNING, format="emulator %(levelname)s %(message)s")
    if patched:
        _install_patches()

    class Handler(server.RequestHandler):
        timeout = BODY_TIMEOUT_S if patched else None

    class Server(http.server.HTTPServer):
        request_queue_size = BACKLOG if patched else 5

    httpd = Server(("127.0.0.1", port), functools.partial(Handler, Storage(use_memory_fs=True)))
    print(f"PORT {httpd.server_address[1]}", flush=True)
    if bucket:  # `python -m` for a person: make the bucket once serving, then say what to export
        threading.Thread(target=_announce, args=(httpd.server_address[1], bucket), daemon=True).start()
    httpd.serve_forever()


def _announce(port: int, bucket: str) -> None:
    emulator = Emulator(None, port, None, True)
    emulator.make_bucket(bucket)
    lines = [f"export {k}={v}" for k, v in emulator.env.items()]
    lines.append(f"# bucket {bucket!r} is ready: use gs://{bucket}/RUN as the storage URL (Ctrl-C stops)")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="gcp-storage-emulator on 127.0.0.1, in memory")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    parser.add_argument("--unpatched", action="store_true", help="run the emulator as shipped")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when the parent dies")
    parser.add_argument("--bucket", help="create this bucket and print the environment to export")
    args = parser.parse_args(argv)
    serve(args.port, patched=not args.unpatched, exit_with_parent=args.exit_with_parent, bucket=args.bucket)


if __name__ == "__main__":
    main()
