"""Incremental saves: a frozen base is written once, and no route of changing it restores stale bytes.

Each sabotage test changes the "frozen" weight between two saves by one route a user has, then
restores the newest checkpoint into a fresh model and compares every tensor with the live state
at that save: a stale shared tensor would show here as a mismatch.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Callable

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.checkpoint.writing.sharing import SHARE_MIN_BYTES, tensor_digest
from ckptsdk.errors import BackendError
from ckptsdk.format.layout import SHARED_PREFIX, shared_rank
from ckptsdk.testing import FaultyBackend

BASE = 1024  # a 1024x1024 float32 weight: 4 MiB, above SHARE_MIN_BYTES


class Tuned(torch.nn.Module):
    """A frozen base and a small trainable head (a LoRA-like fine-tune)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(BASE, BASE)
        self.head = torch.nn.Linear(BASE, 4)
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x)))


def _job(seed: int = 0) -> tuple[Tuned, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)
    model = Tuned()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    return model, opt, TrainState(model=model, optimizer=opt)


def _step(model: Tuned, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, BASE)).sum().backward()
    opt.step()
    opt.zero_grad()


def _live(model: Tuned, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _restored(url: str) -> dict[str, torch.Tensor]:
    model, opt, state = _job(seed=99)  # different values everywhere: only a restore makes them equal
    assert CheckpointManager(url, read_only=True).load() is not None
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)) as mgr:
        assert mgr.restore(state) is not None
    return _live(model, opt)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"{k} restored stale or wrong bytes"


def _manifest(root, step: int) -> dict:
    return json.loads(next(root.glob(f"step-{step:010d}.*/manifest.json")).read_text())


@pytest.mark.parametrize("blocking", [True, False])
def test_the_frozen_base_is_written_once_and_restores_bit_exactly(tmp_path, blocking):
    root = tmp_path / "r"
    model, opt, state = _job()
    with CheckpointManager(
        str(root), keep_last=3, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in range(1, 7):
            _step(model, opt)
            mgr.save(state, step=step, blocking=blocking)
            assert mgr.wait(timeout=120)
        expected = _live(model, opt)
    shared = sorted(p.name for p in (root / "shared").iterdir())
    assert len(shared) == 1  # the base's weight, written at the first save and never again
    own = [p.stat().st_size for p in sorted(root.glob("step-*/tensors.safetensors"))]
    assert len(own) == 3 and all(n < BASE * BASE * 4 / 10 for n in own)  # the folders hold no base
    m = _manifest(root, 6)
    assert m["format"] == "ckptsdk.checkpoint/2.0"  # refers to shared files: a 1.x reader must refuse it
    assert [list(f["tensors"]) for f in m["shared"]] == [["objects/model/base.weight"]]
    assert m["shared"][0]["tensors"]["objects/model/base.weight"] == tensor_digest(model.base.weight)
    _assert_same(_restored(str(root)), expected)


def _in_place_no_grad(model: Tuned) -> None:
    with torch.no_grad():
        model.base.weight.mul_(1.5)


def _through_data(model: Tuned) -> None:
    model.base.weight.data[0, 0] += 1.0  # .data has its own version counter: only the bytes tell


def _copy(model: Tuned) -> None:
    with torch.no_grad():
        model.base.weight.copy_(torch.randn(BASE, BASE))


def _load_state_dict(model: Tuned) -> None:
    sd = model.state_dict()
    sd["base.weight"] = torch.randn(BASE, BASE)
    model.load_state_dict(sd)


def _new_tensor(model: Tuned) -> None:
    model.base.weight = torch.nn.Parameter(torch.randn(BASE, BASE), requires_grad=False)


def _set(model: Tuned) -> None:
    with torch.no_grad():
        model.base.weight.set_(torch.randn(BASE, BASE))


def _same_values_new_storage(model: Tuned) -> None:
    model.base.weight = torch.nn.Parameter(model.base.weight.detach().clone(), requires_grad=False)


ROUTES: dict[str, Callable[[Tuned], None]] = {
    "in_place_no_grad": _in_place_no_grad,
    "through_data": _through_data,
    "copy_": _copy,
    "load_state_dict": _load_state_dict,
    "new_tensor": _new_tensor,
    "set_": _set,
    "same_values_new_storage": _same_values_new_storage,
}


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_frozen_tensor_changed_by_any_route_is_written_again(tmp_path, route, blocking):
    url = str(tmp_path / "r")
    model, opt, state = _job()
    with CheckpointManager(
        url, keep_last=3, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2):
            _step(model, opt)
            mgr.save(state, step=step, blocking=blocking)
            assert mgr.wait(timeout=120)
        before = tensor_digest(model.base.weight)
        ROUTES[route](model)
        _step(model, opt)
        mgr.save(state, step=3, blocking=blocking)
        assert mgr.wait(timeout=120)
        expected = _live(model, opt)
    m = _manifest(tmp_path / "r", 3)
    taken = {p for f in m.get("shared", []) for p in f["tensors"]}
    if route == "same_values_new_storage":
        assert tensor_digest(model.base.weight) == before  # nothing to catch: the bytes are the same
    else:
        assert tensor_digest(model.base.weight) != before
        assert "objects/model/base.weight" not in taken  # written again, in the folder's own file
    _assert_same(_restored(url), expected)


def test_requires_grad_flipped_then_trained_is_written_again(tmp_path):
    url = str(tmp_path / "r")
    model, opt, state = _job()
    with CheckpointManager(
        url, keep_last=3, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        _step(model, opt)
        mgr.save(state, step=1)
        model.base.weight.requires_grad_(True)  # unfreeze: the optimizer now steps the base too
        opt.add_param_group({"params": [model.base.weight]})
        for step in (2, 3):
            _step(model, opt)
            mgr.save(state, step=step)
        expected = _live(model, opt)
    assert all("objects/model/base.weight" not in f["tensors"] for f in _manifest(tmp_path / "r", 3).get("shared", []))
    fresh, fresh_opt, _ = _job(seed=99)
    fresh.base.weight.requires_grad_(True)
    fresh_opt.add_param_group({"params": [fresh.base.weight]})
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)) as mgr:
        assert mgr.restore(TrainState(model=fresh, optimizer=fresh_opt)).step == 3
    _assert_same(_live(fresh, fresh_opt), expected)


