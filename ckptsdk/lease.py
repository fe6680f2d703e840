"""The writer lease on a checkpoint root (``ROOT/LEASE.json``): one writer at a time, with fencing.

A newcomer judges a holder alive only by *seeing its record change* over a ttl window on its own
monotonic clock (VM clocks drift; the record's timestamps are for humans). Lineage (epochs in
manifests, orphans, what rotation may delete) belongs to the manager; storage to the backends.

Defaults, and why. Immediately consistent backends (local disk, GCS): ttl 60 s, settle 0; the
holder renews every ttl/3 (20 s), so a live holder changes its record twice or more per window
and a dead one is taken over ~60-65 s after its last renewal; conditional writes make every
takeover and renewal exact. Drive (``immediately_consistent=False``, no cross-VM
compare-and-swap): ttl 300 s, settle ttl/5 = 60 s. Other VMs see Drive changes "a few minutes"
late, and with jitter: the ttl must exceed the renewal period plus that jitter or a live holder
would look dead; the settle (write, wait, read back, confirm our nonce) must exceed the time for
a rival's write to reach us. Neither makes Drive safe by itself (nothing can): safety there comes
from lineage, and from the holder fencing itself when it could not renew for a whole ttl.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .backends.base import Backend
from .catalog import writer_tag
from .errors import (
    BackendError,
    ConfigError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    ObjectNotFound,
    PreconditionFailed,
)
from .waiting import SHOW_FROM_S, WaitNotice

logger = logging.getLogger(__name__)

__all__ = [
    "LEASE_KEY",
    "LEASE_FORMAT",
    "MAX_TTL",
    "LeaseHolder",
    "LeaseRecord",
    "Lease",
    "parse_lease",
    "read_lease",
]

LEASE_KEY = "LEASE.json"
LEASE_FORMAT: Final = "ckptsdk.lease/1"

DEFAULT_TTL = 60.0  # local disk, GCS: see the module docstring
DRIVE_TTL = 300.0  # backends whose changes reach other hosts late (Drive)
#: The longest ttl (and settle) a lease may have, ours or one read from LEASE.json: a newcomer
#: waits up to five ttl windows, so this bounds every wait (an infinite ttl would be forever).
MAX_TTL = 3600.0
_PHANTOM_TRIES = 3  # rounds where LEASE.json cannot be read nor created before we give up
_DRIVE_SETTLE_FRACTION = 0.2  # settle = ttl/5 on such backends
_WAIT_TTLS = 5.0  # wait_timeout=None: give up after 5 ttl windows of a holder that keeps renewing
_POLL_MIN, _POLL_MAX = 0.05, 5.0  # observation poll: ttl/10, clamped
_FORCE_TRIES = 5  # force=True insists this many times against concurrent writers
_SNAPSHOT_TRIES = 5  # stat/read/stat retries when the object keeps changing under us


class LeaseHolder(BaseModel):
    """Who holds the lease: host, process, and a nonce unique to one acquisition."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    pid: int
    nonce: str = Field(min_length=1)


