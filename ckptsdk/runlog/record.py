"""The run log's documents: the attempt record, the step rows, their keys, and reading them back.

Writing the log (buffering, chunks, retries) is ``ckptsdk.runlog.writer``'s; comparing attempts is
``ckptsdk.runlog.audit``'s. Format ``ckptsdk.runlog/1.1`` stores a non-finite scalar as
``{"$float": "nan"}`` (``document``'s one encoding); 1.0 wrote the strings "NaN", "Infinity" and
"-Infinity", which are still read. Scalars named ``data/...`` are digests of the data a step ran
on (the ckptsdk loader's batch indices, :func:`digest_value`): plain numbers, so every reader of
1.1 reads them, and the audit compares them exactly. Chunks are read line by line with a cap on a
line (:func:`iter_chunk`), so a damaged or hostile object costs bounded memory.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from typing import IO, Annotated, Any, ClassVar, Final

from pydantic import BeforeValidator, Field, PlainSerializer

from ckptsdk.errors import CkptError, ManifestError
from ckptsdk.format.document import (
    Document,
    Strict,
    UtcTime,
    decode_float,
    dumps,
    encode_float,
    parse_document,
)

__all__ = [
    "DATA_PREFIX",
    "RUNLOG_FORMAT",
    "RUNLOG_PREFIX",
    "AttemptRecord",
    "LogFloat",
    "StepRow",
    "attempt_prefix",
    "chunk_key",
    "digest_value",
    "parse_attempt_record",
    "iter_chunk",
    "parse_chunk",
    "parse_runlog_key",
]

RUNLOG_PREFIX = "runlog/"
#: 1.1: non-finite scalars as {"$float": ...} (1.0: "NaN"/"Infinity" strings, still read).
RUNLOG_FORMAT: Final = "ckptsdk.runlog/1.1"
#: Scalars under this prefix are data digests (:func:`digest_value`), compared exactly by the audit.
DATA_PREFIX: Final = "data/"
#: The longest line a reader parses: a header or a row is a few hundred bytes; a line longer than
#: this is damage (or an attack) and is skipped with a warning without being held in memory.
MAX_LINE_BYTES: Final = 1 << 20
_READ_PIECE = 1 << 16

_KEY_RE = re.compile(r"^runlog/attempt-(\d+)/(attempt\.json|chunk-(\d+)\.jsonl)$")
# How format 1.0 wrote non-finite scalars; read, never written.
_OLD_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def attempt_prefix(attempt: int) -> str:
    """The folder of one attempt's objects, e.g. ``runlog/attempt-000003/``."""
    return f"{RUNLOG_PREFIX}attempt-{attempt:06d}/"


def chunk_key(attempt: int, seq: int) -> str:
    """The key of one chunk, e.g. ``runlog/attempt-000003/chunk-000012.jsonl``."""
    return f"{attempt_prefix(attempt)}chunk-{seq:06d}.jsonl"


def parse_runlog_key(key: str) -> tuple[int, int | None] | None:
    """(attempt, chunk sequence or None for ``attempt.json``) of a run log key, else None.

    Example:
        >>> parse_runlog_key(chunk_key(3, 12)), parse_runlog_key("runlog/attempt-000003/attempt.json")
        ((3, 12), (3, None))
    """
    m = _KEY_RE.match(key)
    if m is None:
        return None
    return int(m.group(1)), (int(m.group(3)) if m.group(3) is not None else None)


def _scalar_in(value: Any) -> float:
    # As stored: a number, {"$float": ...}, or format 1.0's "NaN"/"Infinity" strings. A boolean
    # or any other string is refused (decode_float's ValueError).
    if isinstance(value, str) and value in _OLD_NONFINITE:
        return _OLD_NONFINITE[value]
    return decode_float(value)


#: A float as the run log and the audit store it: strict JSON, non-finite values tagged by
#: ``document.encode_float``; reading also accepts format 1.0's "NaN"/"Infinity" strings.
LogFloat = Annotated[float, BeforeValidator(_scalar_in), PlainSerializer(encode_float, when_used="json")]


class AttemptRecord(Document):
    """Who ran one attempt, on what, from where, and how far it got.

    Written as ``attempt.json`` when the attempt first flushes, and repeated (with ``last_step``
    and ``closed`` up to date) as the header line of every chunk. No checksum: every object is
    written once with ``create`` and a damaged chunk is reported and skipped by the audit, which
    compares the steps themselves across attempts.
    """

    FORMAT: ClassVar[str] = RUNLOG_FORMAT

    format: str = Field(default=RUNLOG_FORMAT, pattern=r"^ckptsdk\.runlog/1(\.[0-9]+)?$")
    kind: str = Field(default="attempt", pattern="^attempt$")
    attempt: int
    run_id: str
    lease_epoch: int | None = None
    host: str
    pid: int
    device: str
    versions: dict[str, str] = Field(default_factory=dict)
    started_at: UtcTime
    resumed_from_step: int | None = None
    last_step: int | None = None
    steps_logged: int = 0
    chunk: int | None = None
    closed: bool = False


