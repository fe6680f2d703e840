"""Who holds a lease, in terms this machine can check at once: is that process still alive?

A lease record names its holder by host, boot id, pid namespace, pid and the process's start
time. A newcomer on the same host, the same boot and the same pid namespace can ask the kernel
whether that exact process still exists; only such a newcomer judges a holder dead without
watching its record for a ttl. Anything it cannot check (another host, another boot, another pid
namespace as in containers, an older record without these fields, a ``/proc`` that is not ours)
is "unknown", and the caller falls back to the cross-host rule. Reading ``/proc`` is all this
module does; what follows from a verdict is ``ckptsdk.lease.acquire``'s.
"""

from __future__ import annotations

import enum
import functools
import os
import socket
from dataclasses import dataclass

__all__ = ["Liveness", "ProcessIdentity", "judge_holder", "this_process"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class Liveness(enum.Enum):
    """What this machine can say about a lease holder's process."""

    ALIVE = "alive"  # the very process (same pid, same start time) exists and is not a zombie
    DEAD = "dead"  # same host, boot and pid namespace, and that process is gone
    UNKNOWN = "unknown"  # not checkable from here: the cross-host rule decides


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as the kernel names it; every field but ``host``/``pid`` may be unknown (None).

    Example:
        >>> me = this_process()
        >>> judge_holder(me.host, me.pid, me.boot_id, me.pid_ns, me.start_time)[0] in (Liveness.ALIVE, Liveness.UNKNOWN)
        True
    """

    host: str
    pid: int
    boot_id: str | None
    pid_ns: str | None
    start_time: int | None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of ``pid`` in our ``/proc``, or None."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    # "PID (comm) S ppid ... starttime ...": comm may hold spaces and parentheses; fields after
    # the last ')' are fixed: state is field 3, starttime field 22 (proc(5)).
    rest = text.rpartition(")")[2].split()
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _namespace_facts() -> tuple[str | None, str | None]:
    """(boot id, pid namespace) of this process, or Nones where ``/proc`` cannot tell them truly."""
    boot_id = _read(_BOOT_ID)
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    # A /proc mounted for another pid namespace (``unshare --pid`` without --mount-proc) would
    # show other processes under our pids: then nothing here can be judged.
    own = _read("/proc/self/stat")
    if own is None or own.split(" ", 1)[0] != str(os.getpid()):
        pid_ns = None
    return boot_id or None, pid_ns


def this_process() -> ProcessIdentity:
    """This process's identity, to be recorded in the lease it takes."""
    return _identity(os.getpid(), socket.gethostname())


@functools.lru_cache(maxsize=4)
def _identity(pid: int, host: str) -> ProcessIdentity:
    # Keyed by pid and host: a forked child or a renamed host gets its own; a newcomer asks this
    # at every round of its watch, and the answer never changes for one process.
    boot_id, pid_ns = _namespace_facts()
    stat = _stat(pid) if pid_ns is not None else None
    return ProcessIdentity(
        host=host,
        pid=pid,
        boot_id=boot_id,
        pid_ns=pid_ns,
        start_time=stat[1] if stat is not None else None,
    )


def judge_holder(
    host: str, pid: int, boot_id: str | None, pid_ns: str | None, start_time: int | None
) -> tuple[Liveness, str]:
    """Whether the process a lease record names is alive, dead, or beyond what we can check.

    Never judges a live holder dead: a stopped process (SIGSTOP) is alive, a pid that now belongs
    to another process is told apart by its start time, a container sharing our boot id differs
    in pid namespace (or host) and is "unknown".

    Returns:
        (verdict, why) where ``why`` is a short phrase for messages.
    """
    me = this_process()
    if boot_id is None or pid_ns is None or start_time is None:
        return Liveness.UNKNOWN, "the record does not name its process fully (an older ckptsdk?)"
    if host != me.host:
        return Liveness.UNKNOWN, f"it runs on another host ({host!r})"
    if me.boot_id is None or me.pid_ns is None or boot_id != me.boot_id:
        return Liveness.UNKNOWN, "it ran under another boot of this host (or ours cannot be read)"
    if pid_ns != me.pid_ns:
        return Liveness.UNKNOWN, "it runs in another pid namespace (a container?)"
    stat = _stat(pid)
    if stat is None:
        return Liveness.DEAD, f"its process {pid} on this host no longer exists"
    state, started = stat
    if started != start_time:
        return Liveness.DEAD, f"its process {pid} is gone (that pid now belongs to another process)"
    if state in ("Z", "X"):
        return Liveness.DEAD, f"its process {pid} has exited (a zombie not yet reaped)"
    return Liveness.ALIVE, f"its process {pid} on this host is alive (state {state})"
