"""The data cache's records and digest rule: what a cached artifact's meta and sidecar hold.

``CacheEntry`` is the one document (meta object and local sidecar), ``pinned_digest`` the rule for
digests a caller supplies, ``Fetched`` what ``DataCache.fetch`` returns. Copying, downloading and
verifying bytes belong to ``ckptsdk.data.cache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, JsonValue

from ckptsdk.errors import CkptError, ConfigError, DataError
from ckptsdk.format.digest import ALGORITHMS, DEFAULT, new_hasher
from ckptsdk.format.document import Document, parse_document

__all__ = [
    "CACHE_FORMAT",
    "RECORD_FORMAT",
    "CacheEntry",
    "DataRecord",
    "Fetched",
    "file_digest",
    "parse_entry",
    "parse_record",
    "pinned_digest",
]

_CHUNK = 8 << 20
#: 1.0: the first string format; before it, meta objects said ``"format": 1`` (an int, still read)
#: and local sidecars had no format at all (still read).
CACHE_FORMAT = "ckptsdk.datacache/1.0"
#: A caller's record (``DataCache.record_once``); before 1.0 the caller's dict was stored bare (still read).
RECORD_FORMAT = "ckptsdk.datarecord/1.0"


def file_digest(path: str, algorithm: str = DEFAULT) -> str:
    """Hex digest of the file at ``path`` with ``algorithm`` (a key of ``digest.ALGORITHMS``)."""
    h = new_hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def pinned_digest(digest: str, algorithm: str | None = None) -> tuple[str, str]:
    """(algorithm, hex) of a digest a caller supplies: it must say its algorithm.

    The rule: a digest ckptsdk computes uses ``digest.DEFAULT`` (xxh3-128) unless the caller
    names another algorithm; a digest the caller supplies names its algorithm, as
    ``"sha256:<hex>"`` or with ``algorithm=`` (a bare hex string could be md5 or xxh3-128 alike).

    Raises:
        ConfigError: no algorithm said, two that disagree, or one ckptsdk does not know.

    Example:
        >>> pinned_digest("md5:c9a34cfc85d982698c6ac89f76071abd"), pinned_digest("ab12", "sha256")
        (('md5', 'c9a34cfc85d982698c6ac89f76071abd'), ('sha256', 'ab12'))
    """
    named, sep, hexpart = digest.partition(":")
    if not sep:
        if algorithm is None:
            raise ConfigError(
                f"digest {digest!r} does not say its algorithm: write it as 'sha256:{digest}' (or "
                f"{', '.join(repr(a + ':...') for a in ALGORITHMS if a != 'sha256')}), or pass algorithm="
            )
        named, hexpart = algorithm, digest
    elif algorithm is not None and algorithm != named:
        raise ConfigError(
            f"digest {digest!r} is a {named} digest but algorithm={algorithm!r} was passed too; drop one of them"
        )
    new_hasher(named)  # an unknown algorithm: ConfigError listing the known ones
    return named, hexpart


class CacheEntry(Document):
    """What the cache says about one artifact: its ``meta`` object (written after the blob
    verified, so it is the commit marker) and the local sidecar next to a verified copy.

    No checksum: a damaged record can only make a copy fail verification, and then the artifact
    is fetched again and the record rewritten; it never makes wrong bytes pass.
    """

    FORMAT: ClassVar[str] = CACHE_FORMAT

    format: str = Field(default=CACHE_FORMAT, pattern=r"^ckptsdk\.datacache/1(\.[0-9]+)?$")
    name: str
    size: int = Field(ge=0)
    algorithm: str
    digest: str
    source: str
    #: seconds since the epoch (this host's clock) when the blob was stored; None in local
    #: sidecars written before format 1.0.
    stored_at: float | None = None


def parse_entry(data: bytes, key: str) -> CacheEntry:
    """A meta object or sidecar, by the version rule; the two older unversioned forms too."""

    def legacy(obj: dict[str, Any]) -> dict[str, Any] | None:
        # Before format 1.0: meta said "format": 1 (an int), sidecars said nothing. Same fields.
        if obj.get("format") == 1 or ("format" not in obj and "digest" in obj):
            return {**obj, "format": CACHE_FORMAT}
        return None

    return parse_document(data, CacheEntry, key=key, error=_data_error, legacy=legacy)


def _data_error(message: str, step: int | None) -> CkptError:
    return DataError(message)


class DataRecord(Document):
    """A caller's JSON record kept once in the cache (a dataset's tensor hash, trusted on first use).

    No checksum: the caller compares what it finds against what it computes and says so loudly
    when they differ, which is the check that matters.
    """

    FORMAT: ClassVar[str] = RECORD_FORMAT

    format: str = Field(default=RECORD_FORMAT, pattern=r"^ckptsdk\.datarecord/1(\.[0-9]+)?$")
    record: dict[str, JsonValue]


def parse_record(data: bytes, key: str) -> dict[str, JsonValue]:
    """The caller's record from a stored one, by the version rule; a bare pre-1.0 dict too."""

    def legacy(obj: dict[str, Any]) -> dict[str, Any] | None:
        # Before 1.0 the caller's dict was stored itself (and may hold a "format" of its own).
        fmt = obj.get("format")
        return (
            None
            if isinstance(fmt, str) and fmt.startswith("ckptsdk.datarecord/")
            else {"format": RECORD_FORMAT, "record": obj}
        )

    def error(message: str, step: int | None) -> CkptError:
        return DataError(f"{message}; delete {key!r} from the cache to record it again")

    return parse_document(data, DataRecord, key=key, error=error, legacy=legacy).record


@dataclass(frozen=True)
class Fetched:
    """Where a fetched artifact came from and where it now is.

    Attributes:
        name: the artifact name.
        path: the verified local file.
        source: ``"local"``, ``"cache"``, or the URL it was downloaded from.
        size: bytes.
        algorithm: digest algorithm used to verify it.
        digest: its hex digest.
        seconds: time from the call to a verified local file.
        failures: sources tried before this one and why each was passed over.
    """

    name: str
    path: str
    source: str
    size: int
    algorithm: str
    digest: str
    seconds: float
    failures: dict[str, str]