class LeaseRecord(BaseModel):
    """The content of ``LEASE.json``.

    ``epoch`` is the fencing token (+1 at every takeover); ``attempt`` counts acquisitions of the
    run (+1 each time); ``renewals`` changes at every renewal, which is what observers watch.
    ``acquired_at``/``renewed_at`` are the holder's wall clock, for humans only: never compared
    with another machine's clock. ``released`` marks a clean ``release()``: the next writer takes
    over at once, keeping the epoch sequence and the run id.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["ckptsdk.lease/1"] = LEASE_FORMAT
    run_id: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    epoch: int = Field(ge=1)
    holder: LeaseHolder
    renewals: int = Field(ge=0)
    ttl: float = Field(gt=0, le=MAX_TTL)
    settle: float = Field(ge=0, le=MAX_TTL)
    acquired_at: str
    renewed_at: str
    released: bool = False

    def to_json(self) -> bytes:
        """The record as UTF-8 JSON bytes, as written to ``LEASE.json``."""
        return self.model_dump_json(indent=1).encode()

    def describe(self) -> str:
        """One human line: who holds it, which run and epoch, since when (by its own clock)."""
        return (
            f"host {self.holder.host!r} pid {self.holder.pid} (run {self.run_id}, epoch "
            f"{self.epoch}, attempt {self.attempt}, acquired {self.acquired_at} by its clock, "
            f"{self.renewals} renewals{', released' if self.released else ''})"
        )


def parse_lease(data: bytes, *, url: str = "") -> LeaseRecord:
    """Parse ``LEASE.json`` bytes, checking the ``format`` field first.

    Args:
        data: the raw object.
        url: the checkpoint root, for the error message.

    Returns:
        The record.

    Raises:
        LeaseError: not JSON, an unknown format version, or invalid fields.
    """
    where = f"{url.rstrip('/')}/{LEASE_KEY}" if url else LEASE_KEY
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise LeaseError(
            f"{where} is not JSON ({exc}); if no writer is running, break it with force=True or "
            "`ckptsdk lease URL --break --yes-i-am-sure`",
            url=url,
        ) from exc
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if fmt != LEASE_FORMAT:
        raise LeaseError(
            f"{where} has format {fmt!r}, this ckptsdk reads {LEASE_FORMAT!r}: it was written by "
            "another (newer?) version; upgrade ckptsdk, or break it with force=True or "
            "`ckptsdk lease URL --break --yes-i-am-sure`",
            url=url,
        )
    try:
        return LeaseRecord.model_validate(raw)
    except ValidationError as exc:
        raise LeaseError(
            f"{where} is not a valid lease record: {exc.errors()[0].get('msg')}; "
            "if no writer is running, break it with force=True or `ckptsdk lease URL --break --yes-i-am-sure`",
            url=url,
        ) from exc


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


def _wall() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _best_effort_epoch(data: bytes) -> int:
    """The ``epoch`` of an unreadable record if one can be found, else 0 (for force=True)."""
    try:
        value = json.loads(data).get("epoch")
    except (ValueError, AttributeError, RecursionError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


class Lease:
    """The writer lease of one checkpoint root.

    Args:
        backend: the checkpoint root's storage.
        ttl: seconds a record must stay unchanged before a newcomer takes over; the holder renews
            every ttl/3. None: 60 s on immediately consistent backends, 300 s on Drive.
        settle: seconds to wait before reading back our own write on backends without
            compare-and-swap. None: 0 when immediately consistent, else ttl/5.
        force: take over at once, without observing the holder (the user's explicit word).
        wait_timeout: seconds ``acquire`` waits for a live holder before ``LeaseHeldError``.
            None: five ttl windows (of the larger of ours and the holder's ttl).
        run_id: the run id to record. None: keep the previous record's, or a new uuid.
        clock: monotonic seconds; injected so tests drive time.
        sleep: sleeps for ``acquire``'s waits; injected with ``clock``.

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> lease = Lease(open_backend("memory://lease-doc"))
        >>> (lease.acquire().epoch, lease.attempt)
        (1, 1)
        >>> lease.release()
    """

    def __init__(
        self,
        backend: Backend,
        *,
        ttl: float | None = None,
        settle: float | None = None,
        force: bool = False,
        wait_timeout: float | None = None,
        run_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        caps = backend.capabilities
        if ttl is None:
            ttl = DEFAULT_TTL if caps.immediately_consistent else DRIVE_TTL
        if not 0 < ttl <= MAX_TTL:  # also refuses nan and inf
            raise ConfigError(f"lease ttl must be > 0 and <= {MAX_TTL:g} seconds, got {ttl!r}: "
                              "a newcomer waits up to five ttl for a silent holder")
        if settle is None:
            settle = 0.0 if caps.immediately_consistent else ttl * _DRIVE_SETTLE_FRACTION
        if not 0 <= settle <= MAX_TTL:
            raise ConfigError(f"lease settle must be >= 0 and <= {MAX_TTL:g} seconds, got {settle!r}")
        if wait_timeout is not None and wait_timeout < 0:
            raise ConfigError(f"lease wait_timeout must be >= 0 seconds, got {wait_timeout!r}")
        self.backend = backend
        self.url = backend.url
        self.ttl = float(ttl)
        self.settle = float(settle)
        self.force = force
        self.wait_timeout = wait_timeout
        self._given_run_id = run_id
        self._clock = clock
        self._sleep = sleep
        self._cas = caps.compare_and_swap
        self._lock = threading.RLock()
        self._record: LeaseRecord | None = None
        self._version: str | None = None
        self._last_renewed = 0.0  # our clock at the last confirmed write of our record
        self._fenced = False
        self._fence_reason = ""
        self._newer_epoch: int | None = None
        self._newer_holder: dict[str, Any] | None = None
        self._released = False
        self._previous: LeaseRecord | None = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ state
    @property
    def record(self) -> LeaseRecord | None:
        """Our last written record (None before ``acquire``)."""
        return self._record

    @property
    def clean_handover(self) -> bool:
        """Whether ``acquire`` took over a lease its holder had released (``close()``d).

        False after a takeover of a silent or broken lease, and where no record was found (a fresh
        root, or a lost ``LEASE.json``): then a previous writer may still be alive somewhere (a
        zombie VM), and whatever this writer resumes from needs protecting from its deletes.
        """
        return self._previous is not None and self._previous.released

    @property
    def epoch(self) -> int:
        """Our fencing token. Raises ``LeaseError`` before ``acquire``."""
        return self._held_record().epoch

    @property
    def attempt(self) -> int:
        """Which acquisition of this run we are (1, 2, ...)."""
        return self._held_record().attempt

    @property
    def run_id(self) -> str:
        """The run id recorded in the lease."""
        return self._held_record().run_id

    @property
    def fenced(self) -> bool:
        """True once another writer took over (or we could not prove we still hold it)."""
        return self._fenced

    @property
    def newer_epoch(self) -> int | None:
        """The epoch that fenced us, when known."""
        return self._newer_epoch

    def _held_record(self) -> LeaseRecord:
        if self._record is None:
            raise LeaseError(f"the lease on {self.url} was never acquired; call acquire() first",
                             url=self.url)
        return self._record

    # ------------------------------------------------------------------ I/O helpers
    def _snapshot(self) -> tuple[bytes, str] | None:
        """(bytes, version) of LEASE.json read consistently, or None when absent."""
        for _ in range(_SNAPSHOT_TRIES):
            try:
                before = self.backend.stat(LEASE_KEY)
                data = self.backend.read(LEASE_KEY)
                after = self.backend.stat(LEASE_KEY)
            except ObjectNotFound:
                return None
            if before.version == after.version:
                return data, after.version
        # A record that changes faster than we can read it is a live holder: report it as such.
        return data, after.version

    def _parse(self, data: bytes) -> LeaseRecord:
        return parse_lease(data, url=self.url)

    def _new_record(self, *, epoch: int, attempt: int, run_id: str, nonce: str) -> LeaseRecord:
        now = _wall()
        return LeaseRecord(
            run_id=run_id,
            attempt=attempt,
            epoch=epoch,
            holder=LeaseHolder(host=socket.gethostname(), pid=os.getpid(), nonce=nonce),
            renewals=0,
            ttl=self.ttl,
            settle=self.settle,
            acquired_at=now,
            renewed_at=now,
        )

    def _adopt(self, record: LeaseRecord, version: str) -> None:
        self._record = record
        self._version = version
        self._last_renewed = self._clock()

    # ------------------------------------------------------------------ acquire
    def acquire(self, *, min_epoch: int = 1) -> LeaseRecord:
        """Take the lease: create it, take over a dead or released holder, or wait.

        Args:
            min_epoch: the lowest epoch to take (the manager passes one above any epoch it saw
                in manifests or lineage records, so a root whose LEASE.json was lost never goes
                back to a used epoch).

        Returns:
            The record we wrote.

        Raises:
            LeaseHeldError: a live holder kept renewing until ``wait_timeout``, or another
                newcomer won the takeover race. ``holder`` is the record seen (a dict).
            LeaseError: ``LEASE.json`` is unreadable (not ours to judge) and ``force`` is off.
        """
        with self._lock:
            if self._record is not None and not self._released and not self._fenced:
                raise LeaseError(f"the lease on {self.url} is already held by this object",
                                 url=self.url)
            self._record = None
            self._version = None
            self._fenced = self._released = False
            self._hb_stop.clear()
            return self._acquire(min_epoch)

    def _acquire(self, min_epoch: int) -> LeaseRecord:
        notice = WaitNotice(f"waiting for the lease on {self.url}")
        try:
            record = self._acquire_watching(min_epoch, notice)
        except BaseException:
            notice.close()
            raise
        notice.close(f"took the lease on {self.url}: epoch {record.epoch}, attempt {record.attempt}")
        return record

    def _acquire_watching(self, min_epoch: int, notice: WaitNotice) -> LeaseRecord:
        nonce = uuid.uuid4().hex
        start = self._clock()
        watch_data: bytes | None = None
        watch_since = start
        logged_at: float | None = None
        force_tries = 0
        last: LeaseRecord | None = None  # the latest record seen: a vanished one still counts
        phantom = 0  # rounds in a row where LEASE.json was neither readable nor creatable
        # Each round sleeps on the injected clock, or returns, or raises, so the deadline bounds
        # the loop; the counter only guards a clock that does not move.
        for _ in range(1_000_000):
            snap = self._snapshot()
            if snap is None:
                # Absent: a fresh root, or a record deleted under us (a delayed Drive delete).
                # Continue what we saw, so epochs and attempts never go back.
                record = self._new_record(
                    epoch=max(1, min_epoch, last.epoch + 1 if last else 1),
                    attempt=last.attempt + 1 if last else 1,
                    run_id=self._given_run_id or (last.run_id if last else uuid.uuid4().hex),
                    nonce=nonce,
                )
                try:
                    info = self.backend.create(LEASE_KEY, record.to_json())
                except PreconditionFailed:
                    # Someone created it first, or our reply was lost: the next read tells.
                    # Unless it never does: something that is no object (a folder, a FIFO)
                    # holds the name, and no lease can ever be written there.
                    phantom += 1
                    if phantom >= _PHANTOM_TRIES:
                        raise LeaseError(
                            f"{self.url.rstrip('/')}/{LEASE_KEY} exists but is not a readable file "
                            "(a folder, a FIFO or a broken link?): no lease can be written there. "
                            "Remove it by hand, then retry", url=self.url) from None
                    self._sleep(_POLL_MIN)
                    continue
                confirmed = self._confirm(record, info.version, previous=None)
                if confirmed is not None:
                    return confirmed
                continue
            data, version = snap
            phantom = 0
            try:
                seen = self._parse(data)
            except LeaseError:
                if not self.force:
                    raise
                seen = None
            if seen is not None and seen.holder.nonce != nonce:
                last = seen
            if seen is not None and seen.holder.nonce == nonce:
                # Our own write whose reply was lost (GCS retries a create into a 412).
                confirmed = self._confirm(seen, version, previous=None)
                if confirmed is not None:
                    return confirmed
                continue
            now = self._clock()
            window = max(self.ttl, seen.ttl if seen is not None else 0.0)
            wait_timeout = (self.wait_timeout if self.wait_timeout is not None
                            else _WAIT_TTLS * window + self.settle)
            if data != watch_data:
                watch_data, watch_since = data, now
            if self.force or seen is None or seen.released or now - watch_since >= window:
                if self.force:
                    force_tries += 1
                    if force_tries > _FORCE_TRIES:
                        raise LeaseHeldError(
                            f"force=True could not take the lease on {self.url}: it changed under "
                            f"us {_FORCE_TRIES} times; another writer keeps writing it",
                            url=self.url, holder=seen.model_dump(mode="json") if seen else None,
                        )
                taken = self._take_over(seen, data, version, nonce, min_epoch, watched=now - start)
                if taken is not None:
                    return taken
                watch_data = None  # the holder moved: observe afresh
                continue
            waited = now - start
            if waited >= wait_timeout:
                raise LeaseHeldError(
                    f"the checkpoint root {self.url} is held by a live writer: {seen.describe()}; "
                    f"its lease kept changing while we watched for {waited:.1f} s. Stop that "
                    "runtime (or wait until it stops renewing), open read-only, or pass "
                    "force=True if you are sure it is dead",
                    url=self.url, holder=seen.model_dump(mode="json"),
                )
            until_takeover = window - (now - watch_since)
            if logged_at is None or now - logged_at >= window:
                logged_at = now
                logger.info(
                    "lease on %s is held by %s; waiting: takeover possible in %.1f s if it stops "
                    "renewing (giving up in %.1f s)",
                    self.url, seen.describe(), until_takeover, wait_timeout - waited,
                )
            if wait_timeout - waited >= SHOW_FROM_S and until_takeover >= SHOW_FROM_S:
                # Said on stderr, not only logged: a rerun after a crash otherwise looks hung.
                notice.update(
                    remaining=until_takeover, total=window, goal="take over if it stays silent",
                    detail=(f"held by {seen.describe()}; it is taken over after {window:.0f} s "
                            f"without a change (giving up after {wait_timeout:.0f} s of renewals). "
                            "If that writer is surely dead, skip the wait: force=True (the "
                            f"examples' --force) or `ckptsdk lease {self.url} --break "
                            "--yes-i-am-sure`"))
            poll = min(max(window / 10.0, _POLL_MIN), _POLL_MAX)
            self._sleep(max(_POLL_MIN / 10, min(poll, until_takeover, wait_timeout - waited)))
        raise LeaseHeldError(f"gave up acquiring the lease on {self.url}: the clock did not move",
                             url=self.url)

    def _take_over(
        self, seen: LeaseRecord | None, data: bytes, version: str, nonce: str, min_epoch: int,
        *, watched: float,
    ) -> LeaseRecord | None:
        """Replace ``seen`` (at ``version``) with ours at epoch+1; None means observe again."""
        prev_epoch = seen.epoch if seen is not None else _best_effort_epoch(data)
        record = self._new_record(
            epoch=max(prev_epoch + 1, min_epoch),
            attempt=(seen.attempt + 1) if seen is not None else 1,
            run_id=self._given_run_id or (seen.run_id if seen is not None else uuid.uuid4().hex),
            nonce=nonce,
        )
        what = seen.describe() if seen is not None else "an unreadable LEASE.json"
        if self.force:
            logger.warning("force=True: breaking the lease on %s held by %s; taking epoch %d",
                           self.url, what, record.epoch)
        elif seen is not None and seen.released:
            logger.info("lease on %s was released by %s; taking epoch %d",
                        self.url, what, record.epoch)
        else:
            logger.info("lease on %s unchanged for %.1f s of watching; taking over from %s "
                        "as epoch %d", self.url, watched, what, record.epoch)
        try:
            info = self.backend.replace(LEASE_KEY, record.to_json(), version=version)
        except ObjectNotFound:
            return None  # deleted meanwhile: the next round creates it
        except PreconditionFailed:
            snap = self._snapshot()
            if snap is None:
                return None
            try:
                now_seen = self._parse(snap[0])
            except LeaseError:
                return None
            if now_seen.holder.nonce == nonce:  # our replace won; its reply was lost
                return self._confirm(now_seen, snap[1], previous=seen)
            if seen is not None and now_seen.holder.nonce == seen.holder.nonce and not self.force:
                logger.info("lease holder on %s renewed at the last moment; still watching",
                            self.url)
                return None
            if self.force:
                return None
            raise LeaseHeldError(
                f"another newcomer took the lease on {self.url} at the same moment: "
                f"{now_seen.describe()}; it is the writer now. Stop it first, or pass force=True",
                url=self.url, holder=now_seen.model_dump(mode="json"),
            ) from None
        return self._confirm(record, info.version, previous=seen)

    def _confirm(
        self, record: LeaseRecord, version: str, *, previous: LeaseRecord | None
    ) -> LeaseRecord | None:
        """Make ``record`` ours; without compare-and-swap first wait ``settle`` and read back.

        Returns None when the read-back shows an older holder's write landed after ours (observe
        again); raises ``LeaseHeldError`` when a rival newcomer's record won.
        """
        if not self._cas:
            # Also after a clean release (which is otherwise taken at once, with no ttl): the
            # settle is not about the old holder, it is the only chance to see a rival newcomer
            # on another VM, whose write reaches us late.
            if self.settle > 0:
                WaitNotice(f"confirming the lease on {self.url}").sleep(
                    self.settle, self._sleep, goal="read it back",
                    detail=(f"this store shows other machines' writes late, so the lease is read "
                            f"back after a {self.settle:.0f} s settle to be sure no other runtime "
                            "took it meanwhile (CheckpointManager(lease_settle=...) sets it)"))
            snap = self._snapshot()
            if snap is None:
                logger.warning("lease on %s vanished during the %.1f s settle; retrying",
                               self.url, self.settle)
                return None
            try:
                back = self._parse(snap[0])
            except LeaseError:
                return None
            if back.holder.nonce != record.holder.nonce:
                if back.epoch >= record.epoch and not self.force:
                    raise LeaseHeldError(
                        f"the lease on {self.url} was taken by another newcomer during our "
                        f"{self.settle:.1f} s settle: {back.describe()}; it is the writer now",
                        url=self.url, holder=back.model_dump(mode="json"),
                    )
                logger.info("lease on %s: an older holder's write (%s) landed after ours; "
                            "watching again", self.url, back.describe())
                return None
            record, version = back, snap[1]
        self._adopt(record, version)
        self._previous = previous
        logger.info("acquired the lease on %s: epoch %d, attempt %d, run %s%s",
                    self.url, record.epoch, record.attempt, record.run_id,
                    f" (previous: {previous.describe()})" if previous is not None else "")
        return record

    # ------------------------------------------------------------------ renew / fence
    def renew(self) -> LeaseRecord:
        """Renew the lease now (the heartbeat calls this; the manager too, at every save).

        Returns:
            The record written.

        Raises:
            LeaseLostError: we are fenced, or this renewal found a newer epoch or another
                holder (then we are fenced from now on).
            BackendError: the storage failed; the lease is unchanged (retry later).
        """
        with self._lock:
            self._raise_if_lost()
            record = self._held_record()
            now = self._clock()
            if not self._cas and now - self._last_renewed > record.ttl:
                # Without compare-and-swap nobody can tell us a newcomer took over; after a whole
                # ttl without renewing (a frozen VM), one may have: stop rather than clobber.
                # Name the newer epoch if its record already reached us.
                snap = self._snapshot()
                if snap is not None:
                    self._judge(snap[0], record, rewriting=False)
                self._fence(
                    f"no renewal for {now - self._last_renewed:.1f} s (> ttl {record.ttl:g} s) on "
                    "a backend without compare-and-swap: another runtime may have taken over",
                    None, None,
                )
                self._raise_if_lost()
            new = record.model_copy(update={"renewals": record.renewals + 1, "renewed_at": _wall()})
            if self._cas:
                try:
                    info = self.backend.replace(LEASE_KEY, new.to_json(), version=self._version or "")
                except (PreconditionFailed, ObjectNotFound):
                    pass  # moved on or vanished: look at what is there
                else:
                    self._adopt(new, info.version)
                    return new
            for _ in range(_SNAPSHOT_TRIES):
                snap = self._snapshot()
                try:
                    if snap is None:
                        logger.warning("lease on %s vanished (a delayed delete?); re-creating it "
                                       "as epoch %d", self.url, record.epoch)
                        info = self.backend.create(LEASE_KEY, new.to_json())
                    elif snap[0] == new.to_json():  # our write landed; its reply was lost
                        self._adopt(new, snap[1])
                        return new
                    else:
                        self._judge(snap[0], record)
                        info = self.backend.replace(LEASE_KEY, new.to_json(), version=snap[1])
                except (PreconditionFailed, ObjectNotFound):
                    continue  # changed between our read and our write: judge it again
                self._adopt(new, info.version)
                return new
            raise BackendError(
                f"could not renew the lease on {self.url}: it changed under every one of "
                f"{_SNAPSHOT_TRIES} tries", url=self.url, key=LEASE_KEY,
            )

    def _judge(self, data: bytes, ours: LeaseRecord, *, rewriting: bool = True) -> None:
        """Fence (and raise) unless the record in storage is ours or an older epoch's."""
        try:
            seen = self._parse(data)
        except LeaseError as exc:
            self._fence(f"LEASE.json became unreadable, so we cannot prove we hold it: {exc}",
                        None, None)
            self.check()
            return
        if seen.holder.nonce == ours.holder.nonce:
            return
        # Same epoch, another nonce: with compare-and-swap that writer won the epoch. Without it
        # (Drive) two VMs can both believe they took it; they are ordered by nonce, like the
        # tags in their folder names, and only the lower one steps back.
        same_epoch_wins = seen.epoch == ours.epoch and not seen.released and (
            self._cas or writer_tag(seen.holder.nonce, compare_and_swap=False)
            > writer_tag(ours.holder.nonce, compare_and_swap=False))
        if seen.epoch > ours.epoch or same_epoch_wins:
            self._fence(f"the lease now belongs to {seen.describe()}", seen.epoch,
                        seen.model_dump(mode="json"))
            self.check()
        # An older epoch's record landing after ours: a zombie's delayed write (Drive). Ours is
        # the newer epoch, so we write over it (the caller does), and the zombie fences on seeing
        # our epoch.
        if rewriting:
            logger.warning("lease on %s: found an older writer's record (%s) over ours (epoch %d);"
                           " writing ours again", self.url, seen.describe(), ours.epoch)

    def fence(self, reason: str, newer_epoch: int | None = None) -> None:
        """Mark this writer fenced: it must stop writing; ``check()`` raises from now on.

        The manager calls this when it sees a manifest or lineage record of a higher epoch.
        Nothing is written or deleted; the heartbeat stops.
        """
        with self._lock:
            self._fence(reason, newer_epoch, None)

    def _fence(self, reason: str, newer_epoch: int | None, holder: dict[str, Any] | None) -> None:
        if self._fenced:
            return
        self._fenced = True
        self._fence_reason = reason
        self._newer_epoch = newer_epoch
        self._newer_holder = holder
        self._hb_stop.set()
        logger.warning("writer of %s (epoch %s) is fenced: %s",
                       self.url, self._record.epoch if self._record else "?", reason)

    def check(self) -> None:
        """Raise ``LeaseLostError`` if this writer may no longer write (fenced or released).

        No I/O. Without compare-and-swap (Drive) it also fences a holder whose last renewal is
        older than a ttl (a frozen VM): a newcomer may hold the lease unseen, so a save that was
        in flight during the freeze must not commit.
        """
        record = self._record
        if not self._fenced and not self._released and not self._cas and record is not None:
            gap = self._clock() - self._last_renewed
            if gap > record.ttl:
                with self._lock:
                    self._fence(f"no renewal for {gap:.1f} s (> ttl {record.ttl:g} s) on a backend "
                                "without compare-and-swap: another runtime may have taken over",
                                None, None)
        self._raise_if_lost()

    def _raise_if_lost(self) -> None:
        if self._fenced:
            epoch = self._record.epoch if self._record else None
            newer = (f"another runtime took over {self.url} at epoch {self._newer_epoch}"
                     if self._newer_epoch is not None
                     else f"another runtime may have taken over {self.url}")
            raise LeaseLostError(
                f"{newer}; this writer (epoch {epoch}) must stop: it will not write or delete "
                f"anything more, and nothing was deleted after the takeover was seen. Restore "
                f"from the root in the new runtime instead. ({self._fence_reason})",
                url=self.url, holder=self._newer_holder, epoch=epoch, newer_epoch=self._newer_epoch,
            )
        if self._record is None or self._released:
            raise LeaseLostError(
                f"this writer does not hold the lease on {self.url} "
                f"({'it was released' if self._released else 'acquire() was never called'})",
                url=self.url, epoch=self._record.epoch if self._record else None,
            )

    # ------------------------------------------------------------------ heartbeat / release
    def start_heartbeat(self) -> None:
        """Renew every ttl/3 from a daemon thread until fenced or released.

        A renewal that finds another holder fences us and stops the heartbeat; storage errors
        are retried at the next beat, and fence us once no renewal succeeded for a whole ttl.
        """
        with self._lock:
            self.check()
            if self._hb_thread is not None and self._hb_thread.is_alive():
                return
            self._hb_stop.clear()
            self._hb_thread = threading.Thread(
                target=self._heartbeat, args=(self._held_record().ttl / 3.0,),
                name=f"ckptsdk-lease-heartbeat-e{self.epoch}", daemon=True,
            )
            self._hb_thread.start()

    def _heartbeat(self, interval: float) -> None:
        # Real time on purpose: Event.wait lets release() stop us at once.
        while not self._hb_stop.wait(interval):
            try:
                self.renew()
                logger.debug("renewed the lease on %s (epoch %d)", self.url, self.epoch)
            except LeaseLostError as exc:
                logger.error("lease heartbeat on %s stopped: %s", self.url, exc)
                return
            except BackendError as exc:
                stale = self._clock() - self._last_renewed
                logger.warning("lease renewal on %s failed (%s); last success %.1f s ago",
                               self.url, exc, stale)
                if stale > self.ttl:
                    with self._lock:
                        self._fence(f"could not renew for {stale:.1f} s (> ttl): {exc}", None, None)
                    return
            except Exception as exc:  # a bug here must not leave a writer without a lease
                logger.exception("lease heartbeat on %s crashed", self.url)
                with self._lock:
                    self._fence(f"the lease heartbeat crashed: {exc!r}", None, None)
                return

    def _stop_heartbeat(self) -> None:
        self._hb_stop.set()
        thread = self._hb_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, self.ttl))
        self._hb_thread = None

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released, only if it is still ours.

        The record stays (``released: true``) so the next writer continues the epoch sequence,
        the attempt count and the run id at once. A fenced writer leaves everything alone.
        Idempotent; storage errors are logged, not raised (the next writer can still take over
        after one ttl).
        """
        self._stop_heartbeat()
        with self._lock:
            if self._record is None or self._released:
                return
            self._released = True
            if self._fenced:
                logger.info("not releasing the lease on %s: fenced, it belongs to epoch %s",
                            self.url, self._newer_epoch)
                return
            record = self._record
            try:
                snap = self._snapshot()
                if snap is None or self._parse(snap[0]).holder.nonce != record.holder.nonce:
                    logger.warning("lease on %s is no longer ours at release; left alone",
                                   self.url)
                    return
                marker = record.model_copy(update={
                    "renewals": record.renewals + 1, "renewed_at": _wall(), "released": True,
                })
                self.backend.replace(LEASE_KEY, marker.to_json(), version=snap[1])
                self._record = marker
                logger.info("released the lease on %s (epoch %d)", self.url, record.epoch)
            except (BackendError, LeaseError) as exc:
                logger.warning("could not release the lease on %s (%s); the next writer will "
                               "take over after one ttl", self.url, exc)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
