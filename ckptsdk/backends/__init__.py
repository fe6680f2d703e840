"""Storage backends, chosen by URL. ``open_backend(url)`` is the one door in.

A lazy table maps each URL scheme to the module that implements it, so an optional dependency
(gcsfs, botocore) is imported only when its scheme is used, and a missing one names the extra to install.
Implementations live in sibling modules; the contract in ``base.py``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from ckptsdk.backends.base import Backend, Capabilities, ObjectInfo, check_key
from ckptsdk.backends.probe import ADVISORY, advisory
from ckptsdk.errors import ConfigError, MissingDependencyError, UnknownSchemeError

__all__ = ["Backend", "Capabilities", "ObjectInfo", "open_backend", "check_key", "DRIVE_MOUNT"]

# Where Colab mounts "My Drive". CKPTSDK_DRIVE_ROOT overrides it (tests, other mounts).
DRIVE_MOUNT = "/content/drive/MyDrive"

# scheme -> (module, class, pip extra that provides its dependencies or None)
_REGISTRY: dict[str, tuple[str, str, str | None]] = {
    "file": ("ckptsdk.backends.local", "LocalBackend", None),
    "drive": ("ckptsdk.backends.drive", "DriveBackend", None),
    "memory": ("ckptsdk.backends.memory", "MemoryBackend", None),
    "gs": ("ckptsdk.backends.cloud.gcs", "GCSBackend", "gcs"),
    "s3": ("ckptsdk.backends.cloud.s3", "S3Backend", "s3"),
}


def drive_root() -> str:
    """The Drive mount root: ``$CKPTSDK_DRIVE_ROOT`` if set, else Colab's ``/content/drive/MyDrive``."""
    return os.environ.get("CKPTSDK_DRIVE_ROOT") or DRIVE_MOUNT


def _load(scheme: str, url: str) -> Callable[..., Backend]:
    module_name, class_name, extra = _REGISTRY[scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if extra is None or exc.name is None or exc.name.startswith("ckptsdk"):
            raise
        raise MissingDependencyError(
            f"opening {url!r} needs the optional dependency {exc.name!r}, which is not installed; "
            f"install it with: pip install 'ckptsdk[{extra}]'",
            extra=extra,
        ) from exc
    cls: Callable[..., Backend] = getattr(module, class_name)  # a name in our own table, not a capability
    return cls


def open_backend(url: str, **storage_options: Any) -> Backend:
    """Open the storage at ``url``.

    Args:
        url: a plain path or ``file://PATH`` (local disk); ``drive://REL`` (the Colab Drive mount,
            ``$CKPTSDK_DRIVE_ROOT`` or ``/content/drive/MyDrive``, plus REL); a path under
            ``/content/drive/`` (detected as Drive); ``gs://BUCKET/PREFIX`` (GCS through gcsfs);
            ``s3://BUCKET/PREFIX`` (AWS S3 or an S3-compatible store, through botocore);
            ``memory://NAME`` (in-process, shared by every ``open_backend`` of the same NAME).
        **storage_options: passed to fsspec/gcsfs for ``gs://`` (``endpoint_url``, ``token``,
            ``project``...; ``STORAGE_EMULATOR_HOST`` is honoured too), to botocore for ``s3://``
            (``endpoint_url``, ``region``, ``profile``, keys...; see ``S3Backend``). One is ours:
            ``preconditions="advisory"`` (or ``$CKPTSDK_PRECONDITIONS=advisory``) declares that
            the store's conditional writes are not to be trusted: the backend then claims none,
            the writer lease works as on Drive (advisory, docs/GUARANTEES.md) and no probe runs.

    Returns:
        A :class:`Backend`.

    Raises:
        UnknownSchemeError: the URL has a scheme with no backend.
        ConfigError: the URL is empty (it would mean the current directory).
        MissingDependencyError: the scheme needs an extra that is not installed.

    Example:
        >>> b = open_backend("memory://demo")
        >>> b.write("a/b.txt", b"hi").size
        2
    """
    if not isinstance(url, (str, os.PathLike)):
        raise UnknownSchemeError(f"a storage URL must be a str or path, got {type(url).__name__}", url=str(url))
    url = os.fspath(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    scheme = scheme.lower()
    declared = storage_options.pop("preconditions", None) or os.environ.get("CKPTSDK_PRECONDITIONS") or None
    if declared not in (None, "proven", ADVISORY):
        raise ConfigError(
            f"preconditions={declared!r} for {url!r}: use 'advisory' (trust no conditional write: the "
            "advisory lease of docs/GUARANTEES.md) or leave it out (they are proven at open)"
        )
    backend = _open(url, scheme, rest, storage_options)
    if declared == ADVISORY:
        # An instance attribute shadows the class's record: this store, as the user declared it.
        backend.capabilities = advisory(backend.capabilities)
    return backend


def _open(url: str, scheme: str, rest: str, storage_options: dict[str, Any]) -> Backend:
    if scheme == "file" and not rest.strip():
        # "" would silently mean the current directory (LEASE.json written where the job runs).
        raise ConfigError(
            f"empty storage URL {url!r}: give the checkpoint root explicitly, e.g. './runs/r18', "
            "'/content/drive/MyDrive/runs/r18', 'drive://runs/r18' or 'gs://bucket/runs/r18'"
        )
    if scheme not in _REGISTRY:
        known = ", ".join(f"{s}://" for s in sorted(_REGISTRY))
        raise UnknownSchemeError(
            f"no storage backend for {url!r}: unknown scheme {scheme + '://'!r}. Use a plain path or one of {known}",
            url=url,
        )
    if scheme == "file":
        path = os.path.abspath(os.path.expanduser(rest))
        if path == "/content/drive" or path.startswith("/content/drive/"):
            scheme = "drive"
        cls = _load(scheme, url)
        return cls(path, url=url)
    if scheme == "drive":
        rel = rest.strip("/")
        if rel:
            check_key(rel, url=url)
        path = os.path.join(drive_root(), rel) if rel else drive_root()
        return _load(scheme, url)(path, url=url)
    if scheme == "memory":
        return _load(scheme, url)(rest.strip("/"), url=url)
    return _load(scheme, url)(rest.strip("/"), url=url, **storage_options)
