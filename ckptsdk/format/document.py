"""The one rule every JSON document ckptsdk writes follows: model, version, time, floats, checksum.

Each document (manifest, lineage record, lease, run log, audit report, data-cache entry, trash
ledger, distributed metadata) is a ``Document`` subclass naming its ``FORMAT``
(``"ckptsdk.<kind>/<major>.<minor>"``) and is read with ``parse_document``. What a document holds
belongs in its own module; only what they all share is here.

The version rule, checked before anything else in the document:
  * a minor version only adds what an older reader of its major version may ignore (it reads
    the document right); anything an older reader would misread is a new major version;
  * the same major version is read; a newer minor version's unknown fields are ignored;
  * a newer major version is refused with "upgrade ckptsdk" (``NewerFormatError`` where the
    caller names no error of its own); every major version keeps the ``checksum`` rule, so a
    newer one whose checksum fails is damage, not newer (one flipped bit turns "1" into "9");
  * an older major version is refused with what to do, unless the kind still reads it
    (``ALSO_READS``: a kind may write an older major version when the document needs nothing
    newer, so that older readers keep reading it);
  * a document whose ``CHECKSUM_SINCE`` minor is reached (or of a later major version) carries a
    ``checksum`` field (sha256 of its canonical JSON), verified before any other field is looked at.
Times are UTC ISO-8601 strings with microseconds and a ``Z`` (``utc_now``). A float that strict
JSON cannot hold (nan, inf, -0.0) is written ``{"$float": "nan"}`` (``encode_float``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import struct
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from ckptsdk.errors import CkptError, ManifestError, NewerFormatError

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKSUM_FIELD",
    "DEFAULT_MAX_BYTES",
    "FINITE_JSON",
    "FLOAT_FORM",
    "Document",
    "Strict",
    "UtcTime",
    "check_format",
    "check_utc",
    "decode_float",
    "dumps",
    "encode_float",
    "parse_document",
    "parse_utc",
    "seal",
    "utc_now",
]

#: The field holding ``"sha256:<hex>"`` of the document's canonical JSON without that field.
CHECKSUM_FIELD = "checksum"
_FORMAT_RE = re.compile(r"(?P<kind>[a-z0-9_.]+)/(?P<major>[0-9]+)(?:\.(?P<minor>[0-9]+))?")

# --- time ------------------------------------------------------------------------------------

_UTC_TIME = (
    r"^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:"
    r"[0-5][0-9](\.[0-9]{1,6})?(Z|\+00:00)$"
)


def utc_now() -> str:
    """The current time as ISO-8601 UTC with microseconds, the one form every document uses.

    Example:
        >>> utc_now().endswith("Z") and len(utc_now()) == len("2026-11-30T06:10:00.123456Z")
        True
    """
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def check_utc(value: str) -> str:
    """``value`` if it is a UTC ISO-8601 time (``Z`` or ``+00:00``), else ValueError saying why."""
    if not isinstance(value, str) or not re.fullmatch(_UTC_TIME, value):
        raise ValueError(
            f"{value!r} is not in UTC ISO-8601 form like 2026-11-30T06:10:00.123456Z (it must end with 'Z' or '+00:00')"
        )
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:  # Feb 30 and the like: the pattern alone cannot tell
        raise ValueError(f"{value!r} is not a valid date and time") from exc
    return value


#: A field holding a UTC time, checked by ``check_utc`` (the JSON Schema states the pattern).
UtcTime = Annotated[
    str,
    AfterValidator(check_utc),
    Field(description="UTC, ISO-8601: 2026-11-30T06:10:00.123456Z", json_schema_extra={"pattern": _UTC_TIME}),
]


def parse_utc(value: str) -> datetime:
    """An aware UTC ``datetime`` from a time any ckptsdk version wrote (``Z``, ``+00:00``, ms or µs).

    Example:
        >>> parse_utc("2026-11-30T06:10:00.5Z").isoformat()
        '2026-11-30T06:10:00.500000+00:00'
    """
    dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        raise ValueError(f"{value!r} has no time zone; ckptsdk writes UTC times ending in 'Z'")
    return dt.astimezone(UTC)


# --- floats ----------------------------------------------------------------------------------

_CANONICAL_NAN_BITS = struct.unpack("<Q", struct.pack("<d", float("nan")))[0]
#: What ``{"$float": ...}`` holds: see ``encode_float``.
FLOAT_FORM = r"^(nan|inf|-inf|-0\.0|[0-9a-f]{16})$"


def encode_float(x: float) -> float | dict[str, str]:
    """A float as a JSON value that strict JSON can hold: itself, or ``{"$float": ...}``.

    nan, inf, -inf and -0.0 are tagged (``"nan"``, ``"inf"``, ``"-inf"``, ``"-0.0"``); a nan with
    another sign or payload is tagged with its 64-bit pattern as 16 hex digits.

    Example:
        >>> encode_float(0.5), encode_float(float("inf"))
        (0.5, {'$float': 'inf'})
    """
    if math.isfinite(x):
        if x == 0.0 and math.copysign(1.0, x) < 0:
            return {"$float": "-0.0"}
        return x
    if math.isinf(x):
        return {"$float": "inf" if x > 0 else "-inf"}
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    return {"$float": "nan" if bits == _CANONICAL_NAN_BITS else f"{bits:016x}"}


def decode_float(value: object) -> float:
    """The inverse of ``encode_float`` (accepts a JSON number or a ``{"$float": ...}`` object).

    Raises:
        ValueError: not a float encoding.

    Example:
        >>> decode_float({"$float": "-inf"}), decode_float(3)
        (-inf, 3.0)
    """
    if isinstance(value, dict):
        if set(value) != {"$float"} or not isinstance(value["$float"], str):
            raise ValueError(f"not a float encoding: {value!r}")
        text = value["$float"]
        named = {"nan": float("nan"), "inf": math.inf, "-inf": -math.inf, "-0.0": -0.0}
        if text in named:
            return named[text]
        if re.fullmatch(r"[0-9a-f]{16}", text):
            result: float = struct.unpack("<d", struct.pack("<Q", int(text, 16)))[0]
            if not math.isnan(result):
                raise ValueError(f"bit pattern {text} is not a nan; write the number itself")
            return result
        raise ValueError(f"unknown float encoding {text!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"not a float: {value!r}")


# --- version ---------------------------------------------------------------------------------


class _Newer(ValueError):
    """``check_format``'s refusal of a newer major version (``parse_document`` raises ``NewerFormatError``)."""


