"""Restore's view of a root (:class:`~ckptsdk.checkpoint.reading.outline.Outline`): one listing, then
manifests read only as the walk reaches them.

Two claims. First, what it says of each folder is what ``scan`` (which reads every manifest)
says, on roots damaged the ways crashes, torn uploads, zombies and stray records damage them.
Second, the cost: storage calls of opening a writer and restoring, counted through
:class:`~ckptsdk.testing.counting.CountingBackend` on a local root, are the same for 3 and 50
checkpoints, with exactly one manifest read (two when the newest fails its digest).
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, TrainState
from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend
from ckptsdk.backends.local import TMP_PREFIX, LocalBackend
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo, scan
from ckptsdk.checkpoint.reading.outline import Outline
from ckptsdk.format.manifest import parse_lineage, parse_manifest
from ckptsdk.manager import Simulation
from ckptsdk.testing.counting import CountingBackend

NO_HEARTBEAT = Simulation(heartbeat=False)


def _state() -> TrainState:
    torch.manual_seed(0)
    return TrainState(model=torch.nn.Linear(4, 3))


def _at(state: TrainState, step: int) -> TrainState:
    with torch.no_grad():
        for p in state.objects["model"].parameters():
            p.fill_(float(step))
    return state


def _step_in(state: TrainState) -> float:
    values = set(state.objects["model"].weight.flatten().tolist())
    assert len(values) == 1, f"a mixed tensor: {values}"
    return values.pop()


def _writer(url: str | Backend, *, keep_last: int = 1000, **kw: object) -> CheckpointManager:
    return CheckpointManager(
        url, keep_last=keep_last, lease_options=LeaseOptions(ttl=60), _simulation=NO_HEARTBEAT, **kw
    )  # type: ignore[arg-type]


def _saved(url: str, steps: list[int]) -> None:
    with _writer(url) as mgr:
        state = _state()
        for step in steps:
            mgr.save(_at(state, step), step=step)


def _late_commit(backend: Backend, source: tuple[bytes, bytes], folder: str, step: int) -> None:
    """A zombie's commit of ``step`` landing after a takeover: an earlier (tensors, manifest) renamed."""
    tensors, manifest = source
    backend.write(f"{folder}/tensors.safetensors", tensors)
    backend.write(f"{folder}/manifest.json", parse_manifest(manifest).model_copy(update={"step": step}).to_json())


def _flip_a_byte(backend: Backend, key: str) -> None:
    data = bytearray(backend.read(key))
    data[-1] ^= 0xFF  # same size: only the digest can tell
    backend.write(key, bytes(data))


