"""Tensor files: byte-identical to safetensors, every dtype round-trips, corruption is caught.

Tests taking ``backend`` run on every backend kind (conftest: memory, local, drive, gcs emulator);
``local`` ones inspect or damage the file on disk.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import xxhash

from ckptsdk import open_backend
from ckptsdk.errors import ConfigError, CorruptCheckpointError
from ckptsdk.format.digest import DEFAULT as DIGEST_ALGORITHM
from ckptsdk.format.dtype import TABLE, byte_view, to_torch
from ckptsdk.format.files.tensorfile import (
    open_tensorfile,
    read_header,
    read_tensorfile,
    verify_file,
    write_tensorfile,
)

KEY = "step-0000000001.e1/tensors.safetensors"
#: Every dtype a tensor file can hold that this torch has.
DTYPES = [dt for dt in map(to_torch, TABLE) if dt is not None]


@pytest.fixture
def local(tmp_path):
    return open_backend(str(tmp_path / "root")), tmp_path / "root"


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random values of ``dtype`` (every bit pattern for the float8 kinds, via raw bytes)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def test_format_md_lists_every_dtype_of_the_table():
    text = (Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md").read_text()
    table = text.split("<!-- dtypes:begin -->")[1].split("<!-- dtypes:end -->")[0]
    documented = set(re.findall(r"`([A-Z0-9_]+)` \| `([a-z0-9_]+)`", table))
    assert documented == {(d.code, d.name) for d in TABLE}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (compares NaN payloads and float8 exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _state() -> dict[str, torch.Tensor]:
    return {
        "layer.weight": torch.randn(64, 33),
        "layer.bias": torch.randn(64).to(torch.bfloat16),
        "bn.num_batches_tracked": torch.tensor(7),
        "rng": torch.get_rng_state(),
        "mask": torch.rand(10) > 0.5,
        "empty": torch.zeros(0, 3),
        "scalar_f16": torch.tensor(1.5, dtype=torch.float16),
        "big": torch.randn(4_500_000),  # > 16 MiB: written as several slices of its own memory
        "ümlaut/name": torch.arange(5, dtype=torch.int32),
    }


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}])
def test_bytes_identical_to_safetensors_save(local, metadata):
    backend, root = local
    tensors = _state()
    size, digest = write_tensorfile(backend, KEY, tensors, metadata=metadata)
    data = (root / KEY).read_bytes()
    assert data == safetensors.torch.save(tensors, metadata=metadata)
    assert size == len(data)
    assert digest == xxhash.xxh3_128(data).hexdigest()
    assert DIGEST_ALGORITHM == "xxh3-128"


def test_bytes_identical_for_every_dtype(local):
    backend, root = local
    tensors = {f"t_{str(dt)[6:]}": _sample(dt, (3, 5), i) for i, dt in enumerate(DTYPES)}
    size, digest = write_tensorfile(backend, KEY, tensors)
    assert (root / KEY).read_bytes() == safetensors.torch.save(tensors)


def test_safetensors_own_loader_reads_it(local):
    backend, root = local
    tensors = _state()
    write_tensorfile(backend, KEY, tensors, metadata={"step": "1", "note": "ok"})
    loaded = safetensors.torch.load_file(str(root / KEY))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with safetensors.safe_open(str(root / KEY), framework="pt") as f:
        assert f.metadata() == {"step": "1", "note": "ok"}


@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (7,), (4, 3, 2)], ids=str)
def test_round_trip_every_dtype(backend, shape):
    tensors = {f"x.{str(dt)[6:]}": _sample(dt, shape, i) for i, dt in enumerate(DTYPES)}
    size, digest = write_tensorfile(backend, KEY, tensors)
    out = read_tensorfile(backend, KEY, size=size, digest=digest)
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype, name
        assert out[name].shape == t.shape, name
        assert out[name].device.type == "cpu"
        assert torch.equal(_bits(out[name]), _bits(t)), name


def test_restored_tensors_are_independent_of_file_and_source(local):
    backend, root = local
    tensors = _state()
    size, digest = write_tensorfile(backend, KEY, tensors)
    out = read_tensorfile(backend, KEY, size=size, digest=digest)
    expected = {k: v.clone() for k, v in out.items()}
    (root / KEY).write_bytes(b"\0" * size)  # overwrite the file in place: no mmap behind us
    tensors["big"].zero_()
    for name in out:
        assert torch.equal(_bits(out[name]), _bits(expected[name])), name
    out["layer.weight"].add_(1)  # writable memory of our own
    assert out["big"].abs().sum() > 0


def test_noncontiguous_grad_and_expanded_tensors(local):
    backend, root = local
    param = torch.nn.Parameter(torch.randn(20, 30))
    tensors = {
        "t": torch.randn(40, 50).t(),
        "param": param,
        "expanded": torch.randn(1, 6).expand(300_000, 6),  # stride 0; 7 MB once materialised
        "sliced": torch.randn(100, 100)[::3, 1::2],
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
    }
    size, digest = write_tensorfile(backend, KEY, tensors)
    data = (root / KEY).read_bytes()
    assert data == safetensors.torch.save({k: v.detach().resolve_conj().contiguous() for k, v in tensors.items()})
    assert digest == xxhash.xxh3_128(data).hexdigest()
    out = read_tensorfile(backend, KEY, size=size, digest=digest)
    for name, t in tensors.items():
        assert torch.equal(out[name], t.detach()), name
    assert not out["param"].requires_grad


def test_sha256_manifests_are_readable(local):
    backend, root = local
    tensors = _state()
    size, _ = write_tensorfile(backend, KEY, tensors)
    sha = hashlib.sha256((root / KEY).read_bytes()).hexdigest()
    out = read_tensorfile(backend, KEY, size=size, digest=sha, algorithm="sha256")
    assert torch.equal(out["big"], tensors["big"])
    verify_file(backend, KEY, size=size, digest=sha.upper(), algorithm="sha256")
    with pytest.raises(ConfigError, match="unknown digest algorithm 'md5'"):
        read_tensorfile(backend, KEY, size=size, digest=sha, algorithm="md5")


def test_md5_is_refused_for_checkpoint_files(local):
    # md5 is in the digest table (dataset checksums) but no ckptsdk ever wrote it for a
    # checkpoint: a manifest naming it is refused before any byte is read.
    backend, root = local
    size, _ = write_tensorfile(backend, KEY, _state())
    md5 = hashlib.md5((root / KEY).read_bytes()).hexdigest()
    for read in (read_tensorfile, verify_file):
        with pytest.raises(ConfigError, match="unknown digest algorithm 'md5'.*xxh3-128, sha256"):
            read(backend, KEY, size=size, digest=md5, algorithm="md5")


def _corrupt_check(backend, key, size, digest, match, **kw):
    """Both readers must refuse the file with CorruptCheckpointError naming the key."""
    with pytest.raises(CorruptCheckpointError, match=match) as err:
        read_tensorfile(backend, key, size=size, digest=digest, **kw)
    assert err.value.key == key and key in str(err.value)
    assert err.value.url == backend.url
    return err.value


def test_flipped_byte_is_caught(local):
    backend, root = local
    size, digest = write_tensorfile(backend, KEY, _state())
    path = root / KEY
    data = bytearray(path.read_bytes())
    data[size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    _corrupt_check(backend, KEY, size, digest, "xxh3-128 digest .* differs")
    with pytest.raises(CorruptCheckpointError, match="differs"):
        verify_file(backend, KEY, size=size, digest=digest, algorithm=DIGEST_ALGORITHM)
    assert path.read_bytes() == bytes(data)  # a reader never deletes or repairs evidence


def test_truncated_and_extended_files_are_caught(local):
    backend, root = local
    size, digest = write_tensorfile(backend, KEY, _state())
    path = root / KEY
    data = path.read_bytes()
    path.write_bytes(data[: size - 100])
    _corrupt_check(backend, KEY, size, digest, f"truncated: {size - 100} bytes where the manifest says {size}")
    path.write_bytes(data + b"x")
    _corrupt_check(backend, KEY, size, digest, "longer than")
    with pytest.raises(CorruptCheckpointError, match="longer than"):
        verify_file(backend, KEY, size=size, digest=digest)
    path.write_bytes(data)
    verify_file(backend, KEY, size=size, digest=digest)  # intact again: nothing was lost


def test_missing_file_is_corrupt(backend):
    _corrupt_check(backend, "nope/tensors.safetensors", 10, "00", "missing")


def _store(backend, key: str, data: bytes) -> tuple[int, str]:
    backend.write(key, data)
    return len(data), xxhash.xxh3_128(data).hexdigest()


@pytest.mark.parametrize(
    "blob, why",
    [
        (b"\x01\x02", "shorter than the 8-byte header length"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length .* exceeds"),
        (struct.pack("<Q", 8) + b"not json", "not valid JSON"),
        (struct.pack("<Q", 8) + b"[1,2]   ", "not a JSON object"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "not valid JSON"),
    ],
    ids=["tiny", "huge-length", "junk", "array", "bad-utf8"],
)
def test_junk_header_is_caught(backend, blob, why):
    size, digest = _store(backend, KEY, blob)  # a matching digest: only the parser can object
    _corrupt_check(backend, KEY, size, digest, why)
    with pytest.raises(CorruptCheckpointError, match=why):  # one parser: read_header agrees
        read_header(backend, KEY)


def _with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    "entry, data, why",
    [
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, b"\0" * 8, "needs 12"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, b"\0" * 12, "covers 8 data bytes but the file has 12"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}, b"\0" * 12, "starts at byte 4, expected 0"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, b"\0" * 8, "needs 16"),
        ({"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}, b"\0" * 8, "malformed header entry"),
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, b"\0" * 8, "malformed header entry"),
        ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, b"\0" * 8, "malformed header entry"),
        ({"dtype": "F32", "shape": [2]}, b"\0" * 8, "malformed header entry"),
        ("F32", b"\0" * 8, "malformed header entry"),
    ],
    ids=["short-span", "uncovered", "gap", "past-end", "dtype", "negative", "shape-str", "no-offsets", "not-obj"],
)
def test_malformed_header_entries_are_caught(backend, entry, data, why):
    size, digest = _store(backend, KEY, _with_header({"w": entry}, data))
    _corrupt_check(backend, KEY, size, digest, why)
    with pytest.raises(CorruptCheckpointError, match=why):  # one parser: read_header agrees
        read_header(backend, KEY)


def test_read_header_describes_every_tensor(backend):
    tensors = {"b": torch.ones(2, 3, dtype=torch.bfloat16), "a": torch.arange(4), "e": torch.zeros(0)}
    write_tensorfile(backend, KEY, tensors)
    got = {e.name: (e.dtype, e.code, e.shape, e.nbytes) for e in read_header(backend, KEY)}
    assert got == {
        "a": (torch.int64, "I64", [4], 32),
        "b": (torch.bfloat16, "BF16", [2, 3], 12),
        "e": (torch.float32, "F32", [0], 0),
    }


def test_misaligned_foreign_file_still_loads(backend):
    # Another writer may put a 1-byte tensor before a 4-byte one: a view would be misaligned.
    blob = _with_header(
        {
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
        },
        b"\x07" + struct.pack("<2f", 1.5, -2.0),
    )
    size, digest = _store(backend, KEY, blob)
    out = read_tensorfile(backend, KEY, size=size, digest=digest)
    assert out["a"].tolist() == [7]
    assert out["b"].tolist() == [1.5, -2.0]


def test_bad_inputs_refused_before_anything_is_written(backend):
    good = {"w": torch.ones(3)}
    size, digest = write_tensorfile(backend, KEY, good)
    bad_cases = [
        ({"w": torch.ones(2, dtype=torch.complex128)}, None, "safetensors cannot store"),
        ({"w": torch.ones(2).to_sparse()}, None, "dense"),
        ({"__metadata__": torch.ones(1)}, None, "__metadata__"),
        ({"w": [1, 2]}, None, "not a torch.Tensor"),
        ({"w": torch.ones(1)}, {"k": 1}, "metadata must map str to str"),
    ]
    for tensors, metadata, why in bad_cases:
        with pytest.raises(ConfigError, match=why):
            write_tensorfile(backend, KEY, tensors, metadata=metadata)
    # The earlier file is untouched by every refused write.
    assert torch.equal(read_tensorfile(backend, KEY, size=size, digest=digest)["w"], good["w"])


def test_failing_write_leaves_previous_object(local, monkeypatch):
    backend, root = local
    size, digest = write_tensorfile(backend, KEY, {"w": torch.ones(3)})

    def explode(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # Fail inside the backend's write loop, after the temp file was opened.
    import ckptsdk.format.files.tensorwriter as tw

    monkeypatch.setattr(tw, "byte_view", explode)
    with pytest.raises(OSError, match="No space left"):
        write_tensorfile(backend, KEY, {"w": torch.zeros(100_000)})
    monkeypatch.undo()
    assert torch.equal(read_tensorfile(backend, KEY, size=size, digest=digest)["w"], torch.ones(3))
    assert sorted(p.name for p in (root / KEY).parent.iterdir()) == ["tensors.safetensors"]


def test_verify_file_accepts_intact_and_reports_digest_mismatch(backend):
    size, digest = write_tensorfile(backend, KEY, _state())
    verify_file(backend, KEY, size=size, digest=digest)
    wrong = "0" * 32
    with pytest.raises(CorruptCheckpointError, match=f"differs from the recorded {wrong}") as err:
        verify_file(backend, KEY, size=size, digest=wrong)
    assert err.value.key == KEY


def test_each_restored_tensor_owns_its_memory(backend):
    # torch.set_rng_state segfaults on a view at a non-zero storage offset: restored tensors
    # must each own their storage, starting at offset 0.
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    expected = torch.rand(3)
    tensors = {"a": torch.ones(1000), "rng": state, "z": torch.zeros(3, dtype=torch.uint8)}
    size, digest = write_tensorfile(backend, KEY, tensors)
    out = read_tensorfile(backend, KEY, size=size, digest=digest)
    assert all(t.storage_offset() == 0 for t in out.values())
    assert len({t.untyped_storage().data_ptr() for t in out.values()}) == len(out)
    torch.set_rng_state(out["rng"])
    assert torch.equal(torch.rand(3), expected)


def test_live_tensors_are_filled_only_where_the_bytes_fit_their_memory(local):
    """``TensorFile.allocate`` takes a live tensor only where the file's bytes can go into its
    memory as they are: a transposed view (its memory is not the row-major bytes), another
    dtype or another shape gets a fresh tensor, and the live one is left as it was."""
    backend, _ = local
    saved = {"fits": torch.arange(6.0).reshape(2, 3), "view": torch.arange(6.0).reshape(2, 3) + 10,
             "dtype": torch.ones(3), "shape": torch.ones(4)}  # fmt: skip
    size, digest = write_tensorfile(backend, KEY, saved)
    live = {
        "fits": torch.zeros(2, 3),
        "view": torch.zeros(3, 2).t(),  # shape (2, 3), not contiguous
        "dtype": torch.zeros(3, dtype=torch.float64),
        "shape": torch.zeros(5),
    }
    before = {k: v.clone() for k, v in live.items()}
    with open_tensorfile(backend, KEY, size=size, digest=digest) as tf:
        got = tf.allocate(live)
        tf.fill()
    assert got["fits"] is live["fits"]
    assert all(got[k] is not live[k] for k in ("view", "dtype", "shape"))
    for k, v in saved.items():
        assert torch.equal(got[k], v), k
    for k in ("view", "dtype", "shape"):
        assert torch.equal(live[k], before[k]), k


def test_byte_view_refuses_a_tensor_whose_view_would_be_a_copy():
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(3, 2).t())


def test_reads_spanning_many_chunks_round_trip_and_catch_damage_in_a_late_chunk(backend, monkeypatch):
    """A local file is read (and hashed) in LOCAL_CHUNK pieces, an object store's in READ_CHUNK
    pieces; both shrunk here so that tensors, the small-tensor batches and the skipped (unwanted)
    tensors all cross chunk boundaries. Every byte lands where it belongs, and a flipped byte in
    the last chunk is caught."""
    from ckptsdk.format.files import hashedread

    monkeypatch.setattr(hashedread, "LOCAL_CHUNK", 4096)
    monkeypatch.setattr(hashedread, "READ_CHUNK", 4096)
    g = torch.Generator().manual_seed(3)
    saved = {
        "big": torch.randn(10_000, generator=g),  # 40,000 bytes: ten chunks
        **{f"small{i}": torch.randn(700 + i, generator=g) for i in range(12)},  # batched, crossing chunks
        "skipped": torch.randn(5_000, generator=g),
        "tail": torch.randn(3_001, generator=g),
    }
    size, digest = write_tensorfile(backend, KEY, saved)
    with backend.open(KEY) as f:
        reader = hashedread.HashedReader(backend, KEY, f, size, digest, DIGEST_ALGORITHM)
        assert reader.chunk == 4096
    with open_tensorfile(backend, KEY, size=size, digest=digest) as tf:
        got = tf.allocate(wanted=set(saved) - {"skipped"})
        tf.fill()
    assert set(got) == set(saved) - {"skipped"}
    for name, t in got.items():
        assert torch.equal(t, saved[name]), name
    data = bytearray(backend.read(KEY))
    data[size - 10] ^= 0x01
    backend.write(KEY, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="differs"):
        read_tensorfile(backend, KEY, size=size, digest=digest)
    assert backend.read(KEY) == bytes(data)  # the evidence is kept


def test_a_local_file_is_read_in_cache_sized_chunks_an_object_store_in_large_ones(local):
    from ckptsdk.format.files import hashedread

    backend, _ = local
    size, digest = write_tensorfile(backend, KEY, {"w": torch.ones(4)})
    with backend.open(KEY) as f:
        assert hashedread.HashedReader(backend, KEY, f, size, digest, DIGEST_ALGORITHM).chunk == hashedread.LOCAL_CHUNK
    memory = open_backend("memory://chunks-demo")
    write_tensorfile(memory, KEY, {"w": torch.ones(4)})
    with memory.open(KEY) as f:
        assert hashedread.HashedReader(memory, KEY, f, size, digest, DIGEST_ALGORITHM).chunk == hashedread.READ_CHUNK
