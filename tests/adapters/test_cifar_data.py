"""CIFAR-10 sources: same tensors from every layout, verified cache, hostile inputs refused."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from adapters.cifar10 import sources as src
from adapters.cifar10.data import CANONICAL_NAME, load_cifar10, tensor_hash
from adapters.cifar10.synthetic import synthetic_cifar10, write_both
from ckptsdk.data.archive import safe_extract
from ckptsdk.errors import AllSourcesFailedError, DatasetMismatchError, UnsafeArchiveError
from tests.support.cifar_fixtures import serve_cifar

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _arrays_equal(a: src.Arrays, b: src.Arrays) -> bool:
    return all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True))


def _canonical(data) -> src.Arrays:
    return (data.train_images.numpy(), data.train_labels.numpy(), data.test_images.numpy(), data.test_labels.numpy())


def _hash(arrays: src.Arrays) -> str:
    t = [torch.from_numpy(a) for a in arrays]
    return tensor_hash([t[0], t[2]], [t[1], t[3]])


def test_both_layouts_decode_to_identical_tensors_and_hash(cifar_files, tmp_path):
    hf = src.read_hf_parquet(str(cifar_files.hf_train), str(cifar_files.hf_test))
    safe_extract(str(cifar_files.tarball), str(tmp_path))
    tv = src.read_torchvision_dir(str(tmp_path / src.TV_DIRNAME))
    assert _arrays_equal(hf, tv)
    assert _arrays_equal(tv, _canonical(cifar_files.data))
    assert _hash(hf) == _hash(tv) == cifar_files.data.tensor_hash


def test_skipping_the_row_order_fix_changes_the_hash(cifar_files):
    fixed = src.read_hf_parquet(str(cifar_files.hf_train), str(cifar_files.hf_test))
    unfixed = src.read_hf_parquet(str(cifar_files.hf_train), str(cifar_files.hf_test), batch_order=(1, 2, 3, 4, 5))
    assert _hash(fixed) == cifar_files.data.tensor_hash
    assert _hash(unfixed) != cifar_files.data.tensor_hash
    # Same images, other order: a job switching source would train on other batches at each step.
    assert sorted(map(bytes, unfixed[0].reshape(len(unfixed[0]), -1))) == sorted(
        map(bytes, fixed[0].reshape(len(fixed[0]), -1))
    )


def test_load_without_the_fix_is_refused_naming_both_hashes(cifar_server, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    first = cifar_server.load(tmp_path / "rt1", cache=cache, hf_base=cifar_server.server.url("/nohf/"))
    assert first.source == "torchvision"
    read = src.read_hf_parquet
    monkeypatch.setattr(src, "read_hf_parquet", lambda a, b: read(a, b, batch_order=(1, 2, 3, 4, 5)))
    _drop_cached_canonical(cache)  # keep the record, so the HF source is the one that answers
    with pytest.raises(DatasetMismatchError) as info:
        cifar_server.load(tmp_path / "rt2", cache=cache)
    err = info.value
    assert err.expected == first.tensor_hash and err.actual != first.tensor_hash
    assert err.source == cifar_server.hf_base
    assert first.tensor_hash in str(err) and err.actual in str(err) and cifar_server.hf_base in str(err)


def _drop_cached_canonical(cache: str) -> None:
    from ckptsdk import open_backend

    b = open_backend(cache)
    for obj in b.list("datacache/"):
        if "/records/" not in obj.key:
            b.delete(obj.key)


def test_fresh_runtime_gets_the_data_from_the_cache_with_zero_downloads(cifar_server, tmp_path):
    cache = "memory://" + tmp_path.name
    first = cifar_server.load(tmp_path / "rt1", cache=cache)
    assert first.source == "huggingface" and first.tensor_hash == cifar_server.files.data.tensor_hash
    downloads = cifar_server.downloads()
    assert downloads == 2  # the two parquet files
    again = cifar_server.load(tmp_path / "rt1", cache=cache)
    assert again.source == "local"
    fresh = cifar_server.load(tmp_path / "rt2", cache=cache)
    assert fresh.source == "cache" and fresh.tensor_hash == first.tensor_hash
    assert cifar_server.downloads() == downloads  # zero downloads on the fresh runtime
    for a, b in zip(_canonical(fresh), _canonical(first), strict=True):
        assert np.array_equal(a, b)
    assert fresh.train_images.dtype == torch.uint8 and fresh.train_images.shape == (500, 32, 32, 3)
    assert fresh.train_labels.dtype == torch.int64


def test_corrupt_canonical_in_the_cache_is_refetched_and_repaired(cifar_server, tmp_path):
    from ckptsdk import open_backend

    cache = str(tmp_path / "cache")
    cifar_server.load(tmp_path / "rt1", cache=cache)
    b = open_backend(cache)
    key = f"datacache/blobs/{CANONICAL_NAME}"
    good = b.read(key)
    b.write(key, good[:-10] + b"0123456789")
    got = cifar_server.load(tmp_path / "rt2", cache=cache)
    assert got.source == "huggingface" and got.tensor_hash == cifar_server.files.data.tensor_hash
    assert b.read(key) == good  # repaired: the canonical file is deterministic
    assert cifar_server.load(tmp_path / "rt3", cache=cache).source == "cache"


def test_a_source_with_other_data_is_refused(cifar_server, http_server, tmp_path):
    cache = str(tmp_path / "cache")
    cifar_server.load(tmp_path / "rt1", cache=cache)
    other = synthetic_cifar10(n_train=500, n_test=100, seed=99)
    paths = write_both(other, str(tmp_path / "other"))
    with open(paths["tarball"], "rb") as f:
        http_server.add("/other/cifar-10-python.tar.gz", f.read())
    _drop_cached_canonical(cache)  # force the sources
    with pytest.raises(DatasetMismatchError) as info:
        cifar_server.load(
            tmp_path / "rt2",
            cache=cache,
            hf_base=http_server.url("/nohf/"),
            tv_url=http_server.url("/other/cifar-10-python.tar.gz"),
        )
    assert info.value.actual == other.tensor_hash
    assert info.value.expected == cifar_server.files.data.tensor_hash


def test_all_sources_failing_reports_each(http_server, tmp_path):
    with pytest.raises(AllSourcesFailedError) as info:
        load_cifar10(
            cache=None,
            local=str(tmp_path),
            hf_base=http_server.url("/nohf/"),
            tv_url=http_server.url("/none.tar.gz"),
            progress=False,
        )
    assert set(info.value.failures) >= {http_server.url("/nohf/"), http_server.url("/none.tar.gz")}
    assert "404" in str(info.value)


# ------------------------------------------------------------------------------ hostile inputs
class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _malicious_batch(marker: str) -> bytes:
    return pickle.dumps({b"data": _Payload(marker), b"labels": [0]}, protocol=3)


def test_malicious_pickle_is_refused_without_executing(tmp_path):
    live = tmp_path / "live-marker"
    pickle.loads(_malicious_batch(str(live)))  # the payload is real: plain pickle runs it
    assert live.exists()

    marker = tmp_path / "marker"
    with pytest.raises(src.UnsafePickleError) as info:
        src.restricted_loads(_malicious_batch(str(marker)), where="data_batch_1")
    assert info.value.global_name in ("posix.system", "nt.system")
    assert not marker.exists()


def test_malicious_batch_in_a_tarball_is_refused_by_the_loader(cifar_files, http_server, tmp_path):
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    with tarfile.open(str(cifar_files.tarball)) as good, tarfile.open(fileobj=buf, mode="w:gz") as evil:
        for m in good.getmembers():
            if m.name.endswith("data_batch_3"):
                blob = _malicious_batch(str(marker))
                m.size = len(blob)
                evil.addfile(m, io.BytesIO(blob))
            else:
                evil.addfile(m, good.extractfile(m) if m.isfile() else None)
    served = serve_cifar(http_server, cifar_files, tarball=buf.getvalue())
    with pytest.raises(AllSourcesFailedError) as info:
        served.load(tmp_path / "l", cache=None, hf_base=http_server.url("/nohf/"))
    assert "posix.system" in info.value.failures[served.tv_url]
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["traversal", "symlink"])
def test_hostile_tarball_from_a_source_is_refused(kind, cifar_files, http_server, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        if kind == "traversal":
            info = tarfile.TarInfo("cifar-10-batches-py/../../escaped.txt")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"pwned"))
        else:
            info = tarfile.TarInfo("cifar-10-batches-py")
            info.type, info.linkname = tarfile.SYMTYPE, str(tmp_path / "outside")
            tar.addfile(info)
    served = serve_cifar(http_server, cifar_files, tarball=buf.getvalue())
    (tmp_path / "outside").mkdir()
    local = tmp_path / "box" / "l"
    with pytest.raises(AllSourcesFailedError) as info:
        served.load(local, cache=None, hf_base=http_server.url("/nohf/"))
    assert "refusing to extract" in info.value.failures[served.tv_url]
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "box" / "escaped.txt").exists()
    assert list((tmp_path / "outside").iterdir()) == []
    assert not (local / src.TV_DIRNAME).exists()


def test_unsafe_archive_error_type(tmp_path):
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("../x")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(UnsafeArchiveError):
        safe_extract(str(path), str(tmp_path / "t"))


# ----------------------------------------------------------------------------- file formats
def test_synthetic_files_have_the_real_layouts(cifar_files, tmp_path):
    with tarfile.open(str(cifar_files.tarball)) as tar:
        names = sorted(tar.getnames())
        batch = tar.extractfile("cifar-10-batches-py/data_batch_1").read()
        meta = tar.extractfile("cifar-10-batches-py/batches.meta").read()
    assert names == sorted(
        ["cifar-10-batches-py"]
        + [
            f"cifar-10-batches-py/{n}"
            for n in [
                "data_batch_1",
                "data_batch_2",
                "data_batch_3",
                "data_batch_4",
                "data_batch_5",
                "test_batch",
                "batches.meta",
                "readme.html",
            ]
        ]
    )
    assert batch[:2] == b"\x80\x02"  # protocol 2, like the Python 2 originals
    d = src.restricted_loads(batch)
    assert set(d) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert d[b"data"].dtype == np.uint8 and d[b"data"].shape == (100, 3072)
    assert d[b"batch_label"] == b"training batch 1 of 5" and isinstance(d[b"labels"], list)
    # R plane first: row 0's first 1024 bytes are image 0's red channel, row-major.
    assert np.array_equal(d[b"data"][0, :1024], cifar_files.data.train_images[0, :, :, 0].numpy().ravel())
    m = src.restricted_loads(meta)
    assert m[b"label_names"][0] == b"airplane" and m[b"num_vis"] == 3072
    schema = pq.read_schema(str(cifar_files.hf_train))
    assert schema.field("img").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert schema.field("label").type == pa.int64()
    assert pq.read_metadata(str(cifar_files.hf_train)).num_rows == 500


def test_tensor_hash_covers_order_and_split(small_cifar):
    d = small_cifar
    assert tensor_hash([d.train_images, d.test_images], [d.train_labels, d.test_labels]) == d.tensor_hash
    moved = tensor_hash(
        [d.train_images[:-1], torch.cat([d.train_images[-1:], d.test_images])],
        [d.train_labels[:-1], torch.cat([d.train_labels[-1:], d.test_labels])],
    )
    assert moved != d.tensor_hash
    swapped = tensor_hash([d.train_images.flip(0), d.test_images], [d.train_labels.flip(0), d.test_labels])
    assert swapped != d.tensor_hash


# ------------------------------------------------------------------------------------ command
def _run_cli(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "adapters.cifar10.data", *args, "--json", "--no-progress"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow  # a fresh interpreter importing torch: ~5 s on a shared 2-core box
def test_command_prepares_the_data_and_reports_as_json(cifar_server, tmp_path, capsys):
    """The first run in process; the second, `python -m adapters.cifar10.data` in a fresh
    interpreter, proves the entry point and that the cache serves another process."""
    from adapters.cifar10.data import main

    cache = str(tmp_path / "cache")
    args = ("--cache", cache, "--hf-base", cifar_server.hf_base, "--tv-url", cifar_server.tv_url)
    assert main([*args, "--local", str(tmp_path / "rt1"), "--json", "--no-progress"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["ok"] and first["source"] == "huggingface"
    assert first["tensor_hash"] == cifar_server.files.data.tensor_hash
    assert (first["n_train"], first["n_test"]) == (500, 100) and first["seconds"] > 0
    before = cifar_server.downloads()
    second = _run_cli(*args, "--local", str(tmp_path / "rt2"))
    assert second["source"] == "cache" and second["tensor_hash"] == first["tensor_hash"]
    assert cifar_server.downloads() == before


def test_command_in_process_reports_success_and_failure(cifar_server, tmp_path, capsys):
    from adapters.cifar10.data import main

    rc = main(
        [
            "--cache",
            str(tmp_path / "cache"),
            "--local",
            str(tmp_path / "l"),
            "--hf-base",
            cifar_server.hf_base,
            "--tv-url",
            cifar_server.tv_url,
            "--json",
            "--no-progress",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["source"] == "huggingface"
    assert report["record"]["tensor_hash"] == report["tensor_hash"] == cifar_server.files.data.tensor_hash

    rc = main(
        [
            "--local",
            str(tmp_path / "l2"),
            "--hf-base",
            cifar_server.server.url("/nohf/"),
            "--tv-url",
            cifar_server.server.url("/none.tar.gz"),
            "--json",
            "--no-progress",
        ]
    )
    failed = json.loads(capsys.readouterr().out)
    assert rc == 1 and failed == {"ok": False, "error": "AllSourcesFailedError", "message": failed["message"]}
    assert "/nohf/" in failed["message"] and "/none.tar.gz" in failed["message"]
