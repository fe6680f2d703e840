"""The kept half of the writer lease: renewal, fencing, heartbeat and release, once it is held.

``HeldLease`` is the base of ``ckptsdk.lease.acquire.Lease``, which adds taking the lease (acquire,
takeover, settle); read that module's docstring for the protocol and its defaults. What the record
holds is ``ckptsdk.lease.record``'s; lineage and what rotation may delete are the manager's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ckptsdk.backends.base import Backend
from ckptsdk.errors import BackendError, LeaseError, LeaseLostError, ObjectNotFound, PreconditionFailed
from ckptsdk.format.document import utc_now
from ckptsdk.format.layout import outranks, writer_tag
from ckptsdk.lease.record import LEASE_KEY, LeaseRecord, parse_lease

# One logger for the whole lease protocol, whichever module a message comes from.
logger = logging.getLogger("ckptsdk.lease.acquire")

__all__ = ["HeldLease"]

#: stat/read/stat retries when the object keeps changing under us.
SNAPSHOT_TRIES = 5


class HeldLease:
    """A writer lease once held: its state, renewal, fencing, heartbeat and release.

    Not used on its own: ``ckptsdk.lease.acquire.Lease`` sets the attributes below and acquires.
    """

    backend: Backend
    url: str
    ttl: float
    settle: float
    force: bool
    _clock: Callable[[], float]
    _cas: bool
    _lock: threading.RLock
    _record: LeaseRecord | None
    _version: str | None
    _last_renewed: float  # our clock at the last confirmed write of our record
    _fenced: bool
    _fence_reason: str
    _newer_epoch: int | None
    _newer_holder: dict[str, Any] | None
    _released: bool
    _previous: LeaseRecord | None
    _hb_stop: threading.Event
    _hb_thread: threading.Thread | None
    _settle_due: float | None  # our clock when the background read-back is due (no CAS); None: done

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
        for _ in range(SNAPSHOT_TRIES):
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
            for _ in range(SNAPSHOT_TRIES):
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
                f"could not renew the lease on {self.url}: it changed under every one of {SNAPSHOT_TRIES} tries",
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
        self._hb_stop.set()
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
                target=self._heartbeat,
                args=(self._held_record().ttl / 3.0,),
                name=f"ckptsdk-lease-heartbeat-e{self.epoch}",
                daemon=True,
            )
            self._hb_thread.start()

    def _heartbeat(self, interval: float) -> None:
        # Real time on purpose: Event.wait lets release() stop us at once. The first beat after
        # the settle is the background read-back (``_confirm``), so it is not left to chance.
        while not self._hb_stop.wait(self._next_beat(interval)):
            try:
                self.renew()
                logger.debug("renewed the lease on %s (epoch %d)", self.url, self.epoch)
            except LeaseLostError as exc:
                logger.error("lease heartbeat on %s stopped: %s", self.url, exc)
                return
            except BackendError as exc:
                stale = self._clock() - self._last_renewed
                logger.warning("lease renewal on %s failed (%s); last success %.1f s ago", self.url, exc, stale)
                if stale > self.ttl:
                    with self._lock:
                        self._fence(f"could not renew for {stale:.1f} s (> ttl): {exc}", None, None)
                    return
            except Exception as exc:  # a bug here must not leave a writer without a lease
                logger.exception("lease heartbeat on %s crashed", self.url)
                with self._lock:
                    self._fence(f"the lease heartbeat crashed: {exc!r}", None, None)
                return

    def _next_beat(self, interval: float) -> float:
        due = self._settle_due
        if due is None:
            return interval
        return min(interval, max(0.0, due - self._clock()) + 0.01)

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
