"""``LEASE.json``, the writer lease's one document: its model, how it is read, where it lives.

Taking, renewing and fencing the lease belong to ``ckptsdk.lease.acquire`` (and ``.renewal``); this
module only says what the record holds (and the writer tag its nonce gives) and reads it, so
read-only tools (``catalog``, the CLI) need nothing else.
"""

from __future__ import annotations

import json
from typing import ClassVar, Final

from pydantic import Field

from ckptsdk.backends.base import Backend
from ckptsdk.errors import CkptError, LeaseError, ObjectNotFound
from ckptsdk.format.document import Document, Strict, UtcTime, parse_document

# The writer tag is a function of the lease nonce; its one home is the root's layout, which the
# folder and lineage names it appears in are parsed by. Imported here for the lease's users.
from ckptsdk.format.layout import TAG_DIGITS, writer_tag
from ckptsdk.lease.identity import Liveness, judge_holder

__all__ = [
    "LEASE_FORMAT",
    "LEASE_KEY",
    "MAX_TTL",
    "TAG_DIGITS",
    "LeaseHolder",
    "LeaseRecord",
    "best_effort_epoch",
    "parse_lease",
    "read_lease",
    "writer_tag",
]

#: Where the lease lives, relative to the checkpoint root (the one definition).
LEASE_KEY: Final = "LEASE.json"
#: What this ckptsdk writes. 1.1 adds the holder's process identity (boot id, pid namespace, start
#: time), which a reader of 1.0 ignores by the version rule (ckptsdk since 2026-12-01); a ckptsdk
#: older than that compared the exact string "ckptsdk.lease/1" and refuses the record loudly
#: (its writer fences itself, its newcomer asks for force=True): never a silent takeover.
LEASE_FORMAT: Final = "ckptsdk.lease/1.1"
#: The longest ttl (and settle) a lease may have, ours or one read from LEASE.json: a newcomer
#: waits up to five ttl windows, so this bounds every wait (an infinite ttl would be forever).
MAX_TTL: Final = 3600.0
_BREAK_HINT = (
    "if no writer is running, break it with lease_options=LeaseOptions(force=True) or "
    "`ckptsdk lease URL --break --yes-i-am-sure`"
)


class LeaseHolder(Strict):
    """Who holds the lease: host, process, and a nonce unique to one acquisition.

    ``boot_id`` (``/proc/sys/kernel/random/boot_id``), ``pid_ns`` (``/proc/self/ns/pid``) and
    ``start_time`` (``/proc/PID/stat``, clock ticks after boot) let a newcomer on the same host,
    boot and pid namespace tell at once whether this very process still runs
    (``ckptsdk.lease.identity``); None where unknown, and in records of format 1.0.
    """

    host: str
    pid: int
    nonce: str = Field(min_length=1)
    boot_id: str | None = None
    pid_ns: str | None = None
    start_time: int | None = None

    def liveness(self) -> tuple[Liveness, str]:
        """Whether this holder's process is alive, dead, or not checkable from here (and why)."""
        return judge_holder(self.host, self.pid, self.boot_id, self.pid_ns, self.start_time)


class LeaseRecord(Document):
    """The content of ``LEASE.json``.

    ``epoch`` is the fencing token (+1 at every takeover); ``attempt`` counts acquisitions of the
    run (+1 each time); ``renewals`` changes at every renewal, which is what observers watch.
    ``acquired_at``/``renewed_at`` are the holder's wall clock (UTC), for humans only: never
    compared with another machine's clock. ``released`` marks a clean ``release()``: the next
    writer takes over at once, keeping the epoch sequence and the run id.

    No checksum: the record is only ever replaced by a conditional write (compare-and-swap on
    local disk and GCS), a torn or damaged one fails to parse and is treated as unreadable (a
    writer fences itself, a newcomer refuses it), and every copy is rewritten within ttl/3. A
    checksum would also make an old ckptsdk on another VM refuse every record we write.

    Example:
        >>> rec = LeaseRecord(run_id="r", attempt=1, epoch=1, renewals=0, ttl=60.0, settle=0.0,
        ...                   holder=LeaseHolder(host="vm", pid=1, nonce="n"),
        ...                   acquired_at="2026-11-30T06:10:00.123Z", renewed_at="2026-11-30T06:10:00.123Z")
        >>> parse_lease(rec.to_json()) == rec
        True
    """

    FORMAT: ClassVar[str] = LEASE_FORMAT
    MAX_BYTES: ClassVar[int] = 1 << 20  # a few hundred bytes are written; a bigger file is not a lease

    format: str = Field(default=LEASE_FORMAT, pattern=r"^ckptsdk\.lease/1(\.[0-9]+)?$")
    run_id: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    epoch: int = Field(ge=1)
    holder: LeaseHolder
    renewals: int = Field(ge=0)
    ttl: float = Field(gt=0, le=MAX_TTL)
    settle: float = Field(ge=0, le=MAX_TTL)
    acquired_at: UtcTime
    renewed_at: UtcTime
    released: bool = False

    def describe(self) -> str:
        """One human line: who holds it, which run and epoch, since when (by its own clock)."""
        return (
            f"host {self.holder.host!r} pid {self.holder.pid} (run {self.run_id}, epoch "
            f"{self.epoch}, attempt {self.attempt}, acquired {self.acquired_at} by its clock, "
            f"{self.renewals} renewals{', released' if self.released else ''})"
        )


def parse_lease(data: bytes, *, url: str = "") -> LeaseRecord:
    """Parse ``LEASE.json`` bytes by the version rule (``ckptsdk.format.document``), ``format`` first.

    Args:
        data: the raw object.
        url: the checkpoint root, for the error message.

    Returns:
        The record.

    Raises:
        LeaseError: not JSON, another kind or a newer major version (upgrade ckptsdk), or
            invalid fields; says how to break it.
    """

    def error(message: str, step: int | None) -> CkptError:
        return LeaseError(f"{message}; {_BREAK_HINT}", url=url)

    return parse_document(data, LeaseRecord, key=LEASE_KEY, url=url or None, error=error)


def read_lease(backend: Backend) -> LeaseRecord | None:
    """Return the lease record at the root of ``backend``, or None if there is none.

    Read-only: for ``ls``/``show``/``lease`` commands and tests. Raises ``LeaseError`` for an
    unreadable record (see :func:`parse_lease`).

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> read_lease(open_backend("memory://no-lease-here")) is None
        True
    """
    try:
        data = backend.read(LEASE_KEY)
    except ObjectNotFound:
        return None
    return parse_lease(data, url=backend.url)


def best_effort_epoch(data: bytes) -> int:
    """The ``epoch`` of an unreadable record if one can be found, else 0 (for force=True).

    Example:
        >>> best_effort_epoch(b'{"format": "ckptsdk.lease/9", "epoch": 4}'), best_effort_epoch(b"junk")
        (4, 0)
    """
    try:
        value = json.loads(data).get("epoch")
    except (ValueError, AttributeError, RecursionError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0
