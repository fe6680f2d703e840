"""How much memory this process can still allocate: the one rule readers check a size against.

A size read from storage (a tensor header, an archive member) is compared with this before
anything is allocated, so a torn or hostile file becomes a ckptsdk error instead of an
allocator failure or an out-of-memory kill. Reading files belongs to the readers, not here.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from collections.abc import Callable

__all__ = ["advise_huge_pages", "available_memory", "describe_size"]

_CGROUP_V2 = "/sys/fs/cgroup"
# Linux maps fresh memory 4 KiB at a time, one page fault each; where transparent huge pages are
# "madvise" (the default of many distributions) a tensor asks for 2 MiB pages before its bytes
# arrive: on a small VM that made filling 45 MB of fresh memory 34 ms -> 9 ms (a copy into
# memory already mapped: 7 ms). Advice only: memory, values and verification are unchanged.
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_madvise: list[Callable[[int, int, int], int] | None] = []


def _meminfo_available() -> int | None:
    """``MemAvailable`` plus ``SwapFree`` of /proc/meminfo (Linux); None elsewhere.

    Swap counts: a restore into swap is slow but works, and refusing it would be a false alarm.
    There is no fallback to "free pages" (``SC_AVPHYS_PAGES``): with the page cache full it is
    far below what can be allocated, and a verified checkpoint would be refused.
    """
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "SwapFree"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def _cgroup_headroom() -> int | None:
    """What the memory cgroup (a container, Colab's runtime) still lets this process take."""
    try:
        with open(os.path.join(_CGROUP_V2, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(_CGROUP_V2, "memory.current"), encoding="ascii") as f:
            used = int(f.read().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def _address_space_headroom() -> int | None:
    """What ``ulimit -v`` (RLIMIT_AS) leaves above this process's current virtual size."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return max(0, soft - int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return soft


def available_memory() -> int | None:
    """Bytes this process can still allocate, the smallest of what the machine (RAM and swap),
    its memory cgroup and its address-space limit allow; None when none of them can be read
    (the caller then allocates unchecked, as torch would)."""
    known = [n for n in (_meminfo_available(), _cgroup_headroom(), _address_space_headroom()) if n is not None]
    return min(known) if known else None


def describe_size(n: int) -> str:
    """``n`` bytes for a message: exact, and in GiB/MiB for a reader."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n} bytes ({n / (1 << shift):.1f} {unit})"
    return f"{n} bytes"


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask Linux for 2 MiB pages for the 2 MiB-aligned inside of ``nbytes`` of fresh memory at
    ``address`` (see _HUGE_PAGE); nothing for less than two of them, or off Linux."""
    if nbytes < 2 * _HUGE_PAGE:
        return
    if not _madvise:
        found: Callable[[int, int, int], int] | None = None
        if sys.platform.startswith("linux"):
            try:
                call = ctypes.CDLL(None, use_errno=True).madvise
                call.argtypes, call.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                found = call
            except (OSError, AttributeError):
                found = None
        _madvise.append(found)
    fn = _madvise[0]
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if fn is not None and end > start:
        fn(start, end - start, _MADV_HUGEPAGE)  # refused (EINVAL: THP off): 4 KiB pages, as before
