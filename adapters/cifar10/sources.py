"""Where CIFAR-10 comes from and how each published layout is parsed into canonical arrays.

Source URLs and pins, the torchvision batch files (read with a restricted unpickler that can
build nothing but numpy arrays), and the Hugging Face parquet files (PNG-decoded, train rows put
back into torchvision order). Fetching, caching and hashing belong to ``data.py`` and ``ckptsdk``.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptsdk.errors import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "HF_BASE_DEFAULT",
    "HF_COMMIT",
    "HF_TEST_FILE",
    "HF_TRAIN_BATCH_ORDER",
    "HF_TRAIN_FILE",
    "LABEL_NAMES",
    "TV_DIRNAME",
    "TV_MD5",
    "TV_URL_DEFAULT",
    "Arrays",
    "UnsafePickleError",
    "hf_to_torchvision_order",
    "read_hf_parquet",
    "read_torchvision_dir",
    "restricted_loads",
]

HF_COMMIT = "0b2714987fa478483af9968de7c934580d0bb9a2"
HF_BASE_DEFAULT = f"https://huggingface.co/datasets/uoft-cs/cifar10/resolve/{HF_COMMIT}/"
HF_TRAIN_FILE = "plain_text/train-00000-of-00001.parquet"
HF_TEST_FILE = "plain_text/test-00000-of-00001.parquet"
# The Hub's train split holds torchvision's data_batch files in this order (10,000 rows each).
HF_TRAIN_BATCH_ORDER: tuple[int, ...] = (4, 3, 2, 5, 1)

TV_URL_DEFAULT = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
TV_MD5 = "c58f30108f718f92721af3b95e74349a"  # published by torchvision for that URL
TV_DIRNAME = "cifar-10-batches-py"

LABEL_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

# (train_images N x 32 x 32 x 3 uint8, train_labels int64, test_images, test_labels), canonical order.
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class UnsafePickleError(DataError, pickle.UnpicklingError):
    """A batch file asked the unpickler for something other than a numpy array; nothing was run.

    ``where`` names the file, ``global_name`` the ``module.name`` it asked for.
    """

    def __init__(self, message: str, *, where: str = "", global_name: str = "") -> None:
        super().__init__(message)
        self.where = where
        self.global_name = global_name


def numpy_reconstruct() -> Any:
    """numpy's array unpickling function, the one global a CIFAR pickle may name (reader and writer)."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed it; ``numpy.core`` warns there
    return core.multiarray._reconstruct


# Exactly what a pickled ndarray needs, whichever numpy wrote it. Nothing else can be built.
_ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy.core.multiarray", "_reconstruct"): numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): numpy_reconstruct,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
}


def _bounded_nbytes(shape: Any, dtype: Any, limit: int, where: str) -> None:
    """Refuse an array whose memory exceeds ``limit`` (the pickle's own size) before it exists."""
    try:
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = np.dtype(dtype).itemsize if not isinstance(dtype, bytes) else 1
        nbytes = math.prod(int(d) for d in dims) * max(itemsize, 1)
    except (TypeError, ValueError) as exc:
        raise DataError(
            f"{where}: an array with shape {str(shape)[:60]} and dtype {str(dtype)[:60]} "
            f"is not something a batch file holds ({exc})"
        ) from exc
    if any(int(d) < 0 for d in dims) or nbytes > limit:
        raise DataError(
            f"{where}: the pickle declares an array of {nbytes} bytes in a file of "
            f"{limit}; a batch file holds its data, so it is corrupt or malicious "
            "(nothing was allocated)"
        )


class _RestrictedUnpickler(pickle._Unpickler):
    # The pure-Python unpickler: the C one sizes its memo table from a pickle's index (a
    # LONG_BINPUT of 2**32 - 1 makes it allocate tens of GB); this one keeps a dict. Every other
    # structure a pickle can build costs bytes of the file, except the arrays, bounded below.
    def __init__(self, file: io.BytesIO, *, where: str, limit: int) -> None:
        super().__init__(file, encoding="bytes")  # the real files are Python 2 pickles
        self.where = where
        self.limit = limit

    def find_class(self, module: str, name: str) -> object:
        # Every callable a pickle can invoke (REDUCE, BUILD on a class, INST/OBJ) comes through here.
        if (module, name) == ("numpy", "ndarray"):
            return _ndarray_guard(self.limit, self.where)
        if name == "_reconstruct" and (module, name) in _ALLOWED:
            return _reconstruct_guard(self.limit, self.where)
        factory = _ALLOWED.get((module, name))
        if factory is None:
            raise UnsafePickleError(
                f"{self.where}: the pickle asks for {module}.{name}, which a CIFAR batch file never needs; "
                "refusing to load it (nothing was executed). The file is corrupt or malicious: "
                "delete it and fetch the data again",
                where=self.where,
                global_name=f"{module}.{name}",
            )
        return factory()

    def persistent_load(self, pid: object) -> object:
        raise UnsafePickleError(f"{self.where}: persistent ids are not allowed in a batch file", where=self.where)


class _NdarrayClass:
    """Stands for ``numpy.ndarray`` in a pickle: as ``_reconstruct``'s argument, or called."""

    def __init__(self, limit: int, where: str) -> None:
        self.limit, self.where = limit, where

    def __call__(self, shape: Any, dtype: Any = float, *args: Any, **kwargs: Any) -> np.ndarray:
        _bounded_nbytes(shape, dtype, self.limit, self.where)
        return np.ndarray(shape, dtype, *args, **kwargs)


def _ndarray_guard(limit: int, where: str) -> _NdarrayClass:
    return _NdarrayClass(limit, where)


