"""Every error ckptsdk raises, in one tree. Nothing else belongs here.

    CkptError                                  anything ckptsdk raises on purpose
     ├── ConfigError (ValueError)              a bad URL, option or argument
     │    └── UnknownSchemeError                open_backend() got a scheme it does not know
     ├── MissingDependencyError (ImportError)  an optional extra is not installed (names the extra)
     ├── BackendError (OSError)                storage failed
     │    ├── ObjectNotFound (FileNotFoundError)    the key does not exist
     │    ├── InvalidKey (ValueError)               '..', absolute or empty key components
     │    ├── PreconditionFailed                    a conditional write/delete lost (GCS 412)
     │    ├── DeadlineExceeded (TimeoutError)       a save (or the stop after a signal) ran out of time
     │    └── StorageUnavailable                    bucket missing, root unreadable, mount gone
     │         └── PreconditionsNotHonoured         the store ignores a condition: refused for writing
     ├── LeaseError
     │    ├── LeaseHeldError                   another live writer holds the lease
     │    └── LeaseLostError                   this writer was fenced; it must stop writing
     ├── CheckpointError
     │    ├── CorruptCheckpointError           size/digest mismatch, torn or missing files
     │    ├── ManifestError                    unreadable, unknown-format or invalid manifest
     │    │    └── NewerFormatError            written by a newer ckptsdk (a newer major format)
     │    ├── NoValidCheckpointError           checkpoints exist but none could be restored
     │    ├── NoCheckpointRootError            nothing is stored at the URL (a typo?)
     │    ├── CheckpointTooLargeError (MemoryError)  verified data this process cannot hold
     │    └── StateMismatchError (ValueError)  the saved tree does not fit the live objects
     ├── UnsupportedStateError (TypeError)     a state leaf the codec refuses (names the path)
     └── DataError                             the data cache and datasets
          ├── DigestMismatchError              bytes differ from the expected digest
          ├── AllSourcesFailedError            every source was tried; lists each and why
          ├── DownloadError                    one URL could not be fetched (after retries)
          ├── UnsafeArchiveError               an archive member escapes its target or links out
          └── DatasetMismatchError             decoded tensors differ from the recorded hash

Errors that refine a builtin also inherit it, so ``except FileNotFoundError`` keeps working.
``MissingDependencyError`` is an ``ImportError``, not a ``ConfigError``: the arguments were fine,
the environment lacks a package, and ``except ImportError`` is how Python code already guards an
optional import. tests/project/test_error_tree.py checks this drawing against the classes.
Each carries the fields a caller needs (``url``, ``key``, ``step``, ``holder``...) and a message
that says what happened, where, and what to do next.
"""

from __future__ import annotations

from typing import Any


class CkptError(Exception):
    """Base of every error ckptsdk raises on purpose."""


class ConfigError(CkptError, ValueError):
    """A URL, option or argument that cannot work."""