def _versions(formats: Sequence[str]) -> tuple[str, dict[int, int]]:
    """(the kind, the newest minor known of each major version) of ``formats``."""
    known: dict[int, int] = {}
    kind = ""
    for text in formats:
        match = _FORMAT_RE.fullmatch(text)
        assert match is not None, text
        kind = match["kind"]
        major = int(match["major"])
        known[major] = max(known.get(major, 0), int(match["minor"] or 0))
    return kind, known


def check_format(value: object, expected: str, *, also: Sequence[str] = ()) -> int:
    """The minor version of ``value`` if the version rule lets this ckptsdk read it.

    Args:
        value: the document's ``format`` field.
        expected: what this ckptsdk writes, ``"ckptsdk.<kind>/<major>.<minor>"``.
        also: the older versions of the kind it reads too (another major version, its newest minor).

    Raises:
        ValueError: another kind, or a major version neither ``expected``'s nor one of ``also``'s;
            says what to do.

    Example:
        >>> check_format("ckptsdk.lease/1.4", "ckptsdk.lease/1.0")
        4
        >>> check_format("ckptsdk.checkpoint/1.3", "ckptsdk.checkpoint/2.0", also=["ckptsdk.checkpoint/1.3"])
        3
    """
    kind, known = _versions([expected, *also])
    if not isinstance(value, str):
        raise ValueError(f"'format' must be a string like {expected!r}, got {value!r}")
    match = _FORMAT_RE.fullmatch(value)
    if match is None or match["kind"] != kind:
        raise ValueError(f"format {value!r} is not a {kind} document (expected {expected!r})")
    major = int(match["major"])
    if major > max(known):
        raise _Newer(
            f"format {value!r} was written by a newer ckptsdk (this one reads "
            f"{kind}/{max(known)}.x); upgrade ckptsdk to read it"
        )
    if major not in known:
        raise ValueError(
            f"format {value!r} is an older major version this ckptsdk cannot read; "
            f"read it with the ckptsdk that wrote it, or start this part afresh"
        )
    return int(match["minor"] or 0)


