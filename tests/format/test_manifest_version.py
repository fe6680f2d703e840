"""The manifest's version rule: minor = an older reader still reads it right; anything it would
misread = a new major version, which an older reader refuses loudly (issue 47, item 3).

``shared`` (tensors outside the folder) came as 1.3, and a 1.2 reader skipped such a checkpoint
"as damaged" and restored an older one. A manifest that refers to shared files is 2.0; one that
does not is written as 1.2 (nothing in it is newer), so 1.x readers keep reading it; 1.3
manifests already on disk are still read. ``referenced`` (tensors recorded by digest, in no file;
issue 48) is 3.0 for the same reason: a 2.0 reader refuses it as newer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import create_model

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState
from ckptsdk.errors import ManifestError, NewerFormatError
from ckptsdk.format.document import Document, parse_document, seal
from ckptsdk.format.manifest import (
    FORMAT,
    PLAIN_FORMAT,
    SHARED_FORMAT,
    Manifest,
    ReferencedBase,
    ReferencedTensor,
    SharedFile,
    parse_manifest,
)

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
    assert SHARED_FORMAT == "ckptsdk.checkpoint/2.0" and PLAIN_FORMAT == "ckptsdk.checkpoint/1.2"
    assert json.loads(make_manifest().to_json())["format"] == PLAIN_FORMAT
    assert json.loads(make_manifest(shared=[_SHARED]).to_json())["format"] == SHARED_FORMAT
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


def test_a_newer_major_is_a_newer_format_error_and_2_0_and_3_0_always_have_a_checksum() -> None:
    doc = json.loads(make_manifest().to_json())
    body = {k: v for k, v in doc.items() if k != "checksum"}
    with pytest.raises(NewerFormatError, match="upgrade ckptsdk") as info:
        parse_manifest(seal({**body, "format": "ckptsdk.checkpoint/4.0"}), key="k")
    assert info.value.step == 5700 and info.value.key == "k"
    for version in (SHARED_FORMAT, FORMAT):
        with pytest.raises(ManifestError, match="no 'checksum' field"):
            parse_manifest((json.dumps({**body, "format": version}) + "\n").encode())


def test_a_checkpoint_saved_as_1_3_restores(tmp_path: Path) -> None:
    """What 0.x wrote before the rule (1.3 with ``shared``) restores with this ckptsdk."""
    root = tmp_path / "r"
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB: shared at the first save (no optimizer steps it)
    with CheckpointManager(
        str(root), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        mgr.save(TrainState(model=model), step=1)
    path = next(root.glob("step-*/manifest.json"))
    doc = json.loads(path.read_text())
    assert doc["format"] == SHARED_FORMAT and doc["shared"]
    path.write_bytes(seal({**{k: v for k, v in doc.items() if k != "checksum"}, "format": "ckptsdk.checkpoint/1.3"}))
    fresh = torch.nn.Linear(1024, 1024)
    with CheckpointManager(str(root), read_only=True) as reader:
        assert reader.restore(TrainState(model=fresh)).step == 1  # type: ignore[union-attr]
    assert torch.equal(fresh.weight, model.weight)


def test_a_major_digit_flipped_by_damage_is_damage_not_newer() -> None:
    """One bit turns "2" into "6": the checksum tells damage (restore falls back) from a newer writer."""
    data = make_manifest(shared=[_SHARED]).to_json()
    flipped = data.replace(b'"ckptsdk.checkpoint/2.0"', b'"ckptsdk.checkpoint/6.0"')
    assert flipped != data
    with pytest.raises(ManifestError, match="checksum does not hold") as info:
        parse_manifest(flipped)
    assert not isinstance(info.value, NewerFormatError)


# --- referenced tensors (format 3.0, issue 48) --------------------------------------------------

_BASE = ReferencedBase(
    source="hf:gpt2@607a30d",
    algorithm="xxh3-128",
    tensors={"w": ReferencedTensor(dtype="float32", shape=[2], size=8, digest="ef" * 16)},
)


def _reader_of_2_0() -> type[Document]:
    """The manifest model of the ckptsdk before references: format 2.0, every field of today's but ``referenced``."""
    fields = {name: (f.annotation, f) for name, f in Manifest.model_fields.items() if name != "referenced"}
    released = create_model("Released20", __base__=Document, **fields)  # type: ignore[call-overload]
    released.FORMAT = "ckptsdk.checkpoint/2.0"
    released.ALSO_READS = ("ckptsdk.checkpoint/1.3",)
    released.CHECKSUM_SINCE = 1
    return released