def test_full_training_hashes_and_shares_nothing(tmp_path, monkeypatch):
    """Everything an optimizer steps moves every step: no tensor is hashed, none shared."""
    import ckptsdk.checkpoint.writing.sharing as sharing

    hashed: list[int] = []
    real = sharing.tensor_digest
    monkeypatch.setattr(sharing, "tensor_digest", lambda t: hashed.append(t.numel()) or real(t))
    url = str(tmp_path / "r")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(BASE, BASE), torch.nn.Linear(BASE, 4))
    opt = torch.optim.AdamW(model.parameters())
    state = TrainState(model=model, optimizer=opt)
    with CheckpointManager(
        url, keep_last=2, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2, 3):
            model(torch.randn(2, BASE)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(state, step=step, blocking=step != 2)
            assert mgr.wait(timeout=60)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    assert hashed == []
    assert all("shared" not in _manifest(tmp_path / "r", s) for s in (2, 3))
    assert not (tmp_path / "r" / "shared").exists()
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(BASE, BASE), torch.nn.Linear(BASE, 4))
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)) as mgr:
        mgr.restore(TrainState(model=fresh, optimizer=torch.optim.AdamW(fresh.parameters())))
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in expected.items())


def test_small_tensors_and_incremental_false_write_everything(tmp_path):
    url = str(tmp_path / "r")
    model, opt, state = _job()
    with CheckpointManager(
        url, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False, incremental=False)
    ) as mgr:
        for step in (1, 2):
            _step(model, opt)
            mgr.save(state, step=step)
    assert "shared" not in _manifest(tmp_path / "r", 2)
    assert not (tmp_path / "r" / "shared").exists()
    assert SHARE_MIN_BYTES > model.head.weight.numel() * 4  # the head always goes with the folder


def test_rotation_deletes_a_shared_file_once_nothing_kept_refers_to_it(tmp_path):
    root = tmp_path / "r"
    model, opt, state = _job()
    with CheckpointManager(
        str(root), keep_last=2, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2):
            _step(model, opt)
            mgr.save(state, step=step)
        first = sorted(p.name for p in (root / "shared").iterdir())
        _in_place_no_grad(model)  # the base changes once (a new base) ...
        for step in (3, 4, 5, 6):  # ... is written with 3, shared anew from 4 on (it stays put)
            _step(model, opt)
            mgr.save(state, step=step)
            assert mgr.wait(timeout=60)
        now = sorted(p.name for p in (root / "shared").iterdir())
        expected = _live(model, opt)
    assert len(first) == 1 and len(now) == 1 and now != first  # 1 and 2 rotated out: their file went
    assert shared_rank(f"{SHARED_PREFIX}{now[0]}") == (4, (1, ""))
    _assert_same(_restored(str(root)), expected)


