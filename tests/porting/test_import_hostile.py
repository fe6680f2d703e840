"""`ckptsdk import` of a damaged or hostile file ends in one clear error, never a traceback or a hang
(issue 47.11), and an HF folder's index decides which shard each tensor comes from (issue 47.5).

Every refusal is the exact error type of the project's tree, names the file, and leaves nothing at
the destination root. The fuzz cases (random bytes with fixed seeds, valid files truncated at many
offsets) are deterministic: a seed that fails today fails every run.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ckptsdk import CheckpointManager
from ckptsdk.cli import main
from ckptsdk.errors import ConfigError, UnsupportedStateError
from ckptsdk.porting.torch_import import import_torch_checkpoint

REPO = Path(__file__).resolve().parents[2]
EXIT_USAGE = 2


def _hf_folder(tmp_path: Path, *, state: object = None) -> Path:
    """A minimal HF Trainer ``checkpoint-3/``: model.safetensors and trainer_state.json."""
    folder = tmp_path / "hf" / "checkpoint-3"
    folder.mkdir(parents=True)
    lin = torch.nn.Linear(4, 2)
    safetensors.torch.save_file(lin.state_dict(), str(folder / "model.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3, "epoch": 0.5} if state is None else state))
    return folder


def _refused(tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str], names: str) -> str:
    """Run the CLI; assert exit 2, one line naming ``names``, and no destination root."""
    url = tmp_path / "root"
    assert main(["import", str(source), str(url)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ckptsdk: error: "), err
    assert names in err[0], err[0]
    assert not url.exists()
    return err[0]


# --- item 11: hostile HF folders -------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("[" * 100_000 + "]" * 100_000, "nests too deeply"),  # RecursionError today
        ("[1, 2, 3]", "JSON list, not the object"),  # AttributeError today
        ('"checkpoint"', "JSON str, not the object"),
        ('{"global_step": 3', "not UTF-8 JSON"),
        (b"\xff\xfe{}", "not UTF-8 JSON"),
        ('{"global_step": 3, "epoch": 1e999}', "epoch is inf"),  # OverflowError from int(inf)
        ('{"global_step": "three"}', "step is 'three'"),
    ],
    ids=["deep", "list", "string", "truncated", "not-utf8", "inf-epoch", "text-step"],
)
def test_a_hostile_trainer_state_is_one_clear_error(tmp_path, capsys, content, says):
    folder = _hf_folder(tmp_path)
    path = folder / "trainer_state.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _refused(tmp_path, folder, capsys, says)
    assert "trainer_state.json" in line or "checkpoint-3" in line


def test_a_malformed_model_safetensors_is_one_clear_error(tmp_path, capsys):
    folder = _hf_folder(tmp_path)
    model = folder / "model.safetensors"
    model.write_bytes(model.read_bytes()[:40])  # SafetensorError today
    line = _refused(tmp_path, folder, capsys, "model.safetensors")
    assert "damaged or truncated" in line


def test_a_hostile_rng_state_is_one_clear_error(tmp_path, capsys):
    folder = _hf_folder(tmp_path)
    torch.save([1, 2, 3], folder / "rng_state.pth")  # AttributeError (.items) today
    _refused(tmp_path, folder, capsys, "not HF's dict of RNG states")


def test_special_files_are_refused_before_they_are_opened(tmp_path):
    """A FIFO blocks ``open()`` forever today; run in a child so a hang fails instead of stalling."""
    cases = {}
    folder = _hf_folder(tmp_path / "a")
    (folder / "trainer_state.json").unlink()
    os.mkfifo(folder / "trainer_state.json")
    cases["fifo-trainer-state"] = (folder, "named pipe")
    folder = _hf_folder(tmp_path / "b")
    os.mkfifo(folder / "optimizer.pt")
    cases["fifo-part"] = (folder, "named pipe")
    folder = _hf_folder(tmp_path / "c")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/dev/zero")
    cases["device-model"] = (folder, "character device")
    folder = _hf_folder(tmp_path / "d")
    (folder / "scaler.pt").mkdir()
    cases["folder-part"] = (folder, "is a folder")
    for name, (source, says) in cases.items():
        url = tmp_path / f"root-{name}"
        proc = subprocess.run(
            [sys.executable, "-m", "ckptsdk", "import", str(source), str(url)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == EXIT_USAGE, (name, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and says in proc.stderr, (name, proc.stderr)
        assert not url.exists(), name


# --- item 11: fuzz over random and truncated files ---------------------------------------------


def _outcome(source: Path, url: Path, expected: tuple[type[Exception], ...]) -> str:
    """Import; on failure the error is exactly one of ``expected``, names the file, writes nothing."""
    try:
        info = import_torch_checkpoint(source, str(url), step=1)
    except expected as exc:
        assert type(exc) in expected, repr(exc)
        assert str(source) in str(exc), str(exc)
        assert not url.exists(), f"{source}: a refused import wrote {sorted(os.listdir(url))}"
        return type(exc).__name__
    assert info.step == 1 and url.exists()
    return "imported"


def test_random_bytes_as_a_pt_file_are_refused_cleanly(tmp_path):
    """4 KiB of noise: torch's weights-only unpickler raises IndexError, KeyError... on some
    seeds today (seeds 0-199: 14 raw errors)."""
    seen = set()
    for seed in range(200):
        pt = tmp_path / f"noise-{seed}.pt"
        pt.write_bytes(random.Random(seed).randbytes(4096))
        seen.add(_outcome(pt, tmp_path / f"root-{seed}", (ConfigError, UnsupportedStateError)))
    assert "ConfigError" in seen


def _valid_pt(*, zip_format: bool) -> bytes:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    buf = io.BytesIO()
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1, "note": "x"}
    torch.save(saved, buf, _use_new_zipfile_serialization=zip_format)
    return buf.getvalue()


def _cuts(size: int) -> list[int]:
    return sorted({*range(0, size, max(1, size // 60)), *range(max(0, size - 40), size)})


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_a_valid_pt_truncated_anywhere_is_refused_cleanly(tmp_path, zip_format):
    data = _valid_pt(zip_format=zip_format)
    for cut in _cuts(len(data)):
        pt = tmp_path / f"cut-{cut}.pt"
        pt.write_bytes(data[:cut])
        assert _outcome(pt, tmp_path / f"root-{cut}", (ConfigError,)) == "ConfigError", cut
    pt = tmp_path / "whole.pt"
    pt.write_bytes(data)
    assert _outcome(pt, tmp_path / "root-whole", (ConfigError,)) == "imported"


def test_a_truncated_or_noisy_hf_folder_is_refused_cleanly(tmp_path):
    data = (_hf_folder(tmp_path / "src") / "model.safetensors").read_bytes()
    for cut in _cuts(len(data)):
        folder = _hf_folder(tmp_path / f"cut-{cut}")
        (folder / "model.safetensors").write_bytes(data[:cut])
        assert _outcome(folder, tmp_path / f"root-{cut}", (ConfigError,)) == "ConfigError", cut
    for seed in range(20):
        folder = _hf_folder(tmp_path / f"noise-{seed}")
        noise = random.Random(seed).randbytes(512)
        (folder / ("trainer_state.json", "optimizer.pt", "rng_state.pth", "model.safetensors")[seed % 4]).write_bytes(
            noise
        )
        assert _outcome(folder, tmp_path / f"root-noise-{seed}", (ConfigError, UnsupportedStateError)) != "imported"


# --- item 5: the index decides which shard each tensor comes from ------------------------------

_A = "model-00001-of-00001.safetensors"  # the shard the index names
_B = "model-00001-of-00002.safetensors"  # a leftover of an earlier save: sorts after A


def _sharded(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    ours = {"weight": torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), "bias": torch.randn(2)}
    safetensors.torch.save_file(ours, str(folder / _A))
    safetensors.torch.save_file({k: v + 1 for k, v in ours.items()}, str(folder / _B))
    index = {"metadata": {"total_size": 40}, "weight_map": dict.fromkeys(ours, _A)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3, "epoch": 1.0}))
    return folder, ours


def test_a_stale_shard_beside_the_index_is_ignored_and_said(tmp_path, capsys, caplog):
    folder, ours = _sharded(tmp_path)
    url = str(tmp_path / "root")
    with caplog.at_level("WARNING", logger="ckptsdk.porting.hf_folder"):
        assert main(["import", str(folder), url]) == 0
    out = capsys.readouterr().out
    assert f"ignored {_B}" in out, out
    assert any(_B in r.getMessage() for r in caplog.records)

    with CheckpointManager(url, read_only=True) as mgr:
        latest = mgr.latest()
        model = mgr.load()["objects"]["model"]  # the folder's other parts: CkptsdkTrainer's shape
    assert latest is not None and json.loads(latest.manifest.tags["ignored_files"]) == [_B]
    for name, tensor in ours.items():  # A's bytes exactly, not B's (today B wins: merged last)
        assert model[name].numpy().tobytes() == tensor.numpy().tobytes(), name

    assert main(["import", str(folder), str(tmp_path / "root2"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ignored_files"] == [_B]


def test_a_tensor_the_index_names_but_its_shard_lacks_is_refused(tmp_path, capsys):
    folder, ours = _sharded(tmp_path)
    safetensors.torch.save_file({"weight": ours["weight"]}, str(folder / _A))  # bias is only in B
    _refused(tmp_path, folder, capsys, "puts 1 tensor(s) in " + _A)


def test_an_index_beside_a_model_safetensors_it_does_not_name_is_refused(tmp_path, capsys):
    folder, ours = _sharded(tmp_path)
    safetensors.torch.save_file(ours, str(folder / "model.safetensors"))
    _refused(tmp_path, folder, capsys, "holds both model.safetensors and model.safetensors.index.json")


def test_shards_without_their_index_are_refused(tmp_path, capsys):
    folder, _ = _sharded(tmp_path)
    (folder / "model.safetensors.index.json").unlink()
    _refused(tmp_path, folder, capsys, "but no model.safetensors.index.json")


@pytest.mark.parametrize("shard", ["../model.safetensors", "missing.safetensors"])
def test_an_index_naming_a_shard_outside_or_absent_is_refused(tmp_path, capsys, shard):
    folder, ours = _sharded(tmp_path)
    index = {"weight_map": {**dict.fromkeys(ours, _A), "extra": shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(tmp_path, folder, capsys, shard)
