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

This module takes the lease (acquire, takeover, settle); keeping it (renewal, fencing, heartbeat,
release) is ``ckptsdk.lease.renewal``'s, and the record itself ``ckptsdk.lease.record``'s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from ckptsdk.backends.base import Backend
from ckptsdk.errors import BackendError, ConfigError, LeaseError, LeaseHeldError, ObjectNotFound, PreconditionFailed
from ckptsdk.format.document import utc_now
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

DEFAULT_TTL = 60.0  # local disk, GCS: see the module docstring
DRIVE_TTL = 300.0  # backends whose changes reach other hosts late (Drive)
_PHANTOM_TRIES = 3  # rounds where LEASE.json can be neither read nor created before we give up
_DRIVE_SETTLE_FRACTION = 0.2  # settle = ttl/5 on such backends
_WAIT_TTLS = 5.0  # wait_timeout=None: give up after 5 ttl windows of a holder that keeps renewing
_POLL_MIN, _POLL_MAX = 0.05, 5.0  # observation poll: ttl/10, clamped
_FORCE_TRIES = 5  # force=True insists this many times against concurrent writers


class Lease(HeldLease):
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
            raise ConfigError(
                f"lease ttl must be > 0 and <= {MAX_TTL:g} seconds, got {ttl!r}: "
                "a newcomer waits up to five ttl for a silent holder"
            )
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

    def _new_record(self, *, epoch: int, attempt: int, run_id: str, nonce: str) -> LeaseRecord:
        now = utc_now()
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
            wait_timeout = self.wait_timeout if self.wait_timeout is not None else _WAIT_TTLS * window + self.settle
            if data != watch_data:
                watch_data, watch_since = data, now
            if self.force or seen is None or seen.released or now - watch_since >= window:
                if self.force:
                    force_tries += 1
                    if force_tries > _FORCE_TRIES:
                        raise LeaseHeldError(
                            f"force=True could not take the lease on {self.url}: it changed under "
                            f"us {_FORCE_TRIES} times; another writer keeps writing it",
                            url=self.url,
                            holder=seen.model_dump(mode="json") if seen else None,
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
                    url=self.url,
                    holder=seen.model_dump(mode="json"),
                )
            until_takeover = window - (now - watch_since)
            if logged_at is None or now - logged_at >= window:
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
                        f"held by {seen.describe()}; it is taken over after {window:.0f} s "
                        f"without a change (giving up after {wait_timeout:.0f} s of renewals). "
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
    ) -> LeaseRecord | None:
        """Replace ``seen`` (at ``version``) with ours at epoch+1; None means observe again."""
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

    def _confirm(self, record: LeaseRecord, version: str, *, previous: LeaseRecord | None) -> LeaseRecord | None:
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
                    self.settle,
                    self._sleep,
                    goal="read it back",
                    detail=(
                        f"this store shows other machines' writes late, so the lease is read "
                        f"back after a {self.settle:.0f} s settle to be sure no other runtime "
                        "took it meanwhile (CheckpointManager(lease_settle=...) sets it)"
                    ),
                )
            snap = self._snapshot()
            if snap is None:
                logger.warning("lease on %s vanished during the %.1f s settle; retrying", self.url, self.settle)
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
                        url=self.url,
                        holder=back.model_dump(mode="json"),
                    )
                logger.info(
                    "lease on %s: an older holder's write (%s) landed after ours; watching again",
                    self.url,
                    back.describe(),
                )
                return None
            record, version = back, snap[1]
        self._adopt(record, version)
        self._previous = previous
        logger.info(
            "acquired the lease on %s: epoch %d, attempt %d, run %s%s",
            self.url,
            record.epoch,
            record.attempt,
            record.run_id,
            f" (previous: {previous.describe()})" if previous is not None else "",
        )
        return record

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
