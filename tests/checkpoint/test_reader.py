"""The reader on its own: picking a checkpoint, reading it verified, falling back, the verdicts.

A real :class:`~ckptsdk.CheckpointManager` (heartbeat off) writes ``memory://`` roots; damage is
made by hand as storage would make it (a flipped byte keeps the size, so only the digest can tell).
A failure is never a part of a state: every test that damages a checkpoint checks what is read.
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
from ckptsdk.checkpoint.reading.reader import CheckpointReader, resume_point
from ckptsdk.errors import CorruptCheckpointError, ManifestError, NoValidCheckpointError
from ckptsdk.format.manifest import parse_manifest
from ckptsdk.manager import Simulation


@pytest.fixture
def url() -> Iterator[str]:
    store = f"reader-{uuid.uuid4().hex}"
    yield f"memory://{store}"
    MemoryBackend.discard_store(store)


def _weights(step: int) -> torch.Tensor:
    return torch.full((3, 4), float(step))


def _saved(url: str, steps: list[int]) -> Backend:
    """Steps saved by one writer; the weight of step S is filled with S, so a read names its step."""
    mgr = CheckpointManager(url, keep_last=10, _simulation=Simulation(heartbeat=False))
    model = torch.nn.Linear(4, 3)
    state = TrainState(model=model)
    for step in steps:
        with torch.no_grad():
            model.weight.copy_(_weights(step))
        mgr.save(state, step=step, epoch=step // 10, batch_idx=step % 10, metrics={"loss": 1.0 / step})
    mgr.close()
    return open_backend(url)


def _step_of(tree: object) -> int:
    """Which step's weights a loaded tree holds."""
    assert isinstance(tree, dict)
    weight = tree["objects"]["model"]["weight"]
    assert isinstance(weight, torch.Tensor)
    values = set(weight.flatten().tolist())
    assert len(values) == 1, f"a mixed tensor: {values}"
    return int(values.pop())


def _flip_a_byte(backend: Backend, key: str) -> None:
    data = bytearray(backend.read(key))
    data[-1] ^= 0xFF
    backend.write(key, bytes(data))


def test_an_empty_root_has_nothing_to_read(url: str) -> None:
    reader = CheckpointReader(open_backend(url))
    assert reader.list() == [] and reader.latest() is None
    with pytest.raises(NoValidCheckpointError) as info:
        reader.load()
    assert info.value.tried == {}  # a fresh start, not damage
    with pytest.raises(NoValidCheckpointError):
        reader.pick(None)


def test_load_reads_the_newest_or_the_step_asked_for(url: str) -> None:
    reader = CheckpointReader(_saved(url, [10, 20, 30]))
    assert [c.step for c in reader.list()] == [10, 20, 30]
    latest = reader.latest()
    assert latest is not None and latest.step == 30
    assert _step_of(reader.load()) == 30
    assert _step_of(reader.load(20)) == 20
    assert reader.load_manifest(10).step == 10 and reader.load_manifest().step == 30


def test_a_missing_step_names_the_steps_there_are(url: str) -> None:
    reader = CheckpointReader(_saved(url, [10]))
    with pytest.raises(NoValidCheckpointError, match="no readable checkpoint of step 15") as info:
        reader.load(15)
    assert "ckptsdk ls" in str(info.value) and info.value.tried == {}


def test_load_falls_back_past_a_checkpoint_that_fails_its_digest(url: str, caplog: pytest.LogCaptureFixture) -> None:
    backend = _saved(url, [10, 20])
    _flip_a_byte(backend, "step-0000000020.e1/tensors.safetensors")
    reader = CheckpointReader(backend)
    assert reader.latest() is not None and reader.latest().step == 20  # type: ignore[union-attr]  # sizes agree
    with caplog.at_level("WARNING", logger="ckptsdk.checkpoint.reading.reader"):
        assert _step_of(reader.load()) == 10
    assert any("step-0000000020.e1" in r.getMessage() for r in caplog.records)
    # Asked for by step, the damaged one fails loudly; nothing of it is returned.
    with pytest.raises(CorruptCheckpointError) as info:
        reader.load(20)
    assert info.value.key == "step-0000000020.e1/tensors.safetensors" and "digest" in str(info.value)
    with pytest.raises(CorruptCheckpointError):
        reader.verify(20)
    assert reader.verify(10).step == 10


