"""CIFAR-10 as canonical tensors, from the fastest verified source, the same from every source.

Chain: local canonical file -> local extracted torchvision folder -> the data cache (any ckptsdk
backend) -> Hugging Face parquet at a pinned commit -> the torchvision tarball. Every result is
checked by a hash of the decoded tensors in canonical order against the pinned or recorded hash.
Also the command ``python -m adapters.cifar10.data``. Parsing the layouts lives in ``sources.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ckptsdk.data.archive import safe_extract
from ckptsdk.data.cache import DataCache
from ckptsdk.errors import AllSourcesFailedError, DataError, DatasetMismatchError

from . import sources as src

logger = logging.getLogger(__name__)

__all__ = ["CANONICAL_NAME", "CifarData", "HASH_ALGORITHM", "load_cifar10", "tensor_hash", "main"]

HASH_ALGORITHM = "xxh3-128"
CANONICAL_NAME = "cifar10/canonical-v1.safetensors"
RECORD_NAME = "cifar10/tensor-hash"
# Tensor hash of the real CIFAR-10 in canonical order. Not pinned yet: it has never been computed
# from the real files in this project (no network here). Until it is, the first verified source
# records it (trust on first use) and every later source must match that record.
PINNED_TENSOR_HASH: str | None = None


@dataclass(frozen=True)
class CifarData:
    """CIFAR-10 in canonical form (torchvision order).

    Attributes:
        train_images: uint8, N x 32 x 32 x 3 (HWC, RGB).
        train_labels: int64, N.
        test_images: uint8, M x 32 x 32 x 3.
        test_labels: int64, M.
        source: where it came from: ``local``, ``local-torchvision``, ``cache``, ``huggingface``,
            ``torchvision`` or ``synthetic``.
        seconds: time until the tensors were ready (and verified).
        tensor_hash: :func:`tensor_hash` of ``[train_images, test_images]``, ``[train_labels, test_labels]``.
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    source: str
    seconds: float
    tensor_hash: str


def tensor_hash(images: torch.Tensor | Sequence[torch.Tensor], labels: torch.Tensor | Sequence[torch.Tensor]) -> str:
    """``"xxh3-128:<hex>"`` over the images, then the labels, in order.

    Each tensor contributes a short header (dtype and shape, so moving a row from one split to
    another changes the hash) and then its bytes in C order (little-endian, as on every platform
    torch runs on). A sequence hashes like its tensors one after the other.

    Example:
        >>> tensor_hash(torch.zeros(1, 32, 32, 3, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64))[:9]
        'xxh3-128:'
    """
    h = xxhash.xxh3_128()
    for group in (images, labels):
        for t in [group] if isinstance(group, torch.Tensor) else list(group):
            t = t.detach().cpu().contiguous()
            h.update(f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)};".encode())
            h.update(t.numpy().data.cast("B") if t.numel() else b"")
    return f"{HASH_ALGORITHM}:{h.hexdigest()}"


def _to_data(arrays: src.Arrays, source: str, start: float) -> CifarData:
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    return CifarData(t[0], t[1], t[2], t[3], source, time.monotonic() - start, tensor_hash([t[0], t[2]], [t[1], t[3]]))


def _record_path(local: str) -> str:
    return os.path.join(local, ".ckptsdk", "cifar10-tensor-hash.json")


class _Expectation:
    """The tensor hash every source must match: pinned, else the cache's record, else the local one."""

    def __init__(self, cache: DataCache, local: str) -> None:
        self.cache, self.local = cache, local
        self.hash: str | None = PINNED_TENSOR_HASH
        self.where = "pinned in adapters/cifar10/data.py" if self.hash else ""
        rec = cache.get_record(RECORD_NAME)
        self.in_cache = rec is not None
        if self.hash is None and rec is not None:
            self.hash = rec.get("tensor_hash")
            self.where = f"recorded in the cache {cache.url} (from {rec.get('source')})"
        if self.hash is None:
            try:
                with open(_record_path(local)) as f:
                    rec = json.load(f)
                self.hash = rec.get("tensor_hash")
                self.where = f"recorded in {_record_path(local)} (from {rec.get('source')})"
            except (OSError, ValueError):
                pass

    def _mismatch(self, data: CifarData, origin: str) -> DatasetMismatchError:
        return DatasetMismatchError(
            f"CIFAR-10 from {origin} decodes to tensors with hash {data.tensor_hash}, but the expected "
            f"hash is {self.hash} ({self.where}). Refusing to train on different data. If the source "
            "legitimately changed, delete that record (and the cached canonical file) and run again",
            source=origin,
            expected=self.hash or "",
            actual=data.tensor_hash,
        )

    def check(self, data: CifarData, origin: str) -> None:
        """Raise DatasetMismatchError unless ``data`` matches; record the hash where it is missing."""
        if self.hash is None:
            logger.info(
                "no tensor hash known for CIFAR-10 yet: trusting %s on first use (%s)", origin, data.tensor_hash
            )
            self.hash, self.where = data.tensor_hash, f"first verified source {origin}"
        if data.tensor_hash != self.hash:
            raise self._mismatch(data, origin)
        record = {
            "tensor_hash": data.tensor_hash,
            "source": origin,
            "recorded_at": time.time(),
            "n_train": len(data.train_labels),
            "n_test": len(data.test_labels),
        }
        if self.cache.backend is not None and not self.in_cache:
            # Create-if-absent: a runtime racing us with other data loses here, not later.
            standing = self.cache.record_once(RECORD_NAME, record)
            self.in_cache = True
            if standing.get("tensor_hash") != data.tensor_hash:
                self.hash = standing.get("tensor_hash")
                self.where = f"recorded in the cache {self.cache.url} (from {standing.get('source')})"
                raise self._mismatch(data, origin)
        if not os.path.exists(_record_path(self.local)):
            path = _record_path(self.local)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)


