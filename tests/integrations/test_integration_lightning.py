"""Lightning through CkptsdkCheckpointIO: a run SIGKILLed mid-run and resumed with
ckpt_path="last" ends with the weights of an uninterrupted run, on local disk and on GCS."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import safetensors.torch
import torch

pytest.importorskip("lightning")

from ckptsdk import CheckpointManager, UnsupportedStateError  # noqa: E402
from ckptsdk.errors import ConfigError  # noqa: E402
from ckptsdk.integrations.lightning import POINTER_FORMAT, CkptsdkCheckpointIO  # noqa: E402
from ckptsdk.porting.export import export_safetensors  # noqa: E402
from tests.support._integration_jobs import assert_same, run_job, weights  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("lightning-ref")
    run_job("lightning", str(work / "root"), work, work / "w.safetensors")
    return weights(work / "w.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("lightning-reference")  # one worker trains ``reference`` once for both kinds
@pytest.mark.parametrize("kind", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_sigkilled_lightning_run_resumes_bit_exact(kind, reference, make_backend_target, tmp_path):
    target = make_backend_target(kind)
    # On GCS the pointers go there too (ModelCheckpoint's dirpath gs://...): the resume then
    # starts from CkptsdkCheckpointIO.resume_path(), Lightning's "last" lookup being local-only.
    work = tmp_path / "work" if kind == "local" else make_backend_target(kind, name="work").url
    # 6 steps per epoch, a checkpoint at every epoch end: killed as step 15 begins (mid epoch 2).
    run_job(
        "lightning", target.url, work, tmp_path / "a.safetensors", kill_at=15, options=target.options, env=target.env
    )
    assert not (tmp_path / "a.safetensors").exists()
    with CheckpointManager(target.url, read_only=True, storage_options=target.options) as mgr:
        assert [c.step for c in mgr.list() if c.valid] == [6, 12]
    if kind == "local":
        last = (work / "ckpt" / "last.ckpt").read_bytes()
    else:
        import gcsfs

        last = gcsfs.GCSFileSystem(**target.options).cat_file(f"{work}/ckpt/last.ckpt")
    assert json.loads(last)["step"] == 12

    run_job("lightning", target.url, work, tmp_path / "b.safetensors", options=target.options, env=target.env)
    assert_same(weights(tmp_path / "b.safetensors"), reference)
    with CheckpointManager(target.url, read_only=True, storage_options=target.options) as mgr:
        assert mgr.latest().step == 24 and mgr.latest().epoch == 2  # the resumed writer's lease epoch
    # `ckptsdk export` finds the LightningModule's weights in the tree the plugin wrote.
    out = tmp_path / "model.safetensors"
    report = export_safetensors(target.url, out, storage_options=target.options)
    assert report["object"] == "lightning/state_dict"
    exported = safetensors.torch.load_file(str(out))
    assert_same({k.removeprefix("net."): v for k, v in exported.items()}, reference)


def _checkpoint(**extra):
    model = torch.nn.Linear(2, 2)
    return {
        "global_step": 3,
        "epoch": 0,
        "pytorch-lightning_version": "2.6",
        "state_dict": model.state_dict(),
        "optimizer_states": [],
        "lr_schedulers": [],
        **extra,
    }


def test_unstorable_entry_is_refused_naming_the_key(tmp_path):
    io = CkptsdkCheckpointIO(str(tmp_path / "root"), lease_ttl=5)
    with pytest.raises(UnsupportedStateError, match="Lightning checkpoint key 'my_state'") as err:
        io.save_checkpoint(_checkpoint(my_state={"ok": 1, "bad": object()}), tmp_path / "last.ckpt")
    assert err.value.path == "lightning/my_state/bad"
    assert not (tmp_path / "last.ckpt").exists()
    io.save_checkpoint(_checkpoint(my_state={"ok": 1}), tmp_path / "last.ckpt")  # the run goes on
    expected = torch.rand(3)  # what the next draw was when the checkpoint was saved...
    loaded = io.load_checkpoint(tmp_path / "last.ckpt")
    assert torch.equal(torch.rand(3), expected)  # ...and is again: loading restored the RNG states
    assert loaded["my_state"] == {"ok": 1} and loaded["global_step"] == 3
    io.teardown()
    with CheckpointManager(str(tmp_path / "root"), read_only=True) as mgr:
        assert [c.step for c in mgr.list()] == [3]

    # A new fit that did not resume: its first save is refused before anything is written.
    fresh = CkptsdkCheckpointIO(str(tmp_path / "root"), lease_ttl=5, force=True)
    with pytest.raises(ConfigError, match='holds checkpoints up to step 3.*ckpt_path="last"'):
        fresh.save_checkpoint(_checkpoint(), tmp_path / "other.ckpt")
    fresh.teardown()
    with CheckpointManager(str(tmp_path / "root"), read_only=True) as mgr:
        assert [c.key for c in mgr.list()] == ["step-0000000003.e1"]
    assert json.loads((tmp_path / "last.ckpt").read_text())["key"] == "step-0000000003.e1"
    assert not (tmp_path / "other.ckpt").exists()


def test_a_torch_save_ckpt_is_not_unpickled(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save(_checkpoint(), path)
    io = CkptsdkCheckpointIO(str(tmp_path / "root"), lease_ttl=5)
    with pytest.raises(ConfigError, match="ckptsdk import"):
        io.load_checkpoint(path)
    (tmp_path / "p.ckpt").write_text(json.dumps({"format": POINTER_FORMAT + "x", "step": 1}))
    with pytest.raises(ConfigError, match="not a"):
        io.load_checkpoint(tmp_path / "p.ckpt")
    io.teardown()


def test_a_pointer_of_the_previous_format_is_read_and_a_newer_major_refused(tmp_path):
    url = str(tmp_path / "root")
    io = CkptsdkCheckpointIO(url, lease_ttl=5)
    io.save_checkpoint(_checkpoint(), tmp_path / "last.ckpt")  # step 3
    written = json.loads((tmp_path / "last.ckpt").read_text())
    assert written["format"] == POINTER_FORMAT == "ckptsdk.lightning_pointer/1.0"
    # What ckptsdk wrote before the pointer followed the version rule (document.py), verbatim:
    (tmp_path / "old.ckpt").write_text(
        '{"format": "ckptsdk-lightning-pointer/1", "key": "step-0000000003.e1", "step": 3, "url": ROOT}'.replace(
            "ROOT", json.dumps(url)
        )
    )
    assert io.load_checkpoint(tmp_path / "old.ckpt")["global_step"] == 3
    (tmp_path / "new.ckpt").write_text(json.dumps({**written, "format": "ckptsdk.lightning_pointer/2.0"}))
    with pytest.raises(ConfigError, match="upgrade ckptsdk"):
        io.load_checkpoint(tmp_path / "new.ckpt")
    io.teardown()


def test_training_on_from_an_older_step_is_refused_before_it_is_shadowed(tmp_path):
    url = str(tmp_path / "root")
    io = CkptsdkCheckpointIO(url, lease_ttl=5)
    assert io.resume_path() is None  # an empty root: a fresh fit
    io.save_checkpoint(_checkpoint(), tmp_path / "best.ckpt")  # step 3
    io.save_checkpoint({**_checkpoint(), "global_step": 5}, tmp_path / "last.ckpt")
    resume = io.resume_path()
    assert json.loads(pathlib.Path(resume).read_text())["step"] == 5
    io.teardown()
    assert not os.path.exists(resume)  # teardown removes its temporary pointers

    io = CkptsdkCheckpointIO(url, lease_ttl=5, force=True)
    assert io.load_checkpoint(tmp_path / "best.ckpt")["global_step"] == 3  # fine for test/predict
    with pytest.raises(ConfigError, match="shadowed"):
        io.save_checkpoint({**_checkpoint(), "global_step": 4}, tmp_path / "next.ckpt")
    io.save_checkpoint({**_checkpoint(), "global_step": 6}, tmp_path / "next.ckpt")  # past it: fine
    io.teardown()
    with CheckpointManager(url, read_only=True) as mgr:
        assert [c.step for c in mgr.list() if c.valid][-1] == 6
        assert 4 not in [c.step for c in mgr.list()]


# Lightning 2.6 itself calls a torch API that torch now deprecates; not ours to fix.
@pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated:FutureWarning")
def test_model_checkpoint_top_k_maps_onto_keep_rules(tmp_path):
    """ModelCheckpoint(monitor="val_loss", save_top_k=2) with keep_last=1: the root keeps the two
    best scores and the newest, Lightning's NaN score (stored as inf) is never best, and the best
    pointer Lightning holds still reads back."""
    import math

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    scores = [0.5, 0.1, math.nan, 0.3, 0.9]  # by epoch; Lightning saves 0, 1, 3 (the top 2 as they stand)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", scores[self.current_epoch])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(4, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2)  # 2 steps per epoch
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss", save_top_k=2, mode="min")
    url = str(tmp_path / "root")
    io = CkptsdkCheckpointIO(url, keep_last=1, model_checkpoint=ckpt, lease_ttl=5)
    trainer = L.Trainer(
        max_epochs=len(scores),
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[io],
        callbacks=[ckpt],
    )
    trainer.fit(Module(), loader, loader)
    with CheckpointManager(url, read_only=True) as mgr:
        assert {c.step: c.manifest.metrics.get("val_loss") for c in mgr.list()} == pytest.approx({4: 0.1, 8: 0.3})
        assert mgr.best("val_loss").step == 4
        assert mgr.kept(keep_last=1, keep=io.keep) == {
            4: ("best val_loss #1",),
            8: ("latest", "best val_loss #2", "newest"),
        }
    assert io.load_checkpoint(ckpt.best_model_path)["global_step"] == 4
    io.teardown()