def test_when_every_checkpoint_is_damaged_each_is_named(url: str) -> None:
    backend = _saved(url, [10, 20])
    _flip_a_byte(backend, "step-0000000010.e1/tensors.safetensors")
    backend.delete("step-0000000020.e1/tensors.safetensors")
    with pytest.raises(NoValidCheckpointError) as info:
        CheckpointReader(backend).load()
    assert set(info.value.tried) == {"step-0000000010.e1", "step-0000000020.e1"}
    assert info.value.tried["step-0000000020.e1"] == "torn: tensors.safetensors is missing"
    assert "ckptsdk verify" in str(info.value)


def test_a_tree_that_does_not_match_its_tensors_is_corrupt(url: str) -> None:
    backend = _saved(url, [10, 20])
    # Step 20's manifest, sealed correctly, with a tree that lost a leaf (a momentum buffer, say):
    # every digest passes, but the state would be partial. It must not be restored.
    manifest = parse_manifest(backend.read("step-0000000020.e1/manifest.json"))
    tree = manifest.tree
    assert isinstance(tree, dict)
    pruned = _drop_one_tensor(tree)
    backend.write("step-0000000020.e1/manifest.json", manifest.model_copy(update={"tree": pruned}).to_json())
    reader = CheckpointReader(backend)
    with pytest.raises(CorruptCheckpointError, match="does not match its tensors"):
        reader.load(20)
    assert _step_of(reader.load()) == 10


def _drop_one_tensor(tree: dict[str, object]) -> dict[str, object]:
    """``tree`` without the first tensor reference found (depth first)."""

    def walk(node: object) -> tuple[object, bool]:
        if isinstance(node, dict):
            out: dict[str, object] = {}
            dropped = False
            for k, v in node.items():
                if not dropped and _is_tensor_ref(v):
                    dropped = True
                    continue
                if not dropped:
                    v, dropped = walk(v)
                out[k] = v
            return out, dropped
        return node, False

    result, dropped = walk(tree)
    assert dropped and isinstance(result, dict)
    return result


def _is_tensor_ref(node: object) -> bool:
    return isinstance(node, dict) and "$tensor" in node  # the codec's reference to a tensor (docs/FORMAT.md)


def test_verdicts_for_ok_uncommitted_torn_and_corrupt(url: str) -> None:
    backend = _saved(url, [10, 20, 30])
    backend.delete("step-0000000020.e1/tensors.safetensors")
    _flip_a_byte(backend, "step-0000000030.e1/tensors.safetensors")
    backend.write("step-0000000040.e1/tensors.safetensors", b"a save in progress")
    reader = CheckpointReader(backend)
    verdicts = {c.step: reader.check(c) for c in reader.list()}
    assert (verdicts[10].status, verdicts[10].reason, verdicts[10].rehashed) == ("ok", None, True)
    assert (verdicts[20].status, verdicts[20].rehashed) == ("CORRUPT", False)  # torn: judged by its listing
    assert verdicts[20].reason == "torn: tensors.safetensors is missing"
    assert (verdicts[30].status, verdicts[30].rehashed) == ("CORRUPT", True)
    assert (verdicts[40].status, verdicts[40].rehashed) == ("uncommitted", False)


def test_a_key_picks_one_folder_and_a_bad_key_says_why(url: str) -> None:
    reader = CheckpointReader(_saved(url, [10, 20]))
    assert reader.pick(None, key="step-0000000010.e1/").step == 10
    assert reader.verify(key="step-0000000020.e1").key == "step-0000000020.e1"
    with pytest.raises(NoValidCheckpointError, match="no such checkpoint folder") as info:
        reader.pick(None, key="step-0000000099.e1")
    assert info.value.tried == {"step-0000000099.e1": "no such checkpoint folder"}


def test_a_manifest_without_a_tensor_file_is_a_manifest_error(url: str) -> None:
    backend = _saved(url, [10])
    manifest = parse_manifest(backend.read("step-0000000010.e1/manifest.json"))
    backend.write("step-0000000010.e1/manifest.json", manifest.model_copy(update={"files": []}).to_json())
    info = scan(backend).find(10)[0]
    with pytest.raises(ManifestError, match="lists no tensors.safetensors"):
        CheckpointReader(backend).read_tree(info)


def test_resume_point_carries_the_position_and_metrics(url: str) -> None:
    backend = _saved(url, [10, 25])
    info = scan(backend).find(25)[0]
    pos = resume_point(info)
    assert (pos.step, pos.epoch, pos.batch_idx, pos.key, pos.lease_epoch) == (25, 2, 5, "step-0000000025.e1", 1)
    assert pos.metrics == {"loss": pytest.approx(1.0 / 25)}
