"""The one table of digest algorithms ckptsdk computes and checks (tensor files, data cache).

Also which of them a checkpoint's files may name. What a digest covers, and when it is checked,
belongs to the caller (``format/files/tensorfile.py``, ``data/cache.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from typing import Protocol

import xxhash

from ckptsdk.errors import ConfigError

__all__ = ["ALGORITHMS", "CHECKPOINT_ALGORITHMS", "DEFAULT", "Hasher", "new_hasher"]


class Hasher(Protocol):
    """What ``new_hasher`` returns: the part of hashlib's interface ckptsdk uses."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


#: What ckptsdk uses for every digest it computes itself: a few percent of a disk write, where
#: sha256 costs ~0.9x of one.
DEFAULT = "xxh3-128"
#: name -> hasher factory. sha256 for older manifests and published checksums; md5 only because
#: published dataset checksums (torchvision's) use it.
ALGORITHMS: dict[str, Callable[[], Hasher]] = {
    "xxh3-128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
    "md5": hashlib.md5,
}
#: What a checkpoint's files (a manifest's ``files[].algorithm``) may be verified with: what
#: some ckptsdk wrote there (sha256 by older versions, xxh3-128 since). Not md5: no ckptsdk ever
#: wrote it for a checkpoint, so a manifest naming it was not written by ckptsdk, and md5
#: collisions are cheap to make.
CHECKPOINT_ALGORITHMS: tuple[str, ...] = ("xxh3-128", "sha256")


def new_hasher(algorithm: str, *, among: Collection[str] = ALGORITHMS) -> Hasher:
    """A fresh hasher (``update``/``hexdigest``) for ``algorithm``.

    Args:
        algorithm: a key of ``ALGORITHMS``.
        among: the algorithms the caller accepts (``CHECKPOINT_ALGORITHMS`` for checkpoint files).

    Raises:
        ConfigError: an algorithm outside ``among``; says which ones are accepted.

    Example:
        >>> new_hasher("sha256").hexdigest()[:8]
        'e3b0c442'
        >>> new_hasher("md5", among=CHECKPOINT_ALGORITHMS)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ckptsdk.errors.ConfigError: unknown digest algorithm 'md5'; this ckptsdk knows xxh3-128, sha256 here...
    """
    if algorithm not in among or algorithm not in ALGORITHMS:
        raise ConfigError(
            f"unknown digest algorithm {algorithm!r}; this ckptsdk knows {', '.join(among)} here. "
            "A manifest naming another one was written by a newer ckptsdk or by another tool: "
            "upgrade ckptsdk to read it, or re-save the checkpoint"
        )
    return ALGORITHMS[algorithm]()
