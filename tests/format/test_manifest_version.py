"""The manifest's version rule: minor = an older reader still reads it right; anything it would
misread = a new major version, which an older reader refuses loudly (issue 47, item 3).

``shared`` (tensors outside the folder) came as 1.3, and a 1.2 reader skipped such a checkpoint
"as damaged" and restored an older one. A manifest that refers to shared files is 2.0; one that
does not is written as 1.2 (nothing in it is newer), so 1.x readers keep reading it; 1.3
manifests already on disk are still read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import create_model

from ckptsdk import CheckpointManager, TrainState
from ckptsdk.errors import ManifestError, NewerFormatError
from ckptsdk.format.document import Document, parse_document, seal
from ckptsdk.format.manifest import FORMAT, PLAIN_FORMAT, Manifest, SharedFile, parse_manifest

from .test_manifest import make_manifest

_SHARED = SharedFile(
    name="shared/0000000001.e1.0123456789abcdef.safetensors",
    size=10,
    digest="ab" * 16,
    algorithm="xxh3-128",
    tensors={"w": "cd" * 16},
)


def _reader_of_1_2() -> type[Document]:
    """The manifest model of a ckptsdk that reads format 1.2: every field of today's but ``shared``."""
    fields = {name: (f.annotation, f) for name, f in Manifest.model_fields.items() if name != "shared"}
    released = create_model("Released12", __base__=Document, **fields)  # type: ignore[call-overload]
    released.FORMAT = "ckptsdk.checkpoint/1.2"
    released.CHECKSUM_SINCE = 1
    return released


def test_a_manifest_is_2_0_exactly_when_it_refers_to_shared_files() -> None:
    assert FORMAT == "ckptsdk.checkpoint/2.0" and PLAIN_FORMAT == "ckptsdk.checkpoint/1.2"
    assert json.loads(make_manifest().to_json())["format"] == PLAIN_FORMAT
    assert json.loads(make_manifest(shared=[_SHARED]).to_json())["format"] == FORMAT
    # Both read back, whole.
    back = parse_manifest(make_manifest(shared=[_SHARED]).to_json())
    assert back.shared == [_SHARED]


def test_a_1_2_reader_reads_a_plain_manifest_and_refuses_a_shared_one_as_newer() -> None:
    released = _reader_of_1_2()
    assert parse_document(make_manifest().to_json(), released).step == 5700  # type: ignore[attr-defined]
    with pytest.raises(ManifestError, match=r"written by a newer ckptsdk .*upgrade ckptsdk"):
        parse_document(make_manifest(shared=[_SHARED]).to_json(), released)


def test_a_1_3_manifest_is_still_read() -> None:
    doc = json.loads(make_manifest(shared=[_SHARED]).to_json())
    old = seal({**{k: v for k, v in doc.items() if k != "checksum"}, "format": "ckptsdk.checkpoint/1.3"})
    assert parse_manifest(old).shared == [_SHARED]


def test_a_newer_major_is_a_newer_format_error_and_2_0_always_has_a_checksum() -> None:
    doc = json.loads(make_manifest().to_json())
    body = {k: v for k, v in doc.items() if k != "checksum"}
    with pytest.raises(NewerFormatError, match="upgrade ckptsdk") as info:
        parse_manifest(seal({**body, "format": "ckptsdk.checkpoint/3.0"}), key="k")
    assert info.value.step == 5700 and info.value.key == "k"
    with pytest.raises(ManifestError, match="no 'checksum' field"):
        parse_manifest((json.dumps({**body, "format": FORMAT}) + "\n").encode())


def test_a_checkpoint_saved_as_1_3_restores(tmp_path: Path) -> None:
    """What 0.x wrote before the rule (1.3 with ``shared``) restores with this ckptsdk."""
    root = tmp_path / "r"
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB: shared at the first save (no optimizer steps it)
    with CheckpointManager(str(root), save_on_signal=False, lease_ttl=30) as mgr:
        mgr.save(TrainState(model=model), step=1)
    path = next(root.glob("step-*/manifest.json"))
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["shared"]
    path.write_bytes(seal({**{k: v for k, v in doc.items() if k != "checksum"}, "format": "ckptsdk.checkpoint/1.3"}))
    fresh = torch.nn.Linear(1024, 1024)
    with CheckpointManager(str(root), read_only=True) as reader:
        assert reader.restore(TrainState(model=fresh)).step == 1  # type: ignore[union-attr]
    assert torch.equal(fresh.weight, model.weight)


def test_a_major_digit_flipped_by_damage_is_damage_not_newer() -> None:
    """One bit turns "2" into "3": the checksum tells damage (restore falls back) from a newer writer."""
    data = make_manifest(shared=[_SHARED]).to_json()
    flipped = data.replace(b'"ckptsdk.checkpoint/2.0"', b'"ckptsdk.checkpoint/3.0"')
    assert flipped != data
    with pytest.raises(ManifestError, match="checksum does not hold") as info:
        parse_manifest(flipped)
    assert not isinstance(info.value, NewerFormatError)