class StepRow(Strict):
    """One logged step, a line of a chunk after its header (versioned by that header)."""

    step: int = Field(ge=0)
    time: float = Field(description="the logging host's wall clock, seconds since the epoch")
    scalars: dict[str, LogFloat]

    def to_line(self) -> str:
        """The row as one line of strict JSON (no newline)."""
        return dumps(self.model_dump(mode="json")).decode().rstrip("\n")


def digest_value(text: str) -> float:
    """A data digest as a run log scalar: 53 bits of its blake2b, an integer a float holds exactly.

    Example:
        >>> v = digest_value("0:3:9f2c"); v == int(v) and 0 <= v < 2**53 and v == digest_value("0:3:9f2c")
        True
    """
    return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 11)


def _parse_error(message: str, step: int | None) -> CkptError:
    return ManifestError(message, step=step)


def parse_attempt_record(data: bytes | str, *, key: str = "") -> AttemptRecord:
    """An ``attempt.json`` or chunk header line, read by the version rule (``ckptsdk.format.document``).

    Raises:
        ManifestError: not JSON, not a run log record, a newer major version (upgrade ckptsdk),
            or invalid fields.
    """
    return parse_document(data, AttemptRecord, key=key, error=_parse_error)


def parse_chunk(data: bytes, *, key: str = "") -> tuple[AttemptRecord, list[StepRow]]:
    """A chunk's header and step rows, as :class:`RunLog` wrote them (format 1.0 or 1.1).

    Raises:
        ManifestError: an empty chunk, a bad header, or a line that is not a step row (says which).

    Example:
        >>> header = AttemptRecord(attempt=1, run_id="r", host="h", pid=1, device="cpu",
        ...                        started_at="2026-11-30T06:10:00.123Z")
        >>> row = StepRow(step=5, time=1.0, scalars={"loss": float("nan")})
        >>> line = header.to_json().decode() + row.to_line()
        >>> line.endswith('"scalars":{"loss":{"$float":"nan"}}}')
        True
        >>> parse_chunk(line.encode())[1][0].step
        5
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{key}: not UTF-8 text ({exc})", key=key or None) from exc
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ManifestError(f"{key}: empty chunk", key=key or None)
    header = parse_attempt_record(lines[0], key=key)
    rows = []
    for n, line in enumerate(lines[1:], start=2):
        try:
            rows.append(StepRow.model_validate_json(line, strict=True))
        # pydantic's ValidationError is a ValueError; a 400-digit number cannot be a float.
        except (ValueError, OverflowError, RecursionError, TypeError) as exc:
            raise ManifestError(
                f"{key}: line {n} is not a step record ({str(exc).splitlines()[0]})", key=key or None
            ) from exc
    return header, rows


def _lines(stream: IO[bytes], max_line: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of a byte stream, read in pieces; a line over ``max_line`` bytes is
    yielded as None and never held whole (its bytes are dropped as they are read)."""
    n = 0
    carry = b""  # the unfinished line from earlier pieces (at most max_line bytes)
    too_long = False
    while piece := stream.read(_READ_PIECE):
        start = 0
        while (cut := piece.find(b"\n", start)) >= 0:
            n += 1
            if too_long or len(carry) + cut - start > max_line:
                yield n, None
            else:
                yield n, carry + piece[start:cut]
            carry, too_long, start = b"", False, cut + 1
        if not too_long:
            carry += piece[start:]
            if len(carry) > max_line:
                carry, too_long = b"", True
    if carry or too_long:
        yield n + 1, (None if too_long else carry)


def iter_chunk(
    stream: IO[bytes], *, key: str = "", max_line: int = MAX_LINE_BYTES
) -> Iterator[AttemptRecord | StepRow | str]:
    """A chunk read line by line: its header, then each step row, in bounded memory.

    A line that is not a step row (or is longer than ``max_line`` bytes) is yielded as a
    warning string saying which line and why, and reading goes on: one damaged line loses
    that line only.

    Raises:
        ManifestError: the chunk is empty or its first line is not an attempt record.

    Example:
        >>> import io
        >>> header = AttemptRecord(attempt=1, run_id="r", host="h", pid=1, device="cpu",
        ...                        started_at="2026-11-30T06:10:00.123Z")
        >>> rows = [StepRow(step=s, time=1.0, scalars={"loss": 0.5}).to_line() for s in (1, 2)]
        >>> data = "\\n".join([header.to_json().decode().strip(), rows[0], "x" * 500, rows[1]])
        >>> [type(x).__name__ for x in iter_chunk(io.BytesIO(data.encode()), max_line=400)]
        ['AttemptRecord', 'StepRow', 'str', 'StepRow']
    """
    header_seen = False
    for n, line in _lines(stream, max_line):
        if line is not None and not line.strip():
            continue
        if not header_seen:
            if line is None:
                raise ManifestError(f"{key}: the header line is longer than {max_line} bytes", key=key or None)
            header_seen = True
            yield parse_attempt_record(line, key=key)
            continue
        if line is None:
            yield f"{key}: line {n} is longer than {max_line} bytes; skipped unread"
            continue
        try:
            yield StepRow.model_validate_json(line, strict=True)
        except (ValueError, OverflowError, RecursionError, TypeError) as exc:
            yield f"{key}: line {n} is not a step record ({str(exc).splitlines()[0][:200]}); skipped"
    if not header_seen:
        raise ManifestError(f"{key}: empty chunk", key=key or None)
