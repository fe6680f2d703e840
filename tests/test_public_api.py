"""The public surface is curated: adding or removing a name is a deliberate change here."""

import ckptsdk

EXPECTED = {
    "AuditReport", "BackendError", "CheckpointInfo", "CheckpointManager", "CkptError",
    "CorruptCheckpointError", "DataCache", "DataError", "GcReport", "LeaseHeldError",
    "LeaseLostError", "ManifestError", "NoValidCheckpointError", "ObjectNotFound",
    "PreconditionFailed", "ResumePoint", "StateMismatchError", "TrainState",
    "UnsupportedStateError", "open_backend",
}


def test_all_is_locked():
    assert set(ckptsdk.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(ckptsdk, name) is not None


def test_audit_is_a_module_and_a_manager_method():
    import ckptsdk.audit

    assert callable(ckptsdk.audit.audit) and callable(ckptsdk.CheckpointManager.audit)


def test_errors_refine_builtins():
    assert issubclass(ckptsdk.ObjectNotFound, FileNotFoundError)
    assert issubclass(ckptsdk.UnsupportedStateError, TypeError)
    assert issubclass(ckptsdk.LeaseLostError, ckptsdk.CkptError)
