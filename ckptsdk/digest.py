"""The one table of digest algorithms ckptsdk computes and checks (tensor files, data cache).

What a digest covers, and when it is checked, belongs to the caller (tensorfile, datacache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import xxhash

from .errors import ConfigError

__all__ = ["ALGORITHMS", "DEFAULT", "new_hasher"]

#: What ckptsdk uses for every digest it computes itself: a few percent of a disk write, where
#: sha256 costs ~0.9x of one.
DEFAULT = "xxh3-128"
#: name -> hasher factory. sha256 for older manifests and published checksums; md5 only because
#: published dataset checksums (torchvision's) use it.
ALGORITHMS: dict[str, Callable[[], Any]] = {
    "xxh3-128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
    "md5": hashlib.md5,
}


def new_hasher(algorithm: str) -> Any:
    """A fresh hashlib-style hasher (``update``/``hexdigest``) for ``algorithm``.

    Raises:
        ConfigError: an algorithm this ckptsdk does not know; says which ones it does.

    Example:
        >>> new_hasher("sha256").hexdigest()[:8]
        'e3b0c442'
    """
    try:
        return ALGORITHMS[algorithm]()
    except KeyError:
        raise ConfigError(
            f"unknown digest algorithm {algorithm!r}; this ckptsdk knows {', '.join(ALGORITHMS)}. "
            "A manifest naming another one was written by a newer ckptsdk: upgrade to read it"
        ) from None