class UnknownSchemeError(ConfigError):
    """``open_backend`` got a URL scheme it has no backend for."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class MissingDependencyError(CkptError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, message: str, *, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


class BackendError(CkptError, OSError):
    """A storage operation failed. ``url`` is the backend root, ``key`` the object (or None)."""

    def __init__(self, message: str, *, url: str = "", key: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.key = key

    def __str__(self) -> str:  # OSError.__str__ would print errno fields we never set
        return str(self.args[0]) if self.args else ""


class ObjectNotFound(BackendError, FileNotFoundError):
    """The key does not exist under the backend root."""


class InvalidKey(BackendError, ValueError):
    """A key with '..', a leading '/', a backslash or an empty component."""


class PreconditionFailed(BackendError):
    """A conditional write or delete lost: the object existed, or its version moved on.

    ``expected`` is the version the caller required (``None`` for create-if-absent), ``actual``
    the version found (``None`` when unknown or absent).
    """

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        key: str | None = None,
        expected: str | None = None,
        actual: str | None = None,
    ) -> None:
        super().__init__(message, url=url, key=key)
        self.expected = expected
        self.actual = actual


class DeadlineExceeded(BackendError, TimeoutError):
    """The store did not answer within the deadline of the whole save (``save_deadline``) or of
    what follows a stop signal (``signal_deadline``); nothing was committed after it.

    ``seconds`` is the deadline, ``waited_for`` what was pending when it passed (a request and
    its key, at which store).
    """

    def __init__(
        self, message: str, *, url: str = "", key: str | None = None, seconds: float = 0.0, waited_for: str = ""
    ) -> None:
        super().__init__(message, url=url, key=key)
        self.seconds = seconds
        self.waited_for = waited_for


class StorageUnavailable(BackendError):
    """The storage itself cannot be used: missing bucket, unreadable root, dropped mount."""


class PreconditionsNotHonoured(StorageUnavailable):
    """The store failed the precondition probe (``ckptsdk/backends/probe.py``): a writer is refused.

    ``lacks`` names what it did not honour (create-if-absent, compare-and-swap).
    """

    def __init__(self, message: str, *, url: str = "", key: str | None = None, lacks: tuple[str, ...] = ()) -> None:
        super().__init__(message, url=url, key=key)
        self.lacks = lacks


class LeaseError(CkptError):
    """Problems with the writer lease. ``holder`` is the lease record seen (a dict), if any."""

    def __init__(self, message: str, *, url: str = "", holder: Any = None) -> None:
        super().__init__(message)
        self.url = url
        self.holder = holder


class LeaseHeldError(LeaseError):
    """Another writer holds a live lease on this checkpoint root."""


class LeaseLostError(LeaseError):
    """This writer was fenced (a newer epoch took over); it must stop writing."""

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        holder: Any = None,
        epoch: int | None = None,
        newer_epoch: int | None = None,
    ) -> None:
        super().__init__(message, url=url, holder=holder)
        self.epoch = epoch
        self.newer_epoch = newer_epoch


class CheckpointError(CkptError):
    """Problems with a stored checkpoint. ``url`` is the root, ``step`` the checkpoint's step."""

    def __init__(self, message: str, *, url: str = "", step: int | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.step = step
        self.key = key


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files are missing, torn, or fail their digest."""


class ManifestError(CheckpointError):
    """A manifest that cannot be read: not JSON, wrong fields, or an unknown format version."""


class NewerFormatError(ManifestError):
    """A document of a newer major format than this ckptsdk reads: never damage, never garbage.

    Restore refuses to fall back past such a checkpoint, and ``gc`` and rotation leave it (and
    the shared files it may use) alone: upgrade ckptsdk to read it.
    """


class NoValidCheckpointError(CheckpointError):
    """Checkpoints exist but none can be restored. ``tried`` maps each checkpoint to why."""

    def __init__(self, message: str, *, url: str = "", tried: dict[str, str] | None = None) -> None:
        super().__init__(message, url=url)
        self.tried = dict(tried or {})


class NoCheckpointRootError(CheckpointError):
    """Nothing at all is stored at the URL: no lease, no checkpoint, no step log."""


class CheckpointTooLargeError(CheckpointError, MemoryError):
    """A checkpoint whose bytes are good but larger than the memory this process can allocate.

    Decided before anything is allocated. ``needed`` and ``available`` are in bytes. A file
    that is too large *and* fails its digest is a :class:`CorruptCheckpointError` instead (restore
    falls back); this one stops restore, because an older checkpoint is not what was asked for.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        step: int | None = None,
        key: str | None = None,
        needed: int,
        available: int,
    ) -> None:
        super().__init__(message, url=url, step=step, key=key)
        self.needed = needed
        self.available = available


class StateMismatchError(CheckpointError, ValueError):
    """The saved state does not fit the live objects (missing/unexpected keys, shapes)."""

    def __init__(
        self, message: str, *, url: str = "", step: int | None = None, mismatches: list[str] | None = None
    ) -> None:
        super().__init__(message, url=url, step=step)
        self.mismatches = list(mismatches or [])


class UnsupportedStateError(CkptError, TypeError):
    """A state leaf the codec refuses. ``path`` is where in the tree, ``type_name`` what it was."""

    def __init__(self, message: str, *, path: str, type_name: str) -> None:
        super().__init__(message)
        self.path = path
        self.type_name = type_name


class DataError(CkptError):
    """Problems fetching or verifying data (the data cache, datasets)."""


class DigestMismatchError(DataError):
    """Bytes whose digest differs from the one expected."""

    def __init__(self, message: str, *, source: str = "", expected: str = "", actual: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.expected = expected
        self.actual = actual


class AllSourcesFailedError(DataError):
    """Every source of an artifact failed. ``failures`` maps each source to why."""

    def __init__(self, message: str, *, name: str = "", failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.failures = dict(failures or {})


class DownloadError(DataError):
    """A URL could not be fetched (after retries, or at once for a permanent HTTP error).

    ``url`` is the source, ``status`` the last HTTP status seen (None for network errors),
    ``attempts`` how many requests were made.
    """

    def __init__(self, message: str, *, url: str, status: int | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.attempts = attempts


class UnsafeArchiveError(DataError):
    """An archive member would land outside the target or link out of it."""

    def __init__(self, message: str, *, member: str = "") -> None:
        super().__init__(message)
        self.member = member


class DatasetMismatchError(DataError):
    """Decoded tensors whose hash differs from the pinned or recorded one."""

    def __init__(self, message: str, *, source: str = "", expected: str = "", actual: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.expected = expected
        self.actual = actual
