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
read-back finds a writer that outranks us, we are fenced (``ckptsdk.lease.renewal``).

This module takes the lease (acquire, takeover); keeping it (renewal, fencing, heartbeat,
the background read-back, release) is ``ckptsdk.lease.renewal``'s, and the record itself
``ckptsdk.lease.record``'s.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from ckptsdk.backends.base import Backend
from ckptsdk.errors import BackendError, ConfigError, LeaseError, LeaseHeldError, ObjectNotFound, PreconditionFailed
from ckptsdk.format.document import utc_now
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
from ckptsdk.lease.renewal import HeldLease
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


class Lease(HeldLease):
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
        self._record = None
        self._version = None
        self._last_renewed = 0.0
        self._fenced = False
        self._fence_reason = ""
        self._newer_epoch = None
        self._newer_holder = None
        self._released = False
        self._previous = None
        self._hb_stop = threading.Event()
        self._hb_thread = None
        self._settle_due = None

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
            self._hb_stop.clear()
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
                    "force=True if you are sure it is dead",
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
                        "If that writer is surely dead, skip the wait: force=True (the "
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
                f"{now_seen.describe()}; it is the writer now. Stop it first, or pass force=True",
                url=self.url,
                holder=now_seen.model_dump(mode="json"),
            ) from None
        return self._confirm(record, info.version, previous=seen)

    def _confirm(self, record: LeaseRecord, version: str, *, previous: LeaseRecord | None) -> LeaseRecord:
        """Make ``record`` ours, at once.

        Without compare-and-swap (Drive) a rival newcomer on another VM may have written its own
        record too, which reaches us late. Waiting here for that (the settle) held every open up
        for a minute; instead the record is read back ``settle`` seconds from now, in the
        background (``HeldLease.read_back``, run by the heartbeat and by every save's renewal),
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

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