def test_a_failed_save_leaves_no_shared_file_behind_after_the_next_save(tmp_path):
    url = str(tmp_path / "r")
    model, opt, state = _job()
    mgr = CheckpointManager(
        url, keep_last=2, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    )
    inner = mgr.backend
    mgr.backend = FaultyBackend(
        inner,
        fail_on=lambda op, key, n: (
            BackendError("No space left on device", key=key) if key.endswith("manifest.json") else None
        ),
    )
    _step(model, opt)
    with pytest.raises(BackendError, match="No space left"):
        mgr.save(state, step=1)  # the shared file went out; the commit did not
    assert [o.key.split("/")[0] for o in inner.list(SHARED_PREFIX)] == ["shared"]
    assert [c.committed for c in CheckpointManager(url, read_only=True).list()] == [False]  # nothing committed
    mgr.backend = inner
    _step(model, opt)
    mgr.save(state, step=2)
    assert mgr.wait(timeout=60)
    left = [o.key for o in inner.list(SHARED_PREFIX)]
    refs = {f.name for c in scan(inner).checkpoints if c.manifest for f in c.manifest.shared}
    assert left == sorted(refs) and len(left) == 1  # the failed save's file is gone, step 2's stays
    expected = _live(model, opt)
    mgr.close()
    _assert_same(_restored(url), expected)


