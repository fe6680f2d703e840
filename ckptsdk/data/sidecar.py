"""The local side of the data cache: the sidecar record next to each local copy, and temp names.

A local copy ``{local_dir}/{name}`` is trusted only with its sidecar ``{local_dir}/.ckptsdk/{name}.json``
(a ``CacheEntry``); this module reads and writes that file. What the record holds belongs to
``ckptsdk.data.entry``; finding, copying and verifying artifacts to ``ckptsdk.data.cache``.
"""

from __future__ import annotations

import logging
import os
import time

from ckptsdk.data.entry import CacheEntry, parse_entry
from ckptsdk.errors import DataError

logger = logging.getLogger(__name__)

__all__ = ["TMP_MARK", "read_sidecar", "sidecar_path", "write_sidecar"]

TMP_MARK = ".ckptsdk-tmp."  # local temp files start their suffix with this (same prefix as backends use)


def sidecar_path(local_dir: str, name: str) -> str:
    return os.path.join(local_dir, ".ckptsdk", name + ".json")


def read_sidecar(local_dir: str, name: str) -> CacheEntry | None:
    path = sidecar_path(local_dir, name)
    try:
        with open(path, "rb") as f:
            return parse_entry(f.read(), path)
    except FileNotFoundError:
        return None
    except (OSError, DataError) as exc:  # not trusted: the copy is fetched again
        logger.warning("ignoring the local record %s: %s", path, exc)
        return None


def write_sidecar(local_dir: str, name: str, *, algorithm: str, digest: str, size: int, source: str) -> None:
    path = sidecar_path(local_dir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    entry = CacheEntry(name=name, size=size, algorithm=algorithm, digest=digest, source=source, stored_at=time.time())
    with open(tmp, "wb") as f:
        f.write(entry.to_json())
    os.replace(tmp, path)
