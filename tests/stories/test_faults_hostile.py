"""Fault suite, part 2: hostile files. One test per attack, each on a copy of a real root.

The root holds steps 1 and 2 (both exact states from tests/support/_fault_state.py). An attack damages
or forges one thing. What must follow, per kind:

- ``fallback``: restore skips the damaged step 2 and returns step 1, exactly;
- ``intact``: the attack must change nothing: restore returns step 2, exactly (no fresh start,
  no older step);
- ``refused``: the operation fails fast with the named ``CkptError``, and nothing is lost.

Every test is bounded by a timeout: a hang is a failure. The attack list is ATTACKS below (the
closing note of issue 15 counts them).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import xxhash

from ckptsdk import CheckpointManager, LeaseOptions
from ckptsdk.errors import ConfigError, CorruptCheckpointError, DataError, LeaseError
from ckptsdk.format.document import seal
from ckptsdk.format.layout import MANIFEST, TENSORS
from ckptsdk.manager import Simulation
from tests.support._fault_state import expected, make_state, observe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "base"
    with CheckpointManager(str(root), _simulation=Simulation(heartbeat=False)) as mgr:
        mgr.restore(make_state(0))
        mgr.log_step(1, loss=0.5)
        mgr.save(make_state(1), step=1)
        mgr.log_step(2, loss=0.25)
        mgr.save(make_state(2), step=2)
    return root


@pytest.fixture
def root(base, tmp_path) -> Path:
    copy = tmp_path / "root"
    shutil.copytree(base, copy, symlinks=True)
    return copy


def _folder(root: Path, step: int) -> Path:
    (found,) = root.glob(f"step-{step:010d}.e*")
    return found


def _doc(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_bytes())


def _write_doc(folder: Path, doc: dict, *, reseal: bool) -> None:
    (folder / MANIFEST).write_bytes(seal(doc) if reseal else json.dumps(doc).encode())


def _rewrite_tensors(folder: Path, change: Callable[[dict, dict], None]) -> None:
    """Change the tensors (and the manifest tree), then make size, digest and checksum match:
    the file is then consistent, and only what it *says* is hostile."""
    tensors = safetensors.torch.load_file(str(folder / TENSORS))
    doc = _doc(folder)
    change(tensors, doc)
    safetensors.torch.save_file(tensors, str(folder / TENSORS))
    data = (folder / TENSORS).read_bytes()
    doc["files"] = [{**doc["files"][0], "size": len(data), "digest": xxhash.xxh3_128_hexdigest(data)}]
    _write_doc(folder, doc, reseal=True)


def _raw_tensorfile(folder: Path, header: bytes, data: bytes = b"", *, hlen: int | None = None) -> None:
    """Replace the tensor file by a crafted one, with a manifest that vouches for it."""
    blob = struct.pack("<Q", len(header) if hlen is None else hlen) + header + data
    (folder / TENSORS).write_bytes(blob)
    doc = _doc(folder)
    doc["files"] = [{**doc["files"][0], "size": len(blob), "digest": xxhash.xxh3_128_hexdigest(blob)}]
    _write_doc(folder, doc, reseal=True)


def _rng(doc: dict) -> dict:
    return doc["tree"]["rng"]


def _path_of(doc_tree: dict, *keys: str) -> str:
    node = doc_tree
    for k in keys:
        node = node[k]
    return node["$tensor"] if "$tensor" in node else node["$ndarray"]


# ---------------------------------------------------------------------------------- attacks


def flip_momentum(root: Path) -> None:  # the example: 0.9 read as 0.8
    f = _folder(root, 2)
    (f / MANIFEST).write_bytes((f / MANIFEST).read_bytes().replace(b'"momentum":0.9', b'"momentum":0.8'))


def swap_tensor_paths(root: Path) -> None:  # the manifest points a weight at another tensor
    f = _folder(root, 2)
    raw = (f / MANIFEST).read_bytes()
    assert b"objects/model/weight" in raw and b"objects/model/bias" in raw
    raw = raw.replace(b'"objects/model/weight"', b'"@@"').replace(b'"objects/model/bias"', b'"objects/model/weight"')
    (f / MANIFEST).write_bytes(raw.replace(b'"@@"', b'"objects/model/bias"'))


def flip_every_byte_class(root: Path) -> None:  # one bit in the middle of the manifest
    f = _folder(root, 2)
    raw = bytearray((f / MANIFEST).read_bytes())
    raw[len(raw) // 2] ^= 0x04
    (f / MANIFEST).write_bytes(bytes(raw))


def truncate_manifest(root: Path) -> None:
    f = _folder(root, 2)
    (f / MANIFEST).write_bytes((f / MANIFEST).read_bytes()[:-30])


def empty_manifest(root: Path) -> None:
    (_folder(root, 2) / MANIFEST).write_bytes(b"")


def nested_manifest(root: Path) -> None:
    (_folder(root, 2) / MANIFEST).write_bytes(b"[" * 200_000 + b"]" * 200_000)


def downgrade_format(root: Path) -> None:  # '1.1' -> '1.0' is one bit
    f = _folder(root, 2)
    doc = _doc(f)
    doc["format"] = "ckptsdk.checkpoint/1.0"
    _write_doc(f, doc, reseal=False)


def strip_checksum(root: Path) -> None:
    f = _folder(root, 2)
    doc = _doc(f)
    del doc["checksum"]
    _write_doc(f, doc, reseal=False)


def tree_drops_momentum(root: Path) -> None:  # the issue: a momentum buffer missing from the tree
    f = _folder(root, 2)
    doc = _doc(f)
    state = doc["tree"]["objects"]["optimizer"]["state"]["$dict"]
    state[0][1] = {k: v for k, v in state[0][1].items() if k != "momentum_buffer"}
    _write_doc(f, doc, reseal=True)


def claim_100gb(root: Path) -> None:  # the manifest says the file is 100 GB
    f = _folder(root, 2)
    doc = _doc(f)
    doc["files"][0]["size"] = 100 * 10**9
    _write_doc(f, doc, reseal=True)


def manifest_padded(root: Path) -> None:  # a newer minor's unknown field, 80 MB, correctly sealed
    f = _folder(root, 2)
    doc = _doc(f)
    doc["format"] = doc["format"].rsplit(".", 1)[0] + ".99"
    doc["padding"] = [0] * (40 << 20)
    _write_doc(f, doc, reseal=True)


def unknown_digest_algorithm(root: Path) -> None:
    f = _folder(root, 2)
    doc = _doc(f)
    doc["files"][0]["algorithm"] = "md5"
    _write_doc(f, doc, reseal=True)


def manifest_in_wrong_folder(root: Path) -> None:  # step 1's manifest copied over step 2's
    (_folder(root, 2) / MANIFEST).write_bytes((_folder(root, 1) / MANIFEST).read_bytes())


def tensor_bit_flip(root: Path) -> None:
    f = _folder(root, 2) / TENSORS
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10
    f.write_bytes(bytes(raw))


def tensor_truncated(root: Path) -> None:
    f = _folder(root, 2) / TENSORS
    f.write_bytes(f.read_bytes()[:-9])


def tensor_extended(root: Path) -> None:
    f = _folder(root, 2) / TENSORS
    f.write_bytes(f.read_bytes() + b"\0")


def tensor_is_fifo(root: Path) -> None:
    f = _folder(root, 2) / TENSORS
    f.unlink()
    os.mkfifo(f)


def tensor_is_symlink_loop(root: Path) -> None:
    f = _folder(root, 2) / TENSORS
    f.unlink()
    os.symlink(TENSORS, f)  # points at itself


def tensor_is_folder(root: Path) -> None:
    f = _folder(root, 2) / TENSORS
    f.unlink()
    f.mkdir()


def tensor_is_dev_zero(root: Path) -> None:
    f = _folder(root, 2) / TENSORS
    f.unlink()
    os.symlink("/dev/zero", f)


def header_huge_dims(root: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}).encode()
    _raw_tensorfile(_folder(root, 2), header, b"\0" * 16)


def header_100gb_tensor(root: Path) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [100 * 10**9], "data_offsets": [0, 100 * 10**9]}}).encode()
    _raw_tensorfile(_folder(root, 2), header, b"\0" * 16)


def header_zero_dim_overflow(root: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}).encode()
    _raw_tensorfile(_folder(root, 2), header)


def header_length_absurd(root: Path) -> None:
    _raw_tensorfile(_folder(root, 2), b"{}", hlen=2**63)


def header_nested(root: Path) -> None:
    _raw_tensorfile(_folder(root, 2), b"[" * 100_000 + b"]" * 100_000)


def header_too_many_dims(root: Path) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [1] * 100_000, "data_offsets": [0, 1]}}).encode()
    _raw_tensorfile(_folder(root, 2), header, b"\0")


def header_not_an_object(root: Path) -> None:
    _raw_tensorfile(_folder(root, 2), json.dumps({"w": "F32"}).encode())


def python_rng_position_625(root: Path) -> None:
    f = _folder(root, 2)
    doc = _doc(f)
    _rng(doc)["python"]["$tuple"][1]["$tuple"][-1] = 625
    _write_doc(f, doc, reseal=True)


def python_rng_word_2_64(root: Path) -> None:
    f = _folder(root, 2)
    doc = _doc(f)
    _rng(doc)["python"]["$tuple"][1]["$tuple"][0] = {"$int": hex(2**64)}
    _write_doc(f, doc, reseal=True)


def python_rng_version_2(root: Path) -> None:
    f = _folder(root, 2)
    doc = _doc(f)
    _rng(doc)["python"]["$tuple"][0] = 2
    _write_doc(f, doc, reseal=True)


def numpy_rng_other_generator(root: Path) -> None:
    f = _folder(root, 2)
    doc = _doc(f)
    _rng(doc)["numpy"]["bit_generator"] = "PCG64"
    _write_doc(f, doc, reseal=True)


def numpy_rng_position_700(root: Path) -> None:
    f = _folder(root, 2)
    doc = _doc(f)
    _rng(doc)["numpy"]["state"]["pos"] = 700
    _write_doc(f, doc, reseal=True)


def torch_rng_garbage(root: Path) -> None:
    def change(tensors: dict, doc: dict) -> None:
        path = _path_of(doc["tree"], "rng", "torch")
        tensors[path] = torch.full_like(tensors[path], 255)

    _rewrite_tensors(_folder(root, 2), change)


def numpy_rng_key_short(root: Path) -> None:
    def change(tensors: dict, doc: dict) -> None:
        key = doc["tree"]["rng"]["numpy"]["state"]["key"]
        tensors[key["$ndarray"]] = tensors[key["$ndarray"]][:100].clone()
        key["shape"] = [100]

    _rewrite_tensors(_folder(root, 2), change)


def folder_is_symlink_loop(root: Path) -> None:
    f = _folder(root, 2)
    shutil.rmtree(f)
    os.symlink(f.name, f)


def manifest_is_fifo(root: Path) -> None:
    f = _folder(root, 2) / MANIFEST
    f.unlink()
    os.mkfifo(f)


def stray_lineage_fresh_start(root: Path) -> None:  # the example: epoch 999, resumed from nothing
    (root / "lineage" / "epoch-000999.json").write_bytes(
        seal(
            {
                "format": "ckptsdk.lineage/1.1",
                "epoch": 999,
                "attempt": 999,
                "run_id": "x",
                "resumed_from_step": None,
                "resumed_from_epoch": None,
                "host": "h",
                "pid": 1,
                "created_at": "2026-11-30T06:10:00Z",
            }
        )
    )


def stray_lineage_older_step(root: Path) -> None:
    (root / "lineage" / "epoch-000999.json").write_bytes(
        seal(
            {
                "format": "ckptsdk.lineage/1.1",
                "epoch": 999,
                "attempt": 999,
                "run_id": "x",
                "resumed_from_step": 1,
                "resumed_from_epoch": 1,
                "host": "h",
                "pid": 1,
                "created_at": "2026-11-30T06:10:00Z",
            }
        )
    )


def stray_lineage_next_epoch(root: Path) -> None:  # the very next epoch, that no writer took
    (root / "lineage" / "epoch-000002.json").write_bytes(
        seal(
            {
                "format": "ckptsdk.lineage/1.1",
                "epoch": 2,
                "attempt": 2,
                "run_id": "x",
                "resumed_from_step": None,
                "resumed_from_epoch": None,
                "host": "h",
                "pid": 1,
                "created_at": "2026-11-30T06:10:00Z",
            }
        )
    )


def lineage_garbage(root: Path) -> None:
    (root / "lineage" / "epoch-000999.json").write_bytes(b"\x00garbage")


def lineage_bit_flip(root: Path) -> None:
    (record,) = (root / "lineage").glob("epoch-*.json")
    record.write_bytes(record.read_bytes().replace(b'"resumed_from_step":null', b'"resumed_from_step":1'))


def own_lineage_rewritten(root: Path) -> None:  # epoch 1's own record now says it resumed from step 1
    (record,) = (root / "lineage").glob("epoch-*.json")
    _write = json.loads(record.read_bytes())
    _write["resumed_from_step"] = 1
    record.write_bytes(seal(_write))


def runlog_nested_line(root: Path) -> None:
    (chunk,) = sorted((root / "runlog").glob("attempt-*/chunk-*.jsonl"))[-1:]
    chunk.write_bytes(chunk.read_bytes() + b"[" * 100_000 + b"]" * 100_000 + b"\n")


def runlog_huge_number(root: Path) -> None:
    (chunk,) = sorted((root / "runlog").glob("attempt-*/chunk-*.jsonl"))[-1:]
    chunk.write_bytes(chunk.read_bytes() + b'{"step": 3, "time": 0, "scalars": {"loss": 1' + b"0" * 400 + b"}}\n")


FALLBACK = [
    flip_momentum,
    swap_tensor_paths,
    flip_every_byte_class,
    truncate_manifest,
    empty_manifest,
    nested_manifest,
    downgrade_format,
    strip_checksum,
    tree_drops_momentum,
    claim_100gb,
    manifest_padded,
    unknown_digest_algorithm,
    manifest_in_wrong_folder,
    tensor_bit_flip,
    tensor_truncated,
    tensor_extended,
    tensor_is_fifo,
    tensor_is_symlink_loop,
    tensor_is_folder,
    tensor_is_dev_zero,
    header_huge_dims,
    header_100gb_tensor,
    header_zero_dim_overflow,
    header_length_absurd,
    header_nested,
    header_too_many_dims,
    header_not_an_object,
    python_rng_position_625,
    python_rng_word_2_64,
    python_rng_version_2,
    numpy_rng_other_generator,
    numpy_rng_position_700,
    torch_rng_garbage,
    numpy_rng_key_short,
    folder_is_symlink_loop,
    manifest_is_fifo,
]
INTACT = [
    stray_lineage_fresh_start,
    stray_lineage_older_step,
    stray_lineage_next_epoch,
    lineage_garbage,
    lineage_bit_flip,
    own_lineage_rewritten,
    runlog_nested_line,
    runlog_huge_number,
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attack", FALLBACK, ids=lambda f: f.__name__)
def test_damaged_newest_falls_back_to_the_previous_one_exactly(root, attack):
    attack(root)
    report = observe(str(root))
    assert report["step"] == 1 and report["digest"] == expected(1), report
    assert report["valid"] == {"1": expected(1)}, report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attack", INTACT, ids=lambda f: f.__name__)
def test_stray_records_change_nothing(root, attack):
    attack(root)
    report = observe(str(root))
    assert report["step"] == 2 and report["digest"] == expected(2), report
    # A writer opening the root is neither fenced nor sent back: it resumes at 2 and saves 3.
    with CheckpointManager(str(root), _simulation=Simulation(heartbeat=False)) as mgr:
        state = make_state(0)
        assert mgr.restore(state).step == 2
        mgr.save(make_state(3), step=3)
        report = mgr.audit()
        assert report is not None
    assert observe(str(root))["digest"] == expected(3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "attack", [header_100gb_tensor, header_huge_dims, tensor_is_fifo, claim_100gb], ids=lambda f: f.__name__
)
def test_load_of_a_named_damaged_step_is_refused_fast(root, attack):
    attack(root)
    started = time.monotonic()
    with pytest.raises((CorruptCheckpointError, ConfigError, Exception)) as info:
        CheckpointManager(str(root), read_only=True).load(step=2)
    assert type(info.value).__module__.startswith("ckptsdk"), repr(info.value)
    assert time.monotonic() - started < 10


LEASES = {
    "empty": b"",
    "garbage": b"\x00\xff not json",
    "nested": b"[" * 100_000 + b"]" * 100_000,
    "padded": None,  # a real record after 2 MiB of whitespace: valid JSON, not a lease's size
    "huge ttl": None,  # filled from a real record below
    "infinite ttl": None,
    "folder": "folder",
    "fifo": "fifo",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(LEASES))
def test_junk_lease_is_refused_fast_and_breakable(root, kind):
    lease = root / "LEASE.json"
    original = lease.read_bytes()
    record = json.loads(original)
    lease.unlink()
    if kind == "folder":
        lease.mkdir()
    elif kind == "fifo":
        os.mkfifo(lease)
    elif kind in ("huge ttl", "infinite ttl"):
        record.update(released=False, ttl=1e12 if kind == "huge ttl" else float("inf"))
        lease.write_text(json.dumps(record))  # json writes Infinity; its reader accepts it
    elif kind == "padded":
        lease.write_bytes(b" " * (2 << 20) + original)
    else:
        lease.write_bytes(LEASES[kind])
    started = time.monotonic()
    with pytest.raises(LeaseError):
        CheckpointManager(str(root), _simulation=Simulation(heartbeat=False), lease_options=LeaseOptions(wait=30))
    assert time.monotonic() - started < 10
    if kind in ("folder", "fifo"):
        return  # the message says: remove it by hand (ckptsdk never deletes a folder it did not make)
    out = subprocess.run(
        [sys.executable, "-m", "ckptsdk", "lease", str(root), "--break", "--yes-i-am-sure"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    with CheckpointManager(str(root), _simulation=Simulation(heartbeat=False)) as mgr:
        assert mgr.restore(make_state(0)).step == 2


@pytest.mark.timeout(30)
def test_absurd_ttl_is_a_config_error(root):
    for ttl in (float("inf"), float("nan"), 1e9, 0.0, -1.0):
        with pytest.raises(ConfigError):
            CheckpointManager(str(root), _simulation=Simulation(heartbeat=False), lease_options=LeaseOptions(ttl=ttl))


@pytest.mark.timeout(120)
def test_cli_never_hangs_on_a_fifo(root):
    tensor_is_fifo(root)
    for command in (["show", str(root), "--step", "2"], ["verify", str(root)], ["ls", str(root)]):
        out = subprocess.run(
            [sys.executable, "-m", "ckptsdk", *command], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert "Traceback" not in out.stderr, out.stderr
        assert out.returncode == (1 if command[0] == "verify" else 0), (command, out.returncode, out.stderr)


# ---------------------------------------------------------------------------- the data path


def _batch_pickle(rows_global: bytes) -> bytes:
    return b"\x80\x02}(C\x04data" + rows_global + b"C\x06labels]u."


PICKLES = {
    # ndarray((300000, 3072), uint8) called directly: 921 MB from a 42-byte file
    "ndarray of 300000 rows": _batch_pickle(b"cnumpy\nndarray\nJ\xe0\x93\x04\x00M\x00\x0c\x86C\x02u1\x86R"),
    # _reconstruct(ndarray, (1,), dtype(('u1', (300000, 3072)))): one element of a 921 MB dtype
    "subarray dtype": _batch_pickle(
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x01\x85"
        b"cnumpy\ndtype\nX\x02\x00\x00\x00u1J\xe0\x93\x04\x00M\x00\x0c\x86\x86\x85R\x87R"
    ),
    # a memo index of 2**32 - 16: the C unpickler sizes a table from it (tens of GB)
    "memo index 2**32": b"\x80\x02N" + b"r" + struct.pack("<I", 0xFFFFFFF0) + b".",
    "os.system": pickle.dumps({b"data": 1})[:2] + b"cos\nsystem\nX\x04\x00\x00\x00trueh\x85R.",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(PICKLES))
def test_cifar_batch_pickles_cannot_allocate_or_run_anything(name):
    from adapters.cifar10.sources import _parse_batch

    with pytest.raises(DataError):
        _parse_batch(PICKLES[name], where=name)


# ------------------------------------------------ sizes checked before anything is allocated

_HUGE = 3 << 29  # 1.5 GiB: above the child's address-space headroom (512 MiB), far below the disk
_HEADROOM = 1 << 29


def _append_sparse_tensor(folder: Path, *, fresh_digest: bool) -> None:
    """Add a 1.5 GiB tensor to step 2's file as a hole (a sparse file: the bytes are not there),
    re-sealed so header, manifest size and checksum all agree; the digest is the old one (a
    torn copy) or recomputed over the zeros (a genuine, verified checkpoint)."""
    path = folder / TENSORS
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    data = raw[8 + hlen :]
    header["pad"] = {"dtype": "U8", "shape": [_HUGE], "data_offsets": [len(data), len(data) + _HUGE]}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + data)
        f.truncate(8 + len(head) + len(data) + _HUGE)
    doc = _doc(folder)
    size = path.stat().st_size
    if fresh_digest:
        hasher = xxhash.xxh3_128()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                hasher.update(chunk)
        doc["files"] = [{**doc["files"][0], "size": size, "digest": hasher.hexdigest()}]
    else:
        doc["files"] = [{**doc["files"][0], "size": size}]
    _write_doc(folder, doc, reseal=True)


def _restore_in_child(root: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support._alloc_child", str(root), str(_HEADROOM)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_a_torn_sparse_tensor_too_big_to_allocate_falls_back_before_allocating(root):
    # The issue: header and manifest agree on a huge tensor, the digest is stale. Before: torch's
    # "DefaultCPUAllocator: can't allocate memory", a raw RuntimeError, no fallback.
    _append_sparse_tensor(_folder(root, 2), fresh_digest=False)
    got = _restore_in_child(root)
    assert got == {"step": 1, "digest": expected(1)}, got
    assert (_folder(root, 2) / TENSORS).stat().st_size > _HUGE  # nothing was deleted or repaired


@pytest.mark.timeout(300)
def test_a_verified_tensor_too_big_for_this_process_is_a_clear_error_not_a_fallback(root):
    _append_sparse_tensor(_folder(root, 2), fresh_digest=True)
    got = _restore_in_child(root)
    assert got["error"] == "CheckpointTooLargeError", got
    assert got["needed"] > _HUGE and 0 < got["available"] <= _HEADROOM, got
    assert f"{got['needed']} bytes" in got["message"] and f"{got['available']} bytes" in got["message"], got
    # It is a good checkpoint (streamed, nothing allocated): falling back would have been wrong.
    assert CheckpointManager(str(root), read_only=True).verify(step=2).step == 2
