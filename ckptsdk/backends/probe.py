"""Proof, at open, that a store's conditional writes hold: a writer trusts no server's word for it.

A backend whose preconditions are evaluated by a server we do not control (``remote_conditions``:
GCS, S3 and S3-compatibles) is probed once per store per process, before a writer takes the
lease: a few small calls on a probe key under the root. A store that fails is refused for writing
with :class:`~ckptsdk.errors.PreconditionsNotHonoured`; ``preconditions="advisory"`` (see
``open_backend``) is the user's explicit word to use it with the advisory lease instead. What the
lease does with the capabilities belongs in ``ckptsdk/lease/``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid

from ckptsdk.backends.base import Backend, Capabilities
from ckptsdk.errors import BackendError, ObjectNotFound, PreconditionFailed, PreconditionsNotHonoured

logger = logging.getLogger(__name__)

__all__ = ["prove_preconditions", "advisory", "forget_proofs", "PROBE_PREFIX", "ADVISORY"]

PROBE_PREFIX = "PRECONDITION-PROBE."
ADVISORY = "advisory"  # the value of the storage option / CKPTSDK_PRECONDITIONS that opts in
_proven: set[tuple[str, str]] = set()
_lock = threading.Lock()


def advisory(caps: Capabilities) -> Capabilities:
    """``caps`` as the user declared them with ``preconditions="advisory"``: nothing conditional.

    The lease then works as on Drive (write, use at once, read back in the background after the
    settle; ttl 45 s, settle 60 s) and lineage keeps the rotation safe; docs/GUARANTEES.md says
    what that promises and what not.
    """
    return dataclasses.replace(caps, exclusive_create=False, compare_and_swap=False, immediately_consistent=False)


def forget_proofs() -> None:
    """Forget which stores this process has proven, so the next open probes again.

    For benchmarks that time a first open, as a fresh process sees it (``benchmarks/bench_stores.py``).
    """
    with _lock:
        _proven.clear()


def prove_preconditions(backend: Backend) -> None:
    """Prove that ``backend`` rejects a second create-if-absent and a stale replace.

    Does nothing for backends whose conditions this code enforces itself (local disk, memory),
    for those that claim none (Drive, advisory), and for a store already proven in this process.
    About five small requests otherwise; the probe object is deleted afterwards.

    Raises:
        PreconditionsNotHonoured: the store ignored a condition; the message says which and the
            user's two choices.
        BackendError: the store failed otherwise (unreachable, missing bucket...).
    """
    caps = backend.capabilities
    if not caps.remote_conditions or not (caps.exclusive_create or caps.compare_and_swap):
        return
    ident = (backend.url, repr(backend))
    with _lock:
        if ident in _proven:
            return
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    lacks: list[str] = []
    try:
        first = backend.create(key, b"probe 1 " + key.encode())
        try:
            backend.create(key, b"probe 2 " + key.encode())
            lacks.append("create-if-absent (a second create of one key succeeded instead of failing)")
        except PreconditionFailed:
            pass
        current = backend.stat(key).version
        backend.replace(key, b"probe 3 " + key.encode(), current)
        try:
            backend.replace(key, b"probe 4 " + key.encode(), current)
            lacks.append("compare-and-swap (a replace conditioned on a stale version succeeded)")
        except PreconditionFailed:
            pass
        del first
    except PreconditionFailed as exc:
        lacks.append(f"a fresh conditional write failed ({exc})")
    finally:
        try:
            backend.delete(key)
        except ObjectNotFound:
            pass
        except BackendError as exc:
            logger.warning("could not delete the precondition probe %r in %s: %s", key, backend.url, exc)
    if lacks:
        raise PreconditionsNotHonoured(refusal(backend, lacks), url=backend.url, key=key, lacks=tuple(lacks))
    with _lock:
        _proven.add(ident)
    logger.debug("preconditions proven on %r", backend)


def refusal(backend: Backend, lacks: list[str]) -> str:
    """The message of a refused store: what it lacks and the user's two choices."""
    return (
        f"{backend.url} cannot be opened for writing: the store ({backend!r}) does not honour "
        f"{'; nor '.join(lacks)}. The writer lease's compare-and-swap would be silently void there and "
        "two writers could both believe they hold it. Choose one: (1) a store that honours "
        "preconditions (AWS S3, GCS, MinIO, Cloudflare R2; to try locally, the patched servers "
        "`python -m ckptsdk.testing.s3_server` or `python -m ckptsdk.testing.gcs_server`); or (2) the "
        "advisory lease with its weaker promise (docs/GUARANTEES.md, 'Advisory lease'): pass "
        "storage_options={'preconditions': 'advisory'} or set CKPTSDK_PRECONDITIONS=advisory. "
        "Reading needs neither: open it with read_only=True"
    )