def _load_canonical(path: str) -> src.Arrays:
    from safetensors.numpy import load_file

    t = load_file(path)
    try:
        return t["train_images"], t["train_labels"], t["test_images"], t["test_labels"]
    except KeyError as exc:
        raise DataError(f"{path}: canonical CIFAR-10 file lacks tensor {exc}; delete it to rebuild") from exc


def _save_canonical(data: CifarData, cache: DataCache, local: str) -> None:
    from safetensors.torch import save_file

    path = os.path.join(local, *CANONICAL_NAME.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.ckptsdk-tmp.{os.getpid()}"
    save_file(
        {
            "train_images": data.train_images,
            "train_labels": data.train_labels,
            "test_images": data.test_images,
            "test_labels": data.test_labels,
        },
        tmp,
        metadata={"tensor_hash": data.tensor_hash},
    )  # one key: safetensors does not order metadata
    os.replace(tmp, path)
    cache.adopt(CANONICAL_NAME, local_dir=local, algorithm=HASH_ALGORITHM, source=data.source)


def load_cifar10(
    *, cache: str | None, local: str, hf_base: str | None = None, tv_url: str | None = None, progress: bool = True
) -> CifarData:
    """CIFAR-10 as verified canonical tensors, from the fastest source that has it.

    Tries: the canonical tensor file in ``local``; an extracted ``cifar-10-batches-py`` in
    ``local``; the canonical file in the cache; the Hugging Face parquet pair (under ``hf_base``);
    the torchvision tarball (``tv_url``, md5-pinned at its default URL). A source that fails is
    logged and the next one tried; what was decoded from a download is stored as the canonical
    file locally and in the cache, so the next fresh runtime copies one verified file.

    Args:
        cache: data cache URL (``gs://b/p``, ``drive://data``, a path, ``memory://x``) or None.
        local: local folder for copies (created if missing).
        hf_base: prefix holding ``plain_text/{train,test}-00000-of-00001.parquet``; default the pinned Hub revision.
        tv_url: full URL of ``cifar-10-python.tar.gz``; default the Toronto URL.
        progress: show download progress bars.

    Returns:
        A :class:`CifarData`.

    Raises:
        DatasetMismatchError: a source decodes to tensors whose hash differs from the pinned or
            recorded one (names both hashes and the source). Not retried with another source.
        AllSourcesFailedError: no source delivered; ``failures`` says why for each.

    Example:
        >>> data = load_cifar10(cache="drive://cifar-cache", local="/content/data")  # doctest: +SKIP
        >>> data.source, data.tensor_hash  # doctest: +SKIP
        ('cache', 'xxh3-128:...')
    """
    start = time.monotonic()
    os.makedirs(local, exist_ok=True)
    hf_base = hf_base or src.HF_BASE_DEFAULT
    hf_base = hf_base if hf_base.endswith("/") else hf_base + "/"
    tv_url = tv_url or src.TV_URL_DEFAULT
    dc = DataCache(cache, progress=progress)
    expect = _Expectation(dc, local)
    failures: dict[str, str] = {}

    def finish(arrays: src.Arrays, source: str, origin: str, *, store: bool) -> CifarData:
        data = _to_data(arrays, source, start)
        expect.check(data, origin)
        if store:
            _save_canonical(data, dc, local)
        data = CifarData(
            data.train_images,
            data.train_labels,
            data.test_images,
            data.test_labels,
            source,
            time.monotonic() - start,
            data.tensor_hash,
        )
        logger.info(
            "CIFAR-10 ready from %s in %.2f s (%d train, %d test), tensor hash %s",
            origin,
            data.seconds,
            len(data.train_labels),
            len(data.test_labels),
            data.tensor_hash,
        )
        return data

    # 1 + 3. The canonical file: local copy, else the cache (DataCache verifies its digest).
    try:
        got = dc.fetch(CANONICAL_NAME, local_dir=local, sources=(), algorithm=HASH_ALGORITHM)
        return finish(_load_canonical(got.path), got.source, f"{got.source} ({got.path})", store=False)
    except AllSourcesFailedError as exc:
        failures.update({f"canonical {k}": v for k, v in exc.failures.items() if k != "sources"})
    except DatasetMismatchError:
        raise
    except DataError as exc:  # e.g. a canonical file that verified but does not parse
        failures["canonical"] = str(exc)

    # 2. A torchvision folder someone (or an earlier run) extracted here.
    tv_dir = os.path.join(local, src.TV_DIRNAME)
    if os.path.isdir(tv_dir):
        try:
            return finish(src.read_torchvision_dir(tv_dir), "local-torchvision", tv_dir, store=True)
        except DatasetMismatchError:
            raise
        except DataError as exc:
            failures[tv_dir] = str(exc)
            logger.warning("local torchvision folder unusable: %s", exc)

    # 4. Hugging Face parquet.
    try:
        train = dc.fetch(
            "cifar10/hf/" + src.HF_TRAIN_FILE, local_dir=local, publish=False, sources=[hf_base + src.HF_TRAIN_FILE]
        )
        test = dc.fetch(
            "cifar10/hf/" + src.HF_TEST_FILE, local_dir=local, publish=False, sources=[hf_base + src.HF_TEST_FILE]
        )
        return finish(src.read_hf_parquet(train.path, test.path), "huggingface", hf_base, store=True)
    except DatasetMismatchError:
        raise
    except DataError as exc:
        failures[hf_base] = str(exc)
        logger.warning("Hugging Face source failed: %s", exc)

    # 5. The torchvision tarball (md5 pinned only for the default URL).
    try:
        pinned = src.TV_MD5 if tv_url == src.TV_URL_DEFAULT else None
        tar = dc.fetch(
            "cifar10/cifar-10-python.tar.gz",
            local_dir=local,
            publish=False,
            sources=[tv_url],
            digest=pinned,
            algorithm="md5" if pinned else "sha256",
        )
        safe_extract(tar.path, local)
        return finish(src.read_torchvision_dir(tv_dir), "torchvision", tv_url, store=True)
    except DatasetMismatchError:
        raise
    except DataError as exc:
        failures[tv_url] = str(exc)
        logger.warning("torchvision source failed: %s", exc)

    lines = "\n".join(f"  - {k}: {v}" for k, v in failures.items())
    raise AllSourcesFailedError(
        f"could not prepare CIFAR-10 in {local!r}; every source failed:\n{lines}\n"
        "Check the network, or pass --hf-base/--tv-url for a mirror",
        name="cifar10",
        failures=failures,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m adapters.cifar10.data --cache URL --local DIR [--hf-base URL] [--tv-url URL] [--json]``."""
    p = argparse.ArgumentParser(
        prog="python -m adapters.cifar10.data",
        description="Prepare CIFAR-10 (verified, cached) and report where it came from.",
    )
    p.add_argument("--cache", default=None, help="data cache URL (gs://, drive://, path, memory://); omit for none")
    p.add_argument("--local", required=True, help="local folder for the prepared data")
    p.add_argument("--hf-base", default=None, help="prefix holding plain_text/{train,test}-00000-of-00001.parquet")
    p.add_argument("--tv-url", default=None, help="full URL of cifar-10-python.tar.gz")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        data = load_cifar10(
            cache=args.cache, local=args.local, hf_base=args.hf_base, tv_url=args.tv_url, progress=not args.no_progress
        )
    except DataError as exc:
        if args.json:
            sys.stdout.write(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}) + "\n")
        else:
            sys.stderr.write(f"error: {exc}\n")
        return 1
    report = {
        "ok": True,
        "source": data.source,
        "seconds": round(data.seconds, 3),
        "tensor_hash": data.tensor_hash,
        "n_train": len(data.train_labels),
        "n_test": len(data.test_labels),
        "local": args.local,
        "cache": args.cache,
        # Which source first defined "CIFAR-10" for this cache (trust on first use).
        "record": DataCache(args.cache).get_record(RECORD_NAME) if args.cache else None,
    }
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        sys.stdout.write(
            f"CIFAR-10 ready from {data.source} in {data.seconds:.2f} s "
            f"({report['n_train']} train, {report['n_test']} test); tensor hash {data.tensor_hash}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
