"""The catalog on its own: what ``scan`` says a root holds, through its public functions.

Roots are written by a real :class:`~ckptsdk.CheckpointManager` on ``memory://`` (heartbeat off:
nothing runs behind the test's back), then damaged or extended by hand the way a crash, a torn
upload or a zombie writer's late commit would leave them. Folder names are spelled out literally:
they are the on-storage format, and a test that computed them would agree with any change.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from ckptsdk import CheckpointManager, TrainState
from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.format.manifest import parse_lineage, parse_manifest
from ckptsdk.manager import Simulation
from ckptsdk.testing.counting import CountingBackend


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    return TrainState(model=torch.nn.Linear(4, 3))


def _writer(url: str, **kw: object) -> CheckpointManager:
    return CheckpointManager(url, keep_last=10, _simulation=Simulation(heartbeat=False), **kw)  # type: ignore[arg-type]


@pytest.fixture
def url() -> Iterator[str]:
    store = f"catalog-{uuid.uuid4().hex}"
    yield f"memory://{store}"
    MemoryBackend.discard_store(store)


def _saved(url: str, steps: list[int]) -> Backend:
    """A root where one writer (epoch 1) committed ``steps`` and closed."""
    mgr = _writer(url)
    state = _state()
    for step in steps:
        mgr.save(state, step=step)
    mgr.close()
    return open_backend(url)


def _late_commit(backend: Backend, source: tuple[bytes, bytes], folder: str, step: int) -> None:
    """A commit of ``step`` into ``folder``, made of an earlier checkpoint's (tensors, manifest):
    what a writer that kept running after a takeover (a zombie) leaves once its upload lands."""
    tensors, manifest = source
    backend.write(f"{folder}/tensors.safetensors", tensors)
    backend.write(f"{folder}/manifest.json", parse_manifest(manifest).model_copy(update={"step": step}).to_json())


def test_an_empty_root_holds_nothing(url: str) -> None:
    cat = scan(open_backend(url))
    assert cat.checkpoints == [] and cat.restorable() == [] and cat.rows() == []
    assert cat.max_rank == (0, "") and cat.epoch_floor == 0
    assert cat.store_now() is None


def test_committed_checkpoints_are_listed_valid_newest_first(url: str) -> None:
    backend = _saved(url, [10, 20, 30])
    cat = scan(backend)
    assert [c.key for c in cat.checkpoints] == ["step-0000000010.e1", "step-0000000020.e1", "step-0000000030.e1"]
    assert all(c.committed and c.valid and c.reason is None and not c.orphan for c in cat.checkpoints)
    assert [c.step for c in cat.restorable()] == [30, 20, 10]
    assert [c.step for c in cat.rows()] == [10, 20, 30]
    assert cat.max_rank == (1, "") and cat.max_epoch == 1
    newest = cat.restorable()[0]
    assert newest.manifest is not None and newest.manifest.step == 30 and newest.epoch == 1 and newest.tag == ""
    assert newest.size == sum(o.size for o in backend.list("step-0000000030.e1/"))
    assert cat.find(20)[0].key == "step-0000000020.e1" and cat.find(25) == []


def test_a_folder_without_manifest_is_uncommitted_never_restorable(url: str) -> None:
    backend = _saved(url, [10])
    backend.write("step-0000000020.e1/tensors.safetensors", b"half an upload")
    cat = scan(backend)
    (c,) = cat.find(20)
    assert not c.committed and not c.valid and c.reason is not None and c.reason.startswith("uncommitted")
    assert [r.step for r in cat.restorable()] == [10]


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_a_torn_checkpoint_is_invalid_and_the_previous_one_restorable(url: str, damage: str) -> None:
    backend = _saved(url, [10, 20])
    key = "step-0000000020.e1/tensors.safetensors"
    size = backend.stat(key).size
    if damage == "missing":
        backend.delete(key)
        expected = "torn: tensors.safetensors is missing"
    else:
        backend.write(key, backend.read(key)[:-7])
        expected = f"torn: tensors.safetensors has {size - 7} bytes, the manifest says {size}"
    cat = scan(backend)
    (c,) = cat.find(20)
    assert c.committed and not c.valid and c.reason == expected
    assert [r.step for r in cat.restorable()] == [10]
    assert backend.exists("step-0000000020.e1/manifest.json")  # scanning is read-only


def test_an_unreadable_manifest_is_invalid_with_why(url: str) -> None:
    backend = _saved(url, [10, 20])
    backend.write("step-0000000020.e1/manifest.json", b'{"format": "ckptsdk.manifest/1", "step": ')
    (c,) = scan(backend).find(20)
    assert c.committed and not c.valid and c.manifest is None
    assert c.reason is not None and c.reason.startswith("bad manifest")


def test_a_manifest_in_another_steps_folder_is_refused(url: str) -> None:
    backend = _saved(url, [10, 20])
    backend.write("step-0000000030.e1/tensors.safetensors", backend.read("step-0000000020.e1/tensors.safetensors"))
    backend.write("step-0000000030.e1/manifest.json", backend.read("step-0000000020.e1/manifest.json"))
    (c,) = scan(backend).find(30)
    assert not c.valid
    assert c.reason == "manifest says step 20 epoch 1 but lives in the folder of step 30 epoch 1"


def test_names_that_are_not_checkpoint_folders_are_ignored(url: str) -> None:
    backend = _saved(url, [10])
    for key in ("step-10/manifest.json", "step-0000000010.eX/manifest.json", "step-0000000010.e1/sub/x", "stepx"):
        backend.write(key, b"{}")
    assert [c.key for c in scan(backend).checkpoints] == ["step-0000000010.e1"]


def test_a_zombies_late_commits_past_the_takeover_are_orphans(url: str) -> None:
    backend = _saved(url, [10, 20])
    zombie = (backend.read("step-0000000020.e1/tensors.safetensors"), backend.read("step-0000000020.e1/manifest.json"))
    taker = _writer(url)
    assert taker.restore(_state()) is not None  # takes over from step 20: the lineage says so
    taker.save(_state(), step=30)
    taker.close()
    # The first writer never saw the takeover; its saves of 30 and 40 land afterwards.
    _late_commit(backend, zombie, "step-0000000030.e1", 30)
    _late_commit(backend, zombie, "step-0000000040.e1", 40)
    cat = scan(backend)
    assert cat.resume_points[(2, "")] == 20
    assert cat.lineage[(2, "")].resumed_from_step == 20
    orphans = {c.key for c in cat.checkpoints if c.orphan}
    assert orphans == {"step-0000000030.e1", "step-0000000040.e1"}
    for c in cat.checkpoints:
        if c.orphan:
            assert not c.valid and c.reason is not None and "orphan" in c.reason and "step 20" in c.reason
    # The newest restorable is the taker's, though the zombie's step 40 is higher.
    assert [(c.step, c.epoch) for c in cat.restorable()][:2] == [(30, 2), (20, 2)]
    assert cat.find(20)[0].anchor and cat.find(20)[0].epoch == 2  # the taker's re-commit of its resume point
    assert cat.max_rank == (2, "")


def test_a_stray_lineage_record_cannot_erase_a_runs_progress(url: str, caplog: pytest.LogCaptureFixture) -> None:
    backend = _saved(url, [10, 20])
    real = parse_lineage(backend.read("lineage/epoch-000001.json"))
    # A record for an epoch nobody holds, claiming a fresh start: believed, it would orphan all.
    stray = real.model_copy(update={"epoch": 999, "resumed_from_step": None, "resumed_from_epoch": None})
    backend.write("lineage/epoch-000999.json", stray.to_json())
    with caplog.at_level("WARNING", logger="ckptsdk.checkpoint.reading"):
        cat = scan(backend)
    assert (999, "") in cat.ignored_lineage and "cannot erase a run's progress" in cat.ignored_lineage[(999, "")]
    assert [c.step for c in cat.restorable()] == [20, 10]
    assert not any(c.orphan for c in cat.checkpoints)
    assert cat.max_rank == (1, "")  # not a newer writer: nobody is fenced by it
    # ... where the lease is exclusive; on Drive every record fences (test_stray_lineage_drive.py)
    assert cat.fencing_rank == ((1, "") if backend.capabilities.compare_and_swap else (999, ""))
    assert cat.epoch_floor == 999  # but its epoch is used up: the next writer takes one above


def test_leftovers_name_only_folders_that_can_never_commit(url: str) -> None:
    backend = _saved(url, [10])
    backend.write("step-0000000020.e1/tensors.safetensors", b"a killed save of epoch 1")
    backend.write("step-0000000030.e3/tensors.safetensors", b"a higher writer, mid-save")
    cat = scan(backend)
    mine = cat.leftovers(rank=(1, ""), grace=3600.0, exclusive=True)
    assert [(c.key, why) for c, why in mine] == [("step-0000000020.e1", "uncommitted: this writer's own failed save")]
    # The writer's own save in flight is not a leftover.
    assert cat.leftovers(rank=(1, ""), grace=3600.0, exclusive=True, busy=["step-0000000020.e1"]) == []
    # Epoch 2 holds a compare-and-swap lease: epoch 1's folder can never commit; epoch 3's is never touched.
    assert [c.key for c, _ in cat.leftovers(rank=(2, ""), grace=3600.0, exclusive=True)] == ["step-0000000020.e1"]
    # Without the lease (gc), and without exclusion: only after the grace, by the store's clock.
    now = cat.store_now()
    assert now is not None
    assert cat.leftovers(rank=None, grace=3600.0, exclusive=False, now=now) == []
    late = cat.leftovers(rank=None, grace=3600.0, exclusive=False, now=now + 7200.0)
    assert sorted(c.key for c, _ in late) == ["step-0000000020.e1", "step-0000000030.e3"]
    assert all("silent for" in why for _, why in late)


def test_rows_show_each_step_once_with_its_other_folders(url: str) -> None:
    backend = _saved(url, [10, 20])
    backend.write("step-0000000020.e2/tensors.safetensors", b"a newer writer's uncommitted copy")
    rows = scan(backend).rows()
    assert [(r.step, r.key, r.copies) for r in rows] == [
        (10, "step-0000000010.e1", ()),
        (20, "step-0000000020.e1", ("step-0000000020.e2",)),  # the valid folder wins over a higher one
    ]


def test_a_memo_rereads_only_what_changed_and_forgets_what_is_gone(url: str) -> None:
    _saved(url, [10, 20, 30])
    counting = CountingBackend(open_backend(url))
    memo: dict[tuple[str, str], object] = {}
    first = scan(counting, cache=memo)  # type: ignore[arg-type]
    reads = counting.calls["read"]
    assert reads >= 3  # every manifest once (and the lineage record)
    second = scan(counting, cache=memo)  # type: ignore[arg-type]
    assert counting.calls["read"] == reads, "an unchanged root was read again"
    assert [c.key for c in second.checkpoints] == [c.key for c in first.checkpoints]
    counting.delete("step-0000000010.e1/manifest.json")
    counting.delete("step-0000000010.e1/tensors.safetensors")
    third = scan(counting, cache=memo)  # type: ignore[arg-type]
    assert [c.step for c in third.checkpoints] == [20, 30]
    assert not any(key.startswith("step-0000000010.e1/") for key, _version in memo)