def test_a_manifest_is_3_0_exactly_when_it_references_tensors_and_round_trips() -> None:
    assert FORMAT == "ckptsdk.checkpoint/3.0"
    data = make_manifest(referenced=[_BASE]).to_json()
    assert json.loads(data)["format"] == FORMAT
    assert json.loads(make_manifest(referenced=[_BASE], shared=[]).to_json())["referenced"] == [
        {"source": "hf:gpt2@607a30d", "algorithm": "xxh3-128", "tensors": {"w": _BASE.tensors["w"].model_dump()}}
    ]
    back = parse_manifest(data, key="k")
    assert back.referenced == [_BASE] and back.to_json() == data
    assert back.referenced_tensors() == {"w": (_BASE, _BASE.tensors["w"])}
    # Without references nothing changes: the field is absent, the version the oldest that holds it.
    assert "referenced" not in json.loads(make_manifest(shared=[_SHARED]).to_json())
    unlabelled = _BASE.model_copy(update={"source": None})
    assert parse_manifest(make_manifest(referenced=[unlabelled]).to_json()).referenced[0].source is None


def test_a_2_0_reader_refuses_a_manifest_with_references_as_newer_and_reads_the_rest() -> None:
    released = _reader_of_2_0()
    assert parse_document(make_manifest(shared=[_SHARED]).to_json(), released).step == 5700  # type: ignore[attr-defined]
    assert parse_document(make_manifest().to_json(), released).step == 5700  # type: ignore[attr-defined]
    with pytest.raises(NewerFormatError, match=r"written by a newer ckptsdk .*upgrade ckptsdk"):
        parse_document(make_manifest(referenced=[_BASE]).to_json(), released)
    # As a 2.1 (a minor) the same reader would drop the field and see a tree whose tensor "w" is
    # in no file: the misreading the major version prevents.
    doc = json.loads(make_manifest(referenced=[_BASE]).to_json())
    minor = seal({**{k: v for k, v in doc.items() if k != "checksum"}, "format": "ckptsdk.checkpoint/2.1"})
    misread = parse_document(minor, released)
    assert not hasattr(misread, "referenced") and not misread.shared  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"size": 4}, "size 4 is not shape [2] times 4 bytes of float32"),
        ({"dtype": "float31"}, "unknown dtype 'float31'"),
        ({"shape": [-1]}, "greater than or equal to 0"),
        ({"digest": "XY"}, "should match pattern"),
    ],
)
def test_a_bad_referenced_entry_is_refused(change: dict, reason: str) -> None:
    doc = json.loads(make_manifest(referenced=[_BASE]).to_json())
    doc["referenced"][0]["tensors"]["w"].update(change)
    with pytest.raises(ManifestError, match=re.escape(reason)):
        parse_manifest(seal({k: v for k, v in doc.items() if k != "checksum"}), key="k")


def test_a_reference_must_name_a_tensor_of_the_tree_with_its_dtype_and_shape_and_one_place() -> None:
    wrong_shape = _BASE.model_copy(
        update={"tensors": {"w": ReferencedTensor(dtype="float32", shape=[1, 2], size=8, digest="ef" * 16)}}
    )
    with pytest.raises(ManifestError, match=re.escape("'w' is float32 [1, 2] there but float32 [2] in the tree")):
        parse_manifest(make_manifest(referenced=[wrong_shape]).to_json(), key="k")
    stray = _BASE.model_copy(update={"tensors": {"nope": _BASE.tensors["w"]}})
    with pytest.raises(ManifestError, match="'nope' is no tensor of the tree"):
        parse_manifest(make_manifest(referenced=[stray]).to_json(), key="k")
    with pytest.raises(ValueError, match="both taken from a shared file and referenced"):
        make_manifest(referenced=[_BASE], shared=[_SHARED])
    with pytest.raises(ValueError, match="referenced twice"):
        make_manifest(referenced=[_BASE, _BASE.model_copy(update={"source": "other"})])