class Strict(BaseModel):
    """Frozen, strict, unknown fields refused (except a newer minor version's): documents and their parts."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_newer_fields(cls, data: Any, info: ValidationInfo) -> Any:
        # A newer minor version may add fields; only then are unknown ones ignored.
        if isinstance(data, dict) and (info.context or {}).get("lenient"):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                logger.debug("ignoring fields of a newer format minor version: %s", unknown)
                data = {k: v for k, v in data.items() if k in cls.model_fields}
        return data


#: ``Document.MAX_BYTES`` unless a kind sets its own: far above any document ckptsdk writes
#: (kilobytes), far below what would take seconds or hundreds of MiB to parse.
DEFAULT_MAX_BYTES = 16 << 20


class Document(Strict):
    """Base of every JSON document ckptsdk writes.

    A subclass sets ``FORMAT`` (what it writes) and, if it is sealed, ``CHECKSUM_SINCE`` (the
    first minor version that always carries a checksum). Write it with ``to_json()``, read it
    with ``parse_document``.
    """

    FORMAT: ClassVar[str] = ""
    #: Older versions of the kind this ckptsdk reads too (another major version, at its newest
    #: minor known); it may write one of them (``format_written``).
    ALSO_READS: ClassVar[tuple[str, ...]] = ()
    CHECKSUM_SINCE: ClassVar[int | None] = None
    #: The most bytes ``parse_document`` reads as this document; larger ones are refused before
    #: parsing (a padded or garbage file must cost a length check, not seconds and gigabytes).
    MAX_BYTES: ClassVar[int] = DEFAULT_MAX_BYTES

    @model_validator(mode="before")
    @classmethod
    def _format_first(cls, data: object) -> object:
        # The version rule for documents built or validated directly, not only parsed from bytes.
        if isinstance(data, dict) and "format" in data:
            check_format(data["format"], cls.FORMAT, also=cls.ALSO_READS)
        return data

    def format_written(self) -> str:
        """The version ``to_json`` writes: ``FORMAT``, unless a kind writes an older one when its
        content needs nothing newer (one of ``ALSO_READS``)."""
        return self.FORMAT

    def to_json(self) -> bytes:
        """Strict JSON (no NaN tokens), UTF-8, one line ending in a newline, as the current format.

        A parsed older or newer minor version is re-written as this one; sealed documents get
        their checksum.

        Raises:
            ManifestError: the document is larger than ``MAX_BYTES`` (no reader would parse it).
        """
        body = {**self._json_body(), "format": self.format_written()}
        data = seal(body) if self.CHECKSUM_SINCE is not None else dumps(body)
        if len(data) > self.MAX_BYTES:  # what parse_document refuses is never written
            raise ManifestError(
                f"a {self.FORMAT} document of {len(data)} bytes is not written: every reader refuses more than "
                f"{self.MAX_BYTES} (limits.py says what a save may hold)"
            )
        return data

    def _json_body(self) -> dict[str, Any]:
        """The fields as JSON values, in declared order (a kind may skip pydantic's walk of one)."""
        return self.model_dump(mode="json")


def dumps(obj: object) -> bytes:
    """``obj`` as one line of strict JSON (no NaN/Infinity tokens), UTF-8, ending in a newline."""
    return (json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")


def _checksum(body: dict[str, Any]) -> str:
    # Canonical form: sorted keys, no spaces, ASCII escapes, Python's shortest float repr. It is
    # computed from the parsed value, so it does not depend on how the bytes were laid out, and
    # json.loads/dumps round-trips every value a model dumps (ints of any size, floats exactly).
    canonical = json.dumps(body, allow_nan=False, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def seal(doc: dict[str, Any]) -> bytes:
    """``doc`` as strict JSON with its ``checksum`` field (re)computed (for writers and tests).

    Example:
        >>> b'"checksum":"sha256:' in seal({"format": "ckptsdk.lineage/1.1", "epoch": 1})
        True
    """
    body = {k: v for k, v in doc.items() if k != CHECKSUM_FIELD}
    return dumps({**body, CHECKSUM_FIELD: _checksum(body)})


def _check_checksum(obj: dict[str, Any], minor: int, since: int, expected: str, where: str) -> str | None:
    """Pop and verify ``obj``'s checksum; return why it fails, or None."""
    given = obj.pop(CHECKSUM_FIELD, None)
    if minor < since:
        if given is not None:
            # An older writer never wrote one: the format field itself was altered (one bit turns
            # "1.1" into "1.0"), so nothing in this document can be trusted.
            return (
                f"it says format {obj.get('format')!r}, which has no checksum, but carries "
                "one: the document was altered"
            )
        logger.warning(
            "%s is a %s document from before checksums (format %r): its content "
            "cannot be verified; re-save it with this ckptsdk",
            where.rstrip(": ") or "a document",
            expected,
            obj.get("format"),
        )
        return None
    if given is None:
        return f"no {CHECKSUM_FIELD!r} field, which every {expected.split('.')[0]}.{since}+ document has"
    if not isinstance(given, str) or not given.startswith("sha256:"):
        return f"{CHECKSUM_FIELD!r} is {given!r}, not 'sha256:<hex>'"
    try:
        actual = _checksum(obj)
    except (ValueError, RecursionError) as exc:
        return f"its content cannot be put in canonical form ({exc})"
    if actual != given:
        return f"its checksum is {given} but its content hashes to {actual}"
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON token {name}")


def _finite_float(text: str) -> float:
    # With NaN/Infinity tokens refused (above), an overflowing literal (1e999) is the only way to
    # an inf: refused too, so a parsed document holds finite floats only (FINITE_JSON).
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of a float's range (JSON has no inf)")
    return value


#: The validation context's key set when the object comes straight from :func:`parse_document`'s
#: JSON parse, which admits finite floats only: validators may then skip a walk that looks for nan/inf.
FINITE_JSON = "finite_json"


D = TypeVar("D", bound=Document)


def parse_document(
    data: bytes | bytearray | memoryview | str,
    model: type[D],
    *,
    key: str = "",
    url: str | None = None,
    error: Callable[[str, int | None], CkptError] | None = None,
    damaged: str = "it is not used",
    legacy: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> D:
    """Parse and validate one JSON document by the version rule (module docstring).

    Args:
        data: the document's bytes (or str).
        model: its ``Document`` subclass.
        key: where it was read, for messages.
        url: the root's URL, prefixed to ``key`` in messages when given.
        error: builds the error to raise from (message, step or None); by default a
            ``ManifestError`` carrying ``key`` and ``step``.
        damaged: what the caller does with a document whose checksum fails, for the message.
        legacy: given the decoded object, returns it in the current form if it is one the
            previous ckptsdk wrote before this document had its ``format`` (else None); it is
            then read as that.

    Raises:
        NewerFormatError: a newer major version (without ``error``; with it, what it builds).
        ManifestError (or what ``error`` builds): larger than ``model.MAX_BYTES`` (checked before
            parsing), not JSON, not an object, no or a foreign or unreadable ``format``, a
            checksum that does not hold, or invalid fields; says which.

    Example:
        >>> class Note(Document):
        ...     FORMAT = "ckptsdk.note/1.0"
        ...     format: str = FORMAT
        ...     text: str
        >>> parse_document(Note(text="hi").to_json(), Note).text
        'hi'
    """
    expected = model.FORMAT
    newer_error: Callable[[str, int | None], CkptError] | None = None
    if error is None:

        def error(message: str, step: int | None) -> CkptError:
            return ManifestError(message, key=key or None, step=step)

        def newer_error(message: str, step: int | None) -> CkptError:
            return NewerFormatError(message, key=key or None, step=step)

    place = f"{url.rstrip('/')}/{key}" if url and key else key
    where = f"{place}: " if place else ""
    if not isinstance(data, (bytes, bytearray, memoryview, str)):
        raise error(f"{where}expected bytes, got {type(data).__name__}", None)
    size = memoryview(data).nbytes if not isinstance(data, str) else len(data)  # str: chars <= bytes, bounded
    if size > model.MAX_BYTES:
        raise error(
            f"{where}{size} bytes, more than the {model.MAX_BYTES} a {expected} document may have (they are "
            f"kilobytes); not parsed: the file is padded, garbage or not a {expected} document",
            None,
        )
    try:
        obj = json.loads(
            bytes(data) if not isinstance(data, str) else data,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise error(f"{where}not valid JSON ({exc}); the file is torn or is not a {expected} document", None) from exc
    if not isinstance(obj, dict):
        raise error(f"{where}expected a JSON object, got {type(obj).__name__}", None)
    if legacy is not None:
        obj = legacy(obj) or obj
    step = obj.get("step") if type(obj.get("step")) is int else None
    if "format" not in obj:
        raise error(f"{where}no 'format' field; not a {expected} document", step)
    try:
        minor = check_format(obj["format"], expected, also=model.ALSO_READS)  # first: newer majors may differ in all
    except _Newer as exc:
        # Every major version keeps the checksum rule, so that a newer document (which a reader
        # must not skip as damage) can be told from a damaged one: "1" -> "9" is one bit.
        forged = None if model.CHECKSUM_SINCE is None else _check_checksum(dict(obj), 1, 0, expected, where)
        if forged is not None:
            raise error(
                f"{where}{exc}, but its checksum does not hold ({forged}): the file was damaged or edited; {damaged}",
                step,
            ) from exc
        if newer_error is not None:
            raise newer_error(f"{where}{exc}", step) from exc
        raise error(f"{where}{exc}", step) from exc
    except ValueError as exc:
        raise error(f"{where}{exc}", step) from exc
    _kind, known = _versions([expected, *model.ALSO_READS])
    read = _FORMAT_RE.fullmatch(obj["format"])
    assert read is not None  # check_format matched it
    major = int(read["major"])
    if model.CHECKSUM_SINCE is not None:
        # Second: nothing else in the document is looked at before its checksum holds. Every
        # major version after the oldest one read carries one from its first minor on.
        since = model.CHECKSUM_SINCE if major == min(known) else 0
        problem = _check_checksum(obj, minor, since, expected, where)
        if problem is not None:
            raise error(f"{where}integrity check failed: {problem}. The file was damaged or edited; {damaged}", step)
    try:
        context = {"lenient": minor > known[major], FINITE_JSON: legacy is None}
        return model.model_validate(obj, strict=True, context=context)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()]
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise error(f"{where}invalid {expected} document: {listed}", step) from exc