def test_a_missing_shared_file_falls_back_to_an_earlier_checkpoint_loudly(tmp_path, caplog):
    root = tmp_path / "r"
    model, opt, state = _job()
    with CheckpointManager(
        str(root),
        keep_last=5,
        lease_options=LeaseOptions(ttl=30),
        save_options=SaveOptions(on_signal=False, incremental=False),
    ) as mgr:
        _step(model, opt)
        mgr.save(state, step=1)  # a full checkpoint
    with CheckpointManager(
        str(root), keep_last=5, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        assert mgr.restore(state) is not None
        for step in (2, 3):  # resumed from a full checkpoint: the base is shared once it stayed put a save
            _step(model, opt)
            mgr.save(state, step=step)
    assert "shared" in _manifest(root, 3)
    for p in (root / "shared").iterdir():
        p.unlink()  # lost (a hand-made cleanup): step 3 cannot be restored whole
    model2, opt2, state2 = _job(seed=5)
    with CheckpointManager(
        str(root), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        point = mgr.restore(state2)
    assert point is not None and point.step == 2
    assert "shared file" in caplog.text and "is missing" in caplog.text and "skipping checkpoint" in caplog.text


def test_gc_and_du_count_and_remove_unreferenced_shared_files(tmp_path, capsys):
    from ckptsdk.cli import main

    root = tmp_path / "r"
    model, opt, state = _job()
    with CheckpointManager(
        str(root), keep_last=2, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2, 3):
            _step(model, opt)
            mgr.save(state, step=step)
    b = open_backend(str(root))
    stray = "shared/0000000002.e1.00000000000000aa.safetensors"
    b.write(stray, b"x" * 1000)  # a killed save's file, that no manifest refers to
    assert main(["du", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    held = sum(p.stat().st_size for p in (root / "shared").iterdir())
    assert doc["bytes"]["shared_files"] == held and len(doc["folders"]["shared files"]) == 2
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["STEP", "EPOCH", "SIZE", "SHARED"] and "4.0 MiB" in out
    assert main(["gc", str(root), "--grace", "0"]) == 0
    capsys.readouterr()
    assert not b.exists(stray) and len(list((root / "shared").iterdir())) == 1  # the referenced one stays
    with CheckpointManager(str(root), read_only=True) as mgr:
        assert mgr.load() is not None


def _two_saves(root) -> Tuned:  # noqa: ANN001
    """Steps 1 and 2 of the fine-tune under ``root`` (step 2 refers to the shared base); the model."""
    model, opt, state = _job()
    with CheckpointManager(
        str(root), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2):
            _step(model, opt)
            mgr.save(state, step=step)
    return model


def test_the_torch_free_reader_reads_shared_files(tmp_path):
    from tests.format.test_manifest import _no_torch_import, _reader_snippet

    root = tmp_path / "r"
    model = _two_saves(root)
    folder = next(root.glob("step-0000000002.*"))
    namespace: dict = {"__builtins__": {**vars(builtins), "__import__": _no_torch_import}}
    exec(compile(_reader_snippet(), "FORMAT.md", "exec"), namespace)  # noqa: S102 - our own doc
    manifest, tree = namespace["read_checkpoint"](str(folder))
    assert manifest["shared"]
    assert (tree["objects"]["model"]["base.weight"] == model.base.weight.detach().numpy()).all()
    assert (tree["objects"]["model"]["head.weight"] == model.head.weight.detach().numpy()).all()


def test_export_writes_a_self_contained_file(tmp_path):
    import safetensors.torch

    from ckptsdk.cli import main

    root = tmp_path / "r"
    model = _two_saves(root)
    out = tmp_path / "export.safetensors"
    assert main(["export", str(root), str(out)]) == 0
    flat = safetensors.torch.load_file(str(out))
    weight = next(v for k, v in flat.items() if k.endswith("base.weight"))
    assert torch.equal(weight, model.base.weight.detach())


@pytest.mark.parametrize("blocking", [True, False])
def test_tied_frozen_weights_are_stored_once(tmp_path, blocking):
    """Two state-dict entries of one storage (GPT-2's lm_head and wte): one copy in the shared file."""
    root = tmp_path / "r"
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"enc": torch.nn.Linear(BASE, BASE), "dec": torch.nn.Linear(BASE, BASE)})
    model["dec"].weight = model["enc"].weight  # tied
    for p in model.parameters():
        p.requires_grad_(False)
    state = TrainState(model=model)
    with CheckpointManager(
        str(root), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(state, step=step, blocking=blocking)
            assert mgr.wait(timeout=60)
    (held,) = list((root / "shared").iterdir())
    weight = BASE * BASE * 4
    assert weight < held.stat().st_size < 2 * weight  # the weight once (and the biases)
    m = _manifest(root, 3)
    assert m["shared"][0]["aliases"] == {"objects/model/dec.weight": "objects/model/enc.weight"}
    torch.manual_seed(7)
    fresh = torch.nn.ModuleDict({"enc": torch.nn.Linear(BASE, BASE), "dec": torch.nn.Linear(BASE, BASE)})
    with CheckpointManager(
        str(root), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        assert mgr.restore(TrainState(model=fresh)).step == 3
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def _two_idle_layers(seed: int) -> tuple[torch.nn.Sequential, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(BASE, BASE // 2), torch.nn.Linear(BASE, BASE // 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, TrainState(model=model, optimizer=opt)


def _grads(model: torch.nn.Module, scale: float) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, scale * (i + 1))


def test_equal_bytes_shared_once_restore_as_separate_tensors(tmp_path):
    """Two momentum buffers with equal bytes (zero so far: idle layers) are stored once in the
    shared file, under one key. After a restore each param must own its buffer: one tensor for
    both would take two updates per step, and the resumed run would drift from the uninterrupted one."""
    root = tmp_path / "r"
    model, opt, state = _two_idle_layers(0)
    _grads(model, 0.0)
    opt.step()  # every momentum buffer exists, all zero: the two weights' are equal bytes
    with CheckpointManager(
        str(root), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2):  # unchanged between saves: the second takes them from the shared file
            mgr.save(state, step=step)
    aliases = _manifest(root, 2)["shared"][0]["aliases"]
    assert "objects/optimizer/state/2/momentum_buffer" in aliases  # the premise: stored once

    fresh, fresh_opt, fresh_state = _two_idle_layers(1)
    with CheckpointManager(
        str(root), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        assert mgr.restore(fresh_state).step == 2
    buffers = [fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert len({b.data_ptr() for b in buffers}) == len(buffers)
    for m, o in ((model, opt), (fresh, fresh_opt)):  # the steps after the resume, both runs
        for k in range(3):
            _grads(m, 1.0 + k)
            o.step()
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(v, w), k


class TwoBases(torch.nn.Module):
    """Two frozen bases (one shared file holds both) and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(BASE, BASE, bias=False)
        self.b = torch.nn.Linear(BASE, BASE, bias=False)
        self.head = torch.nn.Linear(BASE, 4)
        for p in [*self.a.parameters(), *self.b.parameters()]:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


def _two_bases_root(url: str) -> tuple[TwoBases, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """Saves 1 and 2 share one file holding both bases; before save 3, base ``a`` changes, so
    save 3 still refers to that file for ``b`` only: ``a``'s bytes there are stale."""
    torch.manual_seed(0)
    model = TwoBases()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    state = TrainState(model=model, optimizer=opt)
    with CheckpointManager(
        url, keep_last=3, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2, 3):
            if step == 3:
                with torch.no_grad():
                    model.a.weight.add_(1.0)
            model(torch.randn(2, BASE)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(state, step=step, blocking=True)
    expected = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    return model, opt, expected


def test_a_shared_files_tensors_the_checkpoint_no_longer_uses_are_hashed_not_kept(tmp_path, monkeypatch):
    from ckptsdk.format.files.tensorfile import TensorFile

    url = str(tmp_path / "r")
    _, _, expected = _two_bases_root(url)
    m = _manifest(tmp_path / "r", 3)
    (shared,) = m["shared"]
    assert list(shared["tensors"]) == ["objects/model/b.weight"]  # the file holds a.weight too, stale
    kept: list[set[str]] = []
    real = TensorFile.allocate

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        kept.append(set(out))
        return out

    monkeypatch.setattr(TensorFile, "allocate", spy)
    torch.manual_seed(5)
    fresh = TwoBases()
    state = TrainState(model=fresh, optimizer=torch.optim.AdamW(fresh.head.parameters(), lr=1e-3))
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)) as mgr:
        assert mgr.restore(state).step == 3
    assert kept[1] == {"objects/model/b.weight"}  # the shared file: a.weight was not given memory
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[f"model/{k}"]), k


def test_a_stale_tensor_in_a_shared_file_is_still_verified(tmp_path):
    """Hashed, not kept, but hashed: a flipped byte in the stale part fails the file's digest."""
    from ckptsdk.format.files.tensorfile import read_header

    url = str(tmp_path / "r")
    _two_bases_root(url)
    (shared,) = _manifest(tmp_path / "r", 3)["shared"]
    entries = {e.name: e for e in read_header(open_backend(url), shared["name"])}
    path = tmp_path / "r" / shared["name"]
    data = bytearray(path.read_bytes())
    data_start = len(data) - sum(e.nbytes for e in entries.values())
    data[data_start + entries["objects/model/a.weight"].begin + 7] ^= 0x01
    path.write_bytes(bytes(data))
    state = TrainState(model=(fresh := TwoBases()), optimizer=torch.optim.AdamW(fresh.head.parameters(), lr=1e-3))
    from ckptsdk.errors import NoValidCheckpointError

    with CheckpointManager(url, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)) as mgr:
        with pytest.raises(NoValidCheckpointError) as err:
            mgr.restore(state)  # saves 1 and 2 refer to the same file (for both bases): refused too
    assert "step-0000000003" in str(err.value) and "digest" in str(err.value)
    assert path.exists() and len(_manifest(tmp_path / "r", 3)["shared"]) == 1  # nothing deleted


def test_the_memory_check_is_of_the_whole_read_not_of_each_file(tmp_path, monkeypatch):
    """Room for the folder's file and for the shared file, each alone, but not for both: the
    restore says so before allocating anything, and the checkpoint is still there."""
    import ckptsdk.format.files.tensorfile as tensorfile
    from ckptsdk.errors import CheckpointTooLargeError

    url = str(tmp_path / "r")
    _two_bases_root(url)
    before = sorted(p.name for p in (tmp_path / "r").rglob("*") if p.is_file())
    both = 2 * BASE * BASE * 4  # a.weight (the folder's) and b.weight (shared), float32
    monkeypatch.setattr(tensorfile, "available_memory", lambda: both - 1024)
    with pytest.raises(CheckpointTooLargeError) as err:
        CheckpointManager(url, read_only=True).load()
    assert err.value.needed >= both and err.value.available == both - 1024
    assert "with the checkpoint's other files" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "r").rglob("*") if p.is_file()) == before  # nothing lost
