"""The writer lease on a checkpoint root (``ROOT/LEASE.json``): one writer at a time, with fencing.

A newcomer judges a holder alive by *seeing its record change* over a ttl window on its own
monotonic clock (VM clocks drift; the record's timestamps are for humans), with one exception
that needs no clock at all: a holder on this very host, boot and pid namespace whose process is
gone (``ckptsdk.lease.identity``) is dead, and its lease is taken at once (a crashed script
started again, a restarted Colab kernel). Lineage (epochs in manifests, orphans, what rotation
may delete) belongs to the manager; storage to the backends.

Defaults, and why. Immediately consistent backends with compare-and-swap (local disk, GCS, S3):
ttl 15 s, settle 0; the holder renews every ttl/3 (5 s: one conditional write, about 17,000 a
day, a few cents at GCS/S3 class-A prices), so a live holder changes its record twice or more per
window, and a SIGKILLed holder on another VM (a reclaimed spot VM) is taken over ~15 s after its
successor opens. Conditional writes make every takeover and renewal exact, so a short ttl risks
only a holder that stalled for 15 s being fenced (it stops at its next save), never two writers.
Drive (``immediately_consistent=False``, no cross-VM compare-and-swap): ttl 45 s (renewals every
15 s), so a newcomer on another VM resumes within a minute of a dead or frozen holder. A ttl
shorter than Drive's propagation jitter can make a live holder on another VM look dead; that
twin is then fenced by lineage at its next save and has wasted compute, never a checkpoint
(docs/DRIVE.md). The settle (60 s: read our record back once a rival's write had time to reach
us) does not hold anyone up: the lease is used at once and read back in the background; if the
read-back finds a writer that outranks us, we are fenced.

This module is the lease as its holder sees it: taking it (acquire, takeover) and keeping it
(renewal, fencing, the background read-back, release). The thread that renews it is its
collaborator ``ckptsdk.lease.heartbeat``; the record itself is ``ckptsdk.lease.record``'s.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ckptsdk.backends.base import Backend
from ckptsdk.errors import (
    BackendError,
    ConfigError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    ObjectNotFound,
    PreconditionFailed,
)
from ckptsdk.format.document import utc_now
from ckptsdk.format.layout import outranks, writer_tag
from ckptsdk.lease.heartbeat import Heartbeat
from ckptsdk.lease.identity import Liveness, this_process
from ckptsdk.lease.record import (
    LEASE_FORMAT,
    LEASE_KEY,
    MAX_TTL,
    LeaseHolder,
    LeaseRecord,
    best_effort_epoch,
    parse_lease,
    read_lease,
)
from ckptsdk.lease.waiting import SHOW_FROM_S, WaitNotice

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

DEFAULT_TTL = 15.0  # local disk, GCS, S3: see the module docstring
DRIVE_TTL = 45.0  # backends whose changes reach other hosts late (Drive)
DRIVE_SETTLE = 60.0  # their background read-back, after a rival's write had time to arrive
_PHANTOM_TRIES = 3  # rounds where LEASE.json can be neither read nor created before we give up
_WAIT_TTLS = 5.0  # wait_timeout=None: give up after 5 ttl windows of a holder that keeps renewing
_POLL_MIN, _POLL_MAX = 0.05, 5.0  # observation poll: ttl/10, clamped
_FORCE_TRIES = 5  # force=True insists this many times against concurrent writers
_SNAPSHOT_TRIES = 5  # stat/read/stat retries when the object keeps changing under us


class Lease:
    """The writer lease of one checkpoint root.

    Args:
        backend: the checkpoint root's storage.
        ttl: seconds a record must stay unchanged before a newcomer takes over; the holder renews
            every ttl/3. None: 15 s on immediately consistent backends, 45 s on Drive. A holder
            whose process is gone from this very host is taken over at once, whatever its ttl.
        settle: seconds after taking the lease on a backend without compare-and-swap when it is
            read back (in the background: ``acquire`` never waits for it) to see whether a rival
            on another machine took it too. None: 0 when immediately consistent, else 60 s.
        force: take over at once, without observing the holder (the user's explicit word).
        wait_timeout: seconds ``acquire`` waits for a live holder before ``LeaseHeldError``.
            None: five of the holder's ttl windows.
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
            raise ConfigError(
                f"lease ttl must be > 0 and <= {MAX_TTL:g} seconds, got {ttl!r}: "
                "a newcomer waits up to five ttl for a silent holder"
            )
        if settle is None:
            settle = 0.0 if caps.immediately_consistent else DRIVE_SETTLE
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
        self._record: LeaseRecord | None = None  # our last written record
        self._version: str | None = None  # its version in storage
        self._last_renewed = 0.0  # our clock at the last confirmed write of our record
        self._fenced = False
        self._fence_reason = ""
        self._newer_epoch: int | None = None
        self._newer_holder: dict[str, Any] | None = None
        self._released = False
        self._previous: LeaseRecord | None = None
        self._heartbeat = Heartbeat(self)
        self._settle_due: float | None = None  # our clock when the read-back is due (no CAS); None: done

    def _new_record(self, *, epoch: int, attempt: int, run_id: str, nonce: str) -> LeaseRecord:
        now = utc_now()
        me = this_process()
        return LeaseRecord(
            run_id=run_id,
            attempt=attempt,
            epoch=epoch,
            holder=LeaseHolder(
                host=me.host,
                pid=me.pid,
                nonce=nonce,
                boot_id=me.boot_id,
                pid_ns=me.pid_ns,
                start_time=me.start_time,
            ),
            renewals=0,
            ttl=self.ttl,
            settle=self.settle,
            acquired_at=now,
            renewed_at=now,
        )

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
                raise LeaseError(f"the lease on {self.url} is already held by this object", url=self.url)
            self._record = None
            self._version = None
            self._fenced = self._released = False
            self._settle_due = None
            return self._acquire(min_epoch)

    def raise_epoch(self, epoch: int) -> LeaseRecord:
        """Move our held record up to ``epoch`` by one compare-and-swap, before anything is written
        under the epoch we took.

        For a writer that lists the root only once it holds the lease (stores with
        compare-and-swap) and finds a name of our epoch or above (a root whose ``LEASE.json``
        and lineage records were lost): epochs never go back, so names stay unique.

        Raises:
            LeaseLostError: another writer took the lease meanwhile (we are fenced).
            LeaseError: called without compare-and-swap, where one write proves nothing.
            BackendError: the storage failed; the record is unchanged.
        """
        with self._lock:
            self._raise_if_lost()
            record = self._held_record()
            if epoch <= record.epoch:
                return record
            if not self._cas:
                raise LeaseError(f"raise_epoch needs compare-and-swap, which {self.url} does not have", url=self.url)
            new = record.model_copy(update={"epoch": epoch, "renewed_at": utc_now()})
            for _ in range(2):
                try:
                    info = self.backend.replace(LEASE_KEY, new.to_json(), version=self._version or "")
                except (PreconditionFailed, ObjectNotFound):
                    snap = self._snapshot()
                    if snap is not None and snap[0] == new.to_json():  # ours landed; its reply was lost
                        self._adopt(new, snap[1])
                        break
                    # Judged by a renewal: it fences and raises if another writer holds it now,
                    # else it rewrites our record (at the old epoch) and we try once more.
                    record = self.renew()
                    new = record.model_copy(update={"epoch": epoch, "renewed_at": utc_now()})
                    continue
                self._adopt(new, info.version)
                break
            else:
                raise BackendError(
                    f"could not move the lease on {self.url} to epoch {epoch}: it changed under us twice",
                    url=self.url,
                    key=LEASE_KEY,
                )
            logger.warning(
                "the root %s holds names of epoch %d or above (its LEASE.json and lineage records were "
                "lost?): this writer takes epoch %d so that no name is used twice",
                self.url,
                epoch - 1,
                epoch,
            )
            return new

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
                            "Remove it by hand, then retry",
                            url=self.url,
                        ) from None
                    self._sleep(_POLL_MIN)
                    continue
                return self._confirm(record, info.version, previous=None)
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
                return self._confirm(seen, version, previous=None)
            now = self._clock()
            # The holder renews at its own ttl/3, so its recorded ttl is the window that shows it
            # alive (ours would make a short-ttl holder's successor wait longer than it must).
            window = seen.ttl if seen is not None else self.ttl
            wait_timeout = self.wait_timeout if self.wait_timeout is not None else _WAIT_TTLS * window
            if data != watch_data:
                watch_data, watch_since = data, now
            # Asked at every round, not once per record: a holder that dies while we watch has
            # stopped changing its record, and only this question notices at once.
            liveness, why = (Liveness.UNKNOWN, "") if seen is None or seen.released else seen.holder.liveness()
            dead = why if liveness is Liveness.DEAD else None
            if self.force or seen is None or seen.released or dead or now - watch_since >= window:
                if self.force:
                    force_tries += 1
                    if force_tries > _FORCE_TRIES:
                        raise LeaseHeldError(
                            f"force=True could not take the lease on {self.url}: it changed under "
                            f"us {_FORCE_TRIES} times; another writer keeps writing it",
                            url=self.url,
                            holder=seen.model_dump(mode="json") if seen else None,
                        )
                taken = self._take_over(seen, data, version, nonce, min_epoch, watched=now - start, dead=dead)
                if taken is not None:
                    return taken
                watch_data = None  # the holder moved: observe afresh
                continue
            waited = now - start
            if waited >= wait_timeout:
                raise LeaseHeldError(
                    f"the checkpoint root {self.url} is held by a live writer: {seen.describe()}"
                    f"{f' ({why})' if why else ''}; its lease kept changing while we watched for "
                    f"{waited:.1f} s. Stop that "
                    "runtime (or wait until it stops renewing), open read-only, or pass "
                    "lease_options=LeaseOptions(force=True) if you are sure it is dead",
                    url=self.url,
                    holder=seen.model_dump(mode="json"),
                )
            until_takeover = window - (now - watch_since)
            if logged_at is None:  # once per wait: the notice below counts down in place
                logged_at = now
                logger.info(
                    "lease on %s is held by %s; waiting: takeover possible in %.1f s if it stops "
                    "renewing (giving up in %.1f s)",
                    self.url,
                    seen.describe(),
                    until_takeover,
                    wait_timeout - waited,
                )
            if wait_timeout - waited >= SHOW_FROM_S and until_takeover >= SHOW_FROM_S:
                # Said on stderr, not only logged: a rerun after a crash otherwise looks hung.
                notice.update(
                    remaining=until_takeover,
                    total=window,
                    goal="take over if it stays silent",
                    detail=(
                        f"held by {seen.describe()}{f'; {why}' if why else ''}; it is taken over "
                        f"after {window:.0f} s without a change (giving up after "
                        f"{wait_timeout:.0f} s of renewals). "
                        "If that writer is surely dead, skip the wait: lease_options=LeaseOptions(force=True) (the "
                        f"examples' --force) or `ckptsdk lease {self.url} --break "
                        "--yes-i-am-sure`"
                    ),
                )
            poll = min(max(window / 10.0, _POLL_MIN), _POLL_MAX)
            self._sleep(max(_POLL_MIN / 10, min(poll, until_takeover, wait_timeout - waited)))
        raise LeaseHeldError(f"gave up acquiring the lease on {self.url}: the clock did not move", url=self.url)

    def _take_over(
        self,
        seen: LeaseRecord | None,
        data: bytes,
        version: str,
        nonce: str,
        min_epoch: int,
        *,
        watched: float,
        dead: str | None = None,
    ) -> LeaseRecord | None:
        """Replace ``seen`` (at ``version``) with ours at epoch+1; None means observe again.

        ``dead`` says why the holder is known dead on this host (no observation needed).
        """
        prev_epoch = seen.epoch if seen is not None else best_effort_epoch(data)
        record = self._new_record(
            epoch=max(prev_epoch + 1, min_epoch),
            attempt=(seen.attempt + 1) if seen is not None else 1,
            run_id=self._given_run_id or (seen.run_id if seen is not None else uuid.uuid4().hex),
            nonce=nonce,
        )
        what = seen.describe() if seen is not None else "an unreadable LEASE.json"
        if self.force:
            logger.warning(
                "force=True: breaking the lease on %s held by %s; taking epoch %d", self.url, what, record.epoch
            )
        elif seen is not None and seen.released:
            logger.info("lease on %s was released by %s; taking epoch %d", self.url, what, record.epoch)
        elif dead is not None:
            logger.warning(
                "lease on %s: the holder %s is dead (%s); taking over at once as epoch %d",
                self.url,
                what,
                dead,
                record.epoch,
            )
        else:
            logger.info(
                "lease on %s unchanged for %.1f s of watching; taking over from %s as epoch %d",
                self.url,
                watched,
                what,
                record.epoch,
            )
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
                logger.info("lease holder on %s renewed at the last moment; still watching", self.url)
                return None
            if self.force:
                return None
            raise LeaseHeldError(
                f"another newcomer took the lease on {self.url} at the same moment: "
                f"{now_seen.describe()}; it is the writer now. Stop it first, or pass "
                "lease_options=LeaseOptions(force=True)",
                url=self.url,
                holder=now_seen.model_dump(mode="json"),
            ) from None
        return self._confirm(record, info.version, previous=seen)

    def _confirm(self, record: LeaseRecord, version: str, *, previous: LeaseRecord | None) -> LeaseRecord:
        """Make ``record`` ours, at once.

        Without compare-and-swap (Drive) a rival newcomer on another VM may have written its own
        record too, which reaches us late. Waiting here for that (the settle) held every open up
        for a minute; instead the record is read back ``settle`` seconds from now, in the
        background (a renewal after the settle, by the heartbeat or by a save),
        and a rival that outranks us fences this writer then. Until that read-back, whatever we
        commit is ordered against the rival by lineage (epoch, then writer tag), so exactly one
        of us is the root's in the end and nothing of the other's is deleted.
        """
        self._adopt(record, version)
        self._previous = previous
        self._settle_due = self._clock() + self.settle if not self._cas and self.settle > 0 else None
        logger.info(
            "acquired the lease on %s: epoch %d, attempt %d, run %s%s%s",
            self.url,
            record.epoch,
            record.attempt,
            record.run_id,
            f" (previous: {previous.describe()})" if previous is not None else "",
            f"; read back in {self.settle:.0f} s, in the background" if self._settle_due is not None else "",
        )
        return record

    # ------------------------------------------------------------------ state
    @property
    def record(self) -> LeaseRecord | None:
        """Our last written record (None before ``acquire``)."""
        return self._record

    @property
    def previous(self) -> LeaseRecord | None:
        """The record ``acquire`` took over from (None on a fresh root, or a lost ``LEASE.json``)."""
        return self._previous

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
    def settled(self) -> bool:
        """Whether our record was read back after the settle and found ours (always, with CAS).

        Until then, on a store without compare-and-swap, a rival newcomer on another machine may
        also believe it holds the lease; lineage orders the two, and the read-back fences the
        lower one. Nothing waits for this; it says how far the confirmation has come.
        """
        return self._settle_due is None

    @property
    def newer_epoch(self) -> int | None:
        """The epoch that fenced us, when known."""
        return self._newer_epoch

    def _held_record(self) -> LeaseRecord:
        if self._record is None:
            raise LeaseError(f"the lease on {self.url} was never acquired; call acquire() first", url=self.url)
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

    def _adopt(self, record: LeaseRecord, version: str) -> None:
        self._record = record
        self._version = version
        self._last_renewed = self._clock()
        if self._settle_due is not None and self._last_renewed >= self._settle_due:
            # A renewal after the settle is the read-back: a rival's record written before ours
            # had time to reach us, and it was judged (and did not outrank us) on the way here.
            self._settle_due = None
            logger.info("lease on %s read back after the settle: still ours (epoch %d)", self.url, record.epoch)

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
                    None,
                    None,
                )
                self._raise_if_lost()
            new = record.model_copy(update={"renewals": record.renewals + 1, "renewed_at": utc_now()})
            # One call when LEASE.json is still the record we wrote last. Without compare-and-swap
            # (Drive) too: a versioned replace there compares this VM's view under the root flock,
            # and a view still at our version holds our record, which the stat/read/stat snapshot
            # below would only have read back and judged ours. Any change (another VM's record
            # arriving, a vanished file) falls through to that snapshot and its judgement.
            if self._cas or self._version is not None:
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
                        logger.warning(
                            "lease on %s vanished (a delayed delete?); re-creating it as epoch %d",
                            self.url,
                            record.epoch,
                        )
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
                f"could not renew the lease on {self.url}: it changed under every one of {_SNAPSHOT_TRIES} tries",
                url=self.url,
                key=LEASE_KEY,
            )

    def confirm(self) -> None:
        """Prove that nobody took the lease since our last write, with one stat and no write.

        Where the store has compare-and-swap, LEASE.json still at the version we wrote last
        means no newer writer exists (a takeover replaces it). Otherwise (or when it moved on)
        this renews, which judges what is there and fences if it must.

        Raises:
            LeaseLostError: fenced, or the renewal found a newer writer.
            BackendError: the storage failed.
        """
        with self._lock:
            self._raise_if_lost()
            if self._cas and self._version is not None:
                try:
                    if self.backend.stat(LEASE_KEY).version == self._version:
                        return
                except ObjectNotFound:
                    pass  # renew() says what that means
            self.renew()

    def _judge(self, data: bytes, ours: LeaseRecord, *, rewriting: bool = True) -> None:
        """Fence (and raise) unless the record in storage is ours or an older epoch's."""
        try:
            seen = self._parse(data)
        except LeaseError as exc:
            self._fence(f"LEASE.json became unreadable, so we cannot prove we hold it: {exc}", None, None)
            self.check()
            return
        if seen.holder.nonce == ours.holder.nonce:
            return
        # Same epoch, another nonce: with compare-and-swap that writer won the epoch. Without it
        # (Drive) two VMs can both believe they took it; they are ordered by nonce, like the
        # tags in their folder names, and only the lower one steps back.
        same_epoch_wins = seen.epoch == ours.epoch and not seen.released and self._cas
        seen_rank = (seen.epoch, "" if seen.released else writer_tag(seen.holder.nonce, compare_and_swap=False))
        if same_epoch_wins or outranks(seen_rank, (ours.epoch, writer_tag(ours.holder.nonce, compare_and_swap=False))):
            self._fence(f"the lease now belongs to {seen.describe()}", seen.epoch, seen.model_dump(mode="json"))
            self.check()
        # An older epoch's record landing after ours: a zombie's delayed write (Drive). Ours is
        # the newer epoch, so we write over it (the caller does), and the zombie fences on seeing
        # our epoch.
        if rewriting:
            logger.warning(
                "lease on %s: found an older writer's record (%s) over ours (epoch %d); writing ours again",
                self.url,
                seen.describe(),
                ours.epoch,
            )

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
        self._heartbeat.stop_soon()
        logger.warning(
            "writer of %s (epoch %s) is fenced: %s", self.url, self._record.epoch if self._record else "?", reason
        )

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
                    self._fence(
                        f"no renewal for {gap:.1f} s (> ttl {record.ttl:g} s) on a backend "
                        "without compare-and-swap: another runtime may have taken over",
                        None,
                        None,
                    )
        self._raise_if_lost()

    def _raise_if_lost(self) -> None:
        if self._fenced:
            epoch = self._record.epoch if self._record else None
            newer = (
                f"another runtime took over {self.url} at epoch {self._newer_epoch}"
                if self._newer_epoch is not None
                else f"another runtime may have taken over {self.url}"
            )
            raise LeaseLostError(
                f"{newer}; this writer (epoch {epoch}) must stop: it will not write or delete "
                f"anything more, and nothing was deleted after the takeover was seen. Restore "
                f"from the root in the new runtime instead. ({self._fence_reason})",
                url=self.url,
                holder=self._newer_holder,
                epoch=epoch,
                newer_epoch=self._newer_epoch,
            )
        if self._record is None or self._released:
            raise LeaseLostError(
                f"this writer does not hold the lease on {self.url} "
                f"({'it was released' if self._released else 'acquire() was never called'})",
                url=self.url,
                epoch=self._record.epoch if self._record else None,
            )

    # ------------------------------------------------------------------ heartbeat / release
    def start_heartbeat(self) -> None:
        """Renew every ttl/3 from a daemon thread until fenced or released (see ``Heartbeat``)."""
        with self._lock:
            self.check()
            self._heartbeat.start(self._held_record().ttl / 3.0)

    @property
    def heartbeat(self) -> Heartbeat:
        """This lease's heartbeat (its thread runs once ``start_heartbeat`` is called)."""
        return self._heartbeat

    def seconds_since_renewal(self) -> float:
        """Seconds on our clock since our record was last written and confirmed."""
        return self._clock() - self._last_renewed

    def seconds_to_read_back(self) -> float | None:
        """Seconds until the background read-back is due (None: done, or not needed)."""
        due = self._settle_due
        return None if due is None else due - self._clock()

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released, only if it is still ours.

        The record stays (``released: true``) so the next writer continues the epoch sequence,
        the attempt count and the run id at once. A fenced writer leaves everything alone.
        Idempotent; storage errors are logged, not raised (the next writer can still take over
        after one ttl).
        """
        self._heartbeat.stop()
        with self._lock:
            if self._record is None or self._released:
                return
            self._released = True
            if self._fenced:
                logger.info(
                    "not releasing the lease on %s: fenced, it belongs to epoch %s", self.url, self._newer_epoch
                )
                return
            record = self._record
            try:
                snap = self._snapshot()
                if snap is None or self._parse(snap[0]).holder.nonce != record.holder.nonce:
                    logger.warning("lease on %s is no longer ours at release; left alone", self.url)
                    return
                marker = record.model_copy(
                    update={
                        "renewals": record.renewals + 1,
                        "renewed_at": utc_now(),
                        "released": True,
                    }
                )
                self.backend.replace(LEASE_KEY, marker.to_json(), version=snap[1])
                self._record = marker
                logger.info("released the lease on %s (epoch %d)", self.url, record.epoch)
            except (BackendError, LeaseError) as exc:
                logger.warning(
                    "could not release the lease on %s (%s); the next writer will take over after one ttl",
                    self.url,
                    exc,
                )

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