def _reconstruct_guard(limit: int, where: str) -> Any:
    real = numpy_reconstruct()

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
        if not isinstance(subtype, _NdarrayClass):
            raise UnsafePickleError(
                f"{where}: _reconstruct of {str(subtype)[:60]}, not numpy.ndarray",
                where=where,
                global_name="numpy.core.multiarray._reconstruct",
            )
        _bounded_nbytes(shape, dtype, limit, where)
        array: np.ndarray = real(np.ndarray, shape, dtype)
        return array

    return reconstruct


def restricted_loads(data: bytes, *, where: str = "<bytes>") -> object:
    """Unpickle ``data`` admitting only numpy array reconstruction (ndarray, dtype, _reconstruct).

    No array may need more memory than ``len(data)``: a batch file carries its rows.

    Raises:
        UnsafePickleError: the pickle references any other global; nothing is executed.
        DataError: the bytes are not a valid pickle, or declare an array larger than the file.
    """
    try:
        return _RestrictedUnpickler(io.BytesIO(data), where=where, limit=len(data)).load()
    except (UnsafePickleError, DataError):
        raise
    except Exception as exc:  # a malformed pickle can raise almost anything; none of it is our fault
        raise DataError(f"{where}: not a readable CIFAR batch pickle ({type(exc).__name__}: {exc})") from exc


def _parse_batch(data: bytes, *, where: str) -> tuple[np.ndarray, np.ndarray]:
    d = restricted_loads(data, where=where)
    if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
        raise DataError(f"{where}: expected a dict with b'data' and b'labels', got {type(d).__name__}")
    rows, labels = d[b"data"], d[b"labels"]
    if not (isinstance(rows, np.ndarray) and rows.dtype == np.uint8 and rows.ndim == 2 and rows.shape[1] == 3072):
        raise DataError(
            f"{where}: b'data' must be a uint8 array of N x 3072, got "
            f"{type(rows).__name__} {getattr(rows, 'dtype', '')} {getattr(rows, 'shape', '')}"
        )
    lab = np.asarray(labels, dtype=np.int64)
    if lab.shape != (rows.shape[0],) or (lab.size and (lab.min() < 0 or lab.max() > 9)):
        raise DataError(f"{where}: b'labels' must be {rows.shape[0]} integers in 0..9")
    # R, G, B planes of 32 x 32 -> N x 32 x 32 x 3 (what torchvision's CIFAR10 does).
    images = np.ascontiguousarray(rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, lab


def read_torchvision_dir(folder: str) -> Arrays:
    """Parse an extracted ``cifar-10-batches-py`` folder into canonical arrays.

    Args:
        folder: the folder holding ``data_batch_1..5`` and ``test_batch``.

    Raises:
        UnsafePickleError: a batch file references anything but numpy arrays.
        DataError: a file is missing or malformed.
    """
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError as exc:
            raise DataError(f"{path} is missing; the torchvision CIFAR-10 folder is incomplete") from exc
        parts.append(_parse_batch(blob, where=path))
    train_images = np.concatenate([p[0] for p in parts[:5]])
    train_labels = np.concatenate([p[1] for p in parts[:5]])
    return train_images, train_labels, parts[5][0], parts[5][1]


def hf_to_torchvision_order(n: int, batch_order: Sequence[int] = HF_TRAIN_BATCH_ORDER) -> np.ndarray:
    """Index array ``idx`` such that ``hf_rows[idx]`` is in torchvision (data_batch 1..5) order.

    The Hub's train split is the five data_batch parts in ``batch_order``; each part keeps its
    own row order. Passing ``(1, 2, 3, 4, 5)`` gives the identity (no fix).
    """
    k = len(batch_order)
    if n % k or sorted(batch_order) != list(range(1, k + 1)):
        raise DataError(f"cannot reorder {n} rows by batch order {tuple(batch_order)}")
    per = n // k
    position = {b: i for i, b in enumerate(batch_order)}  # data_batch b sits at part position[b]
    return np.concatenate([np.arange(position[b] * per, (position[b] + 1) * per) for b in range(1, k + 1)])


def _decode_parquet(path: str) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow.parquet as pq
    from PIL import Image

    try:
        table = pq.read_table(path, columns=["img", "label"])
    except Exception as exc:  # pyarrow raises its own zoo of errors for bad files
        raise DataError(f"{path}: not a readable CIFAR-10 parquet file with columns img, label ({exc})") from exc
    pngs = table.column("img").combine_chunks().field("bytes").to_pylist()
    labels = table.column("label").to_numpy().astype(np.int64)
    images = np.empty((len(pngs), 32, 32, 3), dtype=np.uint8)

    def decode(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            with Image.open(io.BytesIO(pngs[i])) as im:
                arr = np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
            if arr.shape != (32, 32, 3):
                raise DataError(f"{path}: row {i} decodes to an image of shape {arr.shape}, not 32 x 32 x 3")
            images[i] = arr

    # Pillow releases the GIL while inflating, so a few threads help on Colab's 2 cores.
    step = 2000
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for f in [pool.submit(decode, lo, min(lo + step, len(pngs))) for lo in range(0, len(pngs), step)]:
            f.result()
    return images, labels


def read_hf_parquet(train_path: str, test_path: str, *, batch_order: Sequence[int] = HF_TRAIN_BATCH_ORDER) -> Arrays:
    """Decode the Hub's parquet pair into canonical arrays, train rows in torchvision order.

    Args:
        train_path, test_path: the ``plain_text`` parquet files.
        batch_order: the data_batch order of the train rows on the Hub (tests pass the identity
            to show that skipping the fix changes the tensor hash).
    """
    train_images, train_labels = _decode_parquet(train_path)
    idx = hf_to_torchvision_order(len(train_images), batch_order)
    test_images, test_labels = _decode_parquet(test_path)
    return train_images[idx], train_labels[idx], test_images, test_labels
