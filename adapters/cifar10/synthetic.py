"""Synthetic CIFAR-10: learnable random tensors, and files in both published layouts.

Used by tests (small sets served from a loopback HTTP server) and by the demo (``--data
synthetic``). Writes the torchvision tarball (Python-2-style pickled batch dicts, exactly the keys
and types of the real files) and the Hugging Face parquet pair (PNG images, train rows in data_batch
order 4,3,2,5,1). Reading these files back belongs to ``sources.py``.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import tarfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptsdk.errors import ConfigError

from .data import CifarData, tensor_hash
from .sources import HF_TEST_FILE, HF_TRAIN_BATCH_ORDER, HF_TRAIN_FILE, LABEL_NAMES, TV_DIRNAME, numpy_reconstruct

__all__ = ["synthetic_cifar10", "write_hf_parquet", "write_torchvision_tarball", "write_both"]

# One base colour per class, so a small model can learn the synthetic labels (demo runs).
_CLASS_RGB = np.array(
    [
        [200, 40, 40],
        [40, 200, 40],
        [40, 40, 200],
        [200, 200, 40],
        [200, 40, 200],
        [40, 200, 200],
        [120, 120, 120],
        [230, 150, 60],
        [60, 150, 230],
        [150, 60, 110],
    ],
    dtype=np.int16,
)


def _images(rng: np.random.Generator, labels: np.ndarray, chunk: int = 5000) -> np.ndarray:
    n = len(labels)
    out = np.empty((n, 32, 32, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:32, 0:32]
    ramp = ((xx + yy) // 2).astype(np.int16)[None, :, :, None]  # smooth part: PNG/gzip compress like photos
    for i in range(0, n, chunk):
        lab = labels[i : i + chunk]
        noise = rng.integers(-24, 25, size=(len(lab), 32, 32, 3), dtype=np.int16)
        img = _CLASS_RGB[lab][:, None, None, :] - 16 + ramp + noise
        out[i : i + chunk] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def synthetic_cifar10(*, n_train: int = 50_000, n_test: int = 10_000, seed: int = 0) -> CifarData:
    """Deterministic synthetic CIFAR-10-shaped data in canonical form.

    Args:
        n_train: training images (a multiple of 5 if the set is to be written as files: five data_batch parts).
        n_test: test images.
        seed: everything is drawn from ``numpy.random.default_rng(seed)``.

    Returns:
        A :class:`~adapters.cifar10.data.CifarData` with ``source="synthetic"``.

    Example:
        >>> d = synthetic_cifar10(n_train=500, n_test=100)
        >>> tuple(d.train_images.shape), d.train_labels.dtype
        ((500, 32, 32, 3), torch.int64)
    """
    if n_train <= 0 or n_test <= 0:
        raise ConfigError(f"n_train and n_test must be positive; got {n_train}, {n_test}")
    start = time.monotonic()
    rng = np.random.default_rng(seed)
    train_labels = rng.integers(0, 10, size=n_train).astype(np.int64)
    test_labels = rng.integers(0, 10, size=n_test).astype(np.int64)
    train = torch.from_numpy(_images(rng, train_labels))
    test = torch.from_numpy(_images(rng, test_labels))
    tl, sl = torch.from_numpy(train_labels), torch.from_numpy(test_labels)
    return CifarData(train, tl, test, sl, "synthetic", time.monotonic() - start, tensor_hash([train, test], [tl, sl]))


# ------------------------------------------------------------------------ torchvision layout
class _Py2Pickler(pickle._Pickler):  # the pure-Python pickler is overridable
    """Writes pickles the way Python 2 + numpy 1.x wrote the real batch files.

    Bytes become ``BINSTRING`` (what a py2 ``str`` was; read back with ``encoding="bytes"``) instead of
    py3's ``_codecs.encode`` detour, and arrays name ``numpy.core.multiarray._reconstruct``.
    """

    dispatch = pickle._Pickler.dispatch.copy()

    if TYPE_CHECKING:  # the pure-Python pickler's own methods, which typeshed leaves out

        def write(self, data: bytes) -> None: ...
        def memoize(self, obj: object) -> None: ...
        def _base_save_global(self, obj: object, name: str | None = None) -> None: ...
    else:
        _base_save_global = pickle._Pickler.save_global

    def _save_py2_str(self, obj: bytes) -> None:
        n = len(obj)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    # typeshed types dispatch entries as taking an Unpickler; pickle.py calls them with the pickler.
    dispatch[bytes] = _save_py2_str  # type: ignore[assignment]

    def save_global(self, obj: object, name: str | None = None) -> None:
        if obj is numpy_reconstruct():
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
            return
        self._base_save_global(obj, name)


def _py2_pickle(obj: object) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _per_batch(data: CifarData) -> int:
    n = len(data.train_labels)
    if n % 5:
        raise ConfigError(
            f"the published layouts split the train set into 5 equal data_batch parts; {n} is not a multiple of 5"
        )
    return n // 5


def _batch_dict(images: np.ndarray, labels: np.ndarray, label: bytes, first: int) -> dict[bytes, Any]:
    # Rows are 3072 bytes: the 1024 red values, then green, then blue, each row-major.
    rows = np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), 3072))
    return {
        b"batch_label": label,
        b"labels": [int(x) for x in labels],
        b"data": rows,
        b"filenames": [f"synthetic_{first + i:06d}.png".encode() for i in range(len(images))],
    }


def write_torchvision_tarball(data: CifarData, path: str, *, compresslevel: int = 6) -> str:
    """Write ``data`` as ``cifar-10-python.tar.gz`` (folder ``cifar-10-batches-py/``).

    Members: ``data_batch_1..5`` (train split in canonical order, five equal parts), ``test_batch``,
    ``batches.meta`` and ``readme.html``; each batch a pickled dict with keys ``b'batch_label'``,
    ``b'labels'``, ``b'data'`` (uint8 N x 3072: R, G, B planes) and ``b'filenames'``.

    Returns:
        ``path``.
    """
    imgs, labels = data.train_images.numpy(), data.train_labels.numpy()
    per = _per_batch(data)
    members: list[tuple[str, bytes]] = []
    for b in range(5):
        sl = slice(b * per, (b + 1) * per)
        members.append(
            (
                f"data_batch_{b + 1}",
                _py2_pickle(_batch_dict(imgs[sl], labels[sl], f"training batch {b + 1} of 5".encode(), b * per)),
            )
        )
    members.append(
        (
            "test_batch",
            _py2_pickle(_batch_dict(data.test_images.numpy(), data.test_labels.numpy(), b"testing batch 1 of 1", 0)),
        )
    )
    members.append(
        (
            "batches.meta",
            _py2_pickle(
                {b"num_cases_per_batch": per, b"label_names": [n.encode() for n in LABEL_NAMES], b"num_vis": 3072}
            ),
        )
    )
    members.append(("readme.html", b'<meta HTTP-EQUIV="REFRESH" content="0; url=synthetic">\n'))
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w:gz", compresslevel=compresslevel) as tar:
        d = tarfile.TarInfo(TV_DIRNAME)
        d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 1244000000
        tar.addfile(d)
        for name, blob in members:
            info = tarfile.TarInfo(f"{TV_DIRNAME}/{name}")
            info.size, info.mode, info.mtime = len(blob), 0o644, 1244000000
            tar.addfile(info, io.BytesIO(blob))
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------- Hugging Face layout
def _png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def _parquet(images: np.ndarray, labels: np.ndarray, path: str) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    # The datasets library's Image feature is struct<bytes: binary, path: string>; ClassLabel is int64.
    img = pa.array(
        [{"bytes": _png(x), "path": None} for x in images],
        type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    features = {"img": {"_type": "Image"}, "label": {"names": list(LABEL_NAMES), "_type": "ClassLabel"}}
    schema = pa.schema(
        [("img", img.type), ("label", pa.int64())],
        metadata={b"huggingface": json.dumps({"info": {"features": features}}).encode()},
    )
    table = pa.Table.from_arrays([img, pa.array(labels, type=pa.int64())], schema=schema)
    tmp = path + ".tmp"
    pq.write_table(table, tmp, row_group_size=1000)
    os.replace(tmp, path)


def write_hf_parquet(data: CifarData, root: str) -> tuple[str, str]:
    """Write ``root/plain_text/{train,test}-00000-of-00001.parquet`` like ``uoft-cs/cifar10``.

    Train rows are the canonical data_batch parts in order 4,3,2,5,1 (as on the Hub); test rows
    keep ``test_batch`` order. Columns: ``img`` (struct of PNG ``bytes`` and ``path``) and ``label``.

    Returns:
        The train and test file paths.
    """
    imgs, labels = data.train_images.numpy(), data.train_labels.numpy()
    per = _per_batch(data)
    order = np.concatenate([np.arange((b - 1) * per, b * per) for b in HF_TRAIN_BATCH_ORDER])
    os.makedirs(os.path.join(root, "plain_text"), exist_ok=True)
    train_path = os.path.join(root, HF_TRAIN_FILE)
    test_path = os.path.join(root, HF_TEST_FILE)
    _parquet(imgs[order], labels[order], train_path)
    _parquet(data.test_images.numpy(), data.test_labels.numpy(), test_path)
    return train_path, test_path


def write_both(data: CifarData, root: str) -> dict[str, str]:
    """Write both layouts under ``root``: ``hf/plain_text/...`` and ``cifar-10-python.tar.gz``.

    Returns:
        Paths keyed ``hf_train``, ``hf_test``, ``tarball``, and ``hf_root`` (the folder holding ``plain_text/``).
    """
    hf_root = os.path.join(root, "hf")
    train, test = write_hf_parquet(data, hf_root)
    tar = write_torchvision_tarball(data, os.path.join(root, "cifar-10-python.tar.gz"))
    return {"hf_root": hf_root, "hf_train": train, "hf_test": test, "tarball": tar}