@pytest.fixture(params=["memory", "local"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A memory root, and a root on disk (whose folders can exist without any object in them)."""
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    store = f"outline-{uuid.uuid4().hex}"
    yield f"memory://{store}"
    MemoryBackend.discard_store(store)


# ------------------------------------------------------------------ the same verdicts as scan


def _plain(url: str) -> None:
    _saved(url, [10, 20, 30])


def _damaged(url: str) -> None:
    _saved(url, [10, 20, 30, 40, 50])
    b = open_backend(url)
    b.delete("step-0000000050.e1/tensors.safetensors")  # torn: a file missing
    b.write("step-0000000040.e1/manifest.json", b"{not json")  # unreadable manifest
    b.write("step-0000000030.e1/tensors.safetensors", b"short")  # torn: wrong size
    b.write("step-0000000060.e1/tensors.safetensors", b"x")  # uncommitted: a save killed


def _zombie(url: str) -> None:
    _saved(url, [10, 20])
    b = open_backend(url)
    zombie = (b.read("step-0000000020.e1/tensors.safetensors"), b.read("step-0000000020.e1/manifest.json"))
    with _writer(url) as heir:
        state = _state()
        assert heir.restore(state) is not None  # takes over from step 20
        heir.save(_at(state, 30), step=30)
    # The first writer never saw the takeover; its saves of 30 and 40 land afterwards.
    _late_commit(b, zombie, "step-0000000030.e1", 30)
    _late_commit(b, zombie, "step-0000000040.e1", 40)


def _stray_lineage(url: str) -> None:
    _saved(url, [10, 20])
    b = open_backend(url)
    real = parse_lineage(b.read("lineage/epoch-000001.json"))
    stray = real.model_copy(update={"epoch": 999, "resumed_from_step": None, "resumed_from_epoch": None})
    b.write("lineage/epoch-000999.json", stray.to_json())


def _fresh_start_heir(url: str) -> None:
    """A heir that started fresh (no restore): everything of the first writer is an orphan."""
    _saved(url, [10, 20])
    with _writer(url) as heir:
        heir.save(_at(_state(), 5), step=5)


def _folders_without_objects(url: str) -> None:
    """On disk a folder can be named and hold no object: an heir whose first save died with only
    its temp file written (its record says it took over from step 10), and a folder emptied by
    hand. A full listing never sees them; the outline names every folder and must judge alike."""
    _saved(url, [10, 20])
    b = open_backend(url)
    if not isinstance(b, LocalBackend):
        return  # a store of objects has no folder without an object
    real = parse_lineage(b.read("lineage/epoch-000001.json"))
    heir = real.model_copy(update={"epoch": 2, "resumed_from_step": 10, "resumed_from_epoch": 1})
    b.write("lineage/epoch-000002.json", heir.to_json())
    root = Path(b.root)
    (root / "step-0000000030.e2").mkdir()
    (root / "step-0000000030.e2" / f"{TMP_PREFIX}tensors.safetensors.x").write_bytes(b"half")
    (root / "step-0000000040.e1").mkdir()


ROOTS: dict[str, Callable[[str], None]] = {
    "folders-without-objects": _folders_without_objects,
    "plain": _plain,
    "damaged": _damaged,
    "zombie": _zombie,
    "stray-lineage": _stray_lineage,
    "fresh-start-heir": _fresh_start_heir,
}


def _verdict(c: CheckpointInfo) -> tuple[object, ...]:
    return (c.key, c.step, c.rank, c.committed, c.valid, c.reason, c.orphan, c.size)


@pytest.mark.parametrize("root", sorted(ROOTS))
def test_each_folder_is_judged_as_scan_judges_it(url: str, root: str) -> None:
    ROOTS[root](url)
    backend = open_backend(url)
    cat = scan(backend)
    expected = sorted(cat.checkpoints, key=lambda c: (c.step, c.rank), reverse=True)
    outline = Outline(backend)
    assert (outline.max_rank, outline.epoch_floor, outline.ignored_lineage) == (
        cat.max_rank,
        cat.epoch_floor,
        cat.ignored_lineage,
    )
    assert [_verdict(c) for c in outline.newest_first()] == [_verdict(c) for c in expected]
    newest = outline.newest_valid()
    assert newest is not None and cat.restorable() and newest.key == cat.restorable()[0].key


def test_a_zombies_orphan_on_top_is_never_the_newest(url: str) -> None:
    _zombie(url)
    outline = Outline(open_backend(url))
    newest = outline.newest_valid()
    assert newest is not None and (newest.step, newest.epoch) == (30, 2)
    # To judge the zombie's step 40 and 30 it read the heir's manifests (its resume point), no more.
    assert outline.manifests_read <= 4
    with _writer(url, read_only=True) as reader:
        state = _state()
        point = reader.restore(state)
        assert point is not None and (point.step, point.lease_epoch) == (30, 2)
        assert _step_in(state) == 30.0


# ------------------------------------------------------------------ what opening and restoring cost


def _manifest_reads(store: CountingBackend) -> list[str]:
    return [key for op, key in store.ops if op in ("read", "open") and key.endswith("/manifest.json")]


def _open_and_restore(root: Path) -> tuple[CountingBackend, float, list[str]]:
    store = CountingBackend(open_backend(str(root)))
    mgr = _writer(store)
    at_open = _manifest_reads(store)
    state = _state()
    point = mgr.restore(state)
    assert point is not None
    ops = [op for op, _key in store.ops]
    mgr.close()
    assert at_open == [], "opening a writer read manifests"
    return store, _step_in(state), ops


def test_open_and_restore_read_one_manifest_whatever_the_root_holds(tmp_path: Path) -> None:
    counts = {}
    for n in (3, 50):
        root = tmp_path / f"root-{n}"
        _saved(str(root), list(range(1, n + 1)))
        store, restored, ops = _open_and_restore(root)
        assert restored == float(n)
        assert _manifest_reads(store) == [f"step-{n:010d}.e1/manifest.json"]
        # Folder names in one call; the files of the newest folder only, not of every folder.
        listed = [key for op, key in store.ops if op == "list" and key.startswith("step-")]
        assert listed == [f"step-{n:010d}.e1/"], listed
        assert Counter(op for op, _key in store.ops)["list_folders"] == 1
        counts[n] = Counter(ops)
    # Every other call (listings, lineage, lease, the anchor) is the same for 3 and for 50.
    assert counts[3] == counts[50], (counts[3], counts[50])


def test_a_corrupt_newest_falls_back_reading_two_manifests(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    _saved(str(root), list(range(1, 51)))
    _flip_a_byte(open_backend(str(root)), "step-0000000050.e1/tensors.safetensors")
    with caplog.at_level(logging.WARNING, logger="ckptsdk.checkpoint.reading.reader"):
        store, restored, _ops = _open_and_restore(root)
    assert restored == 49.0  # the previous valid one, whole
    assert _manifest_reads(store) == ["step-0000000050.e1/manifest.json", "step-0000000049.e1/manifest.json"]
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "step-0000000050.e1" in skipped[0] and "digest" in skipped[0]


def test_latest_of_a_reader_reads_one_manifest(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _saved(str(root), list(range(1, 21)))
    store = CountingBackend(open_backend(str(root)))
    reader = CheckpointManager(store, read_only=True)
    latest = reader.latest()
    assert latest is not None and latest.step == 20 and latest.valid
    assert _manifest_reads(store) == ["step-0000000020.e1/manifest.json"]
    assert [c.step for c in reader.list()] == list(range(1, 21))  # ls still reads them all


def test_the_memo_keeps_only_what_the_root_holds(url: str) -> None:
    """A reader that restores every few seconds for days reads one manifest each time; the
    memo it shares with scans must not keep every checkpoint it ever saw."""
    backend = open_backend(url)
    memo: dict[tuple[str, str], object] = {}
    with _writer(url, keep_last=2) as mgr:
        state = _state()
        for step in range(1, 8):
            mgr.save(_at(state, step), step=step)
            mgr.wait()  # its rotation (on the worker, after the commit) is done: the root is settled
            newest = Outline(backend, cache=memo).newest_valid()
            assert newest is not None and newest.step == step
    listed = {(o.key, o.version) for o in backend.list("")}
    assert memo and set(memo) <= listed, sorted(set(memo) - listed)


def test_a_listing_keeps_the_direct_files_of_checkpoint_folders_only(tmp_path: Path) -> None:
    """Stray folders, files beside the folders and files nested deeper inside a checkpoint folder
    stay out of a listing, whatever order they come in (``parse_folder`` is memoised)."""
    from ckptsdk.checkpoint.reading.listing import list_root
    from ckptsdk.format.layout import checkpoint_dir, parse_folder

    backend = open_backend(str(tmp_path))
    good = checkpoint_dir(7, 2)
    for key in (f"{good}/a.bin", f"{good}/deeper/x.bin", "step-notes/readme.txt", "step-x.e1/a.bin", f"{good}/b.bin"):
        backend.write(key, b"1")
    listing = list_root(backend, {})
    assert {f: sorted(files) for f, files in listing.folders.items()} == {good: ["a.bin", "b.bin"]}
    assert listing.committed() == [] and listing.used() == {(2, "")}
    assert parse_folder(good) == (7, (2, "")) and parse_folder("step-notes") is None
