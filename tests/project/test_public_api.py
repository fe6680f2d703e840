"""The public surface is curated: adding or removing a name is a deliberate change here."""

import ckptsdk

EXPECTED = {
    "AuditReport",
    "BackendError",
    "CheckpointInfo",
    "CheckpointManager",
    "CkptError",
    "CorruptCheckpointError",
    "DataCache",
    "DataError",
    "DataLoader",
    "GcReport",
    "LeaseHeldError",
    "LeaseLostError",
    "ManifestError",
    "NoValidCheckpointError",
    "ObjectNotFound",
    "PreconditionFailed",
    "ResumePoint",
    "StateMismatchError",
    "TrainState",
    "UnsupportedStateError",
    "open_backend",
    # CheckpointManager's option groups (the flat keywords are their shorthand)
    "LeaseOptions",
    "Retention",
    "SaveOptions",
    # the keep rules' module: keep=[keep.best("val_loss", 2), keep.every(1000)]
    "keep",
    # the rest of the error tree: every error a public call raises is catchable as ckptsdk.X
    "AllSourcesFailedError",
    "CheckpointError",
    "CheckpointTooLargeError",
    "ConfigError",
    "DatasetMismatchError",
    "DeadlineExceeded",
    "DigestMismatchError",
    "DownloadError",
    "InvalidKey",
    "LeaseError",
    "MissingDependencyError",
    "NewerFormatError",
    "NoCheckpointRootError",
    "StorageUnavailable",
    "PreconditionsNotHonoured",
    "UnknownSchemeError",
    "UnsafeArchiveError",
}


def test_all_is_locked():
    assert set(ckptsdk.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(ckptsdk, name) is not None


def test_dir_lists_the_lazy_names_before_their_first_use():
    import subprocess
    import sys

    code = (
        "import sys, ckptsdk; names = dir(ckptsdk); "
        "assert 'ckptsdk.manager' not in sys.modules and 'ckptsdk.keep' not in sys.modules; print(names)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    names = eval(out.stdout)
    assert set(ckptsdk.__all__) <= set(names)
    assert {"CheckpointManager", "TrainState", "keep", "__version__"} <= set(names)


def test_keep_is_a_public_submodule_reached_as_an_attribute():
    import ckptsdk.checkpoint.retention as retention

    assert ckptsdk.keep.__name__ == "ckptsdk.keep"
    from ckptsdk import keep

    assert keep is ckptsdk.keep
    assert keep.every(1000) == retention.keep_every(1000)
    assert keep.last(3) == retention.keep_last(3)
    assert keep.every_seconds(60) == retention.keep_every_seconds(60)
    assert keep.best("val_loss", 2) == retention.keep_best("val_loss", 2, "min")
    assert keep.best("acc").mode == "max"
    predicate = lambda c: c.step == 7  # noqa: E731
    assert keep.when(predicate, name="seven") == retention.keep_if(predicate, "seven")


def test_audit_is_a_module_and_a_manager_method():
    import ckptsdk.runlog.audit

    assert callable(ckptsdk.runlog.audit.audit) and callable(ckptsdk.CheckpointManager.audit)


def test_errors_refine_builtins():
    assert issubclass(ckptsdk.ObjectNotFound, FileNotFoundError)
    assert issubclass(ckptsdk.UnsupportedStateError, TypeError)
    assert issubclass(ckptsdk.LeaseLostError, ckptsdk.CkptError)


def test_every_error_of_the_tree_is_public():
    import ckptsdk.errors

    tree = {
        n for n, v in vars(ckptsdk.errors).items() if isinstance(v, type) and issubclass(v, ckptsdk.errors.CkptError)
    }
    assert tree <= set(ckptsdk.__all__), sorted(tree - set(ckptsdk.__all__))
    for name in tree:
        assert getattr(ckptsdk, name) is getattr(ckptsdk.errors, name)


def test_the_errors_the_readme_names_are_catchable():
    with __import__("pytest").raises(ckptsdk.UnknownSchemeError):
        ckptsdk.open_backend("nope://x")
    with __import__("pytest").raises(ckptsdk.ConfigError):
        ckptsdk.CheckpointManager("memory://api-cfg", keep_last=0)


def test_simulation_hooks_are_off_the_public_signatures():
    """A job cannot turn the lease heartbeat off or fake its clock by a public keyword: tests
    and benchmarks pass ``_simulation=ckptsdk.manager.Simulation(...)``."""
    import inspect

    from ckptsdk.distributed import DistributedCheckpointManager
    from ckptsdk.manager import Simulation

    for cls in (ckptsdk.CheckpointManager, DistributedCheckpointManager):
        params = inspect.signature(cls).parameters
        assert not {"heartbeat", "clock", "sleep"} & set(params), cls
        assert params["_simulation"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["_simulation"].default is None
    assert Simulation().heartbeat is True


def test_version_has_one_home_and_matches_pyproject():
    import pathlib
    import tomllib

    from ckptsdk._version import __version__

    pyproject = pathlib.Path(ckptsdk.__file__).resolve().parents[1] / "pyproject.toml"
    assert ckptsdk.__version__ is __version__
    assert tomllib.loads(pyproject.read_text())["project"]["version"] == __version__
