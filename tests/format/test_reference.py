"""Proving live tensors against a manifest's ``referenced`` entries (issue 48): the digest is the
shared files' one whatever the layout or device, hashing copies at most a bounded chunk, the
first difference is named with its source, and a proof never writes to a live tensor."""

from __future__ import annotations

import re

import pytest
import torch

from ckptsdk.checkpoint.writing.sharing import tensor_digest
from ckptsdk.errors import ConfigError, StateMismatchError
from ckptsdk.format.files import reference
from ckptsdk.format.files.reference import first_difference, hash_tensor, prove
from ckptsdk.format.manifest import ReferencedBase, ReferencedTensor


def _layouts() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(3, 4),
        torch.randn(3, 4).t(),
        torch.randn(5, 6)[:, ::2],
        torch.randn(4, 5, 6).permute(2, 0, 1),
        torch.tensor(3.0),
        torch.zeros(0, 3),
        torch.randn(4, dtype=torch.complex64).conj(),
        torch.randn(2, 3).bfloat16(),
        torch.tensor([True, False]),
        torch.arange(7, dtype=torch.int16)[1:],
    ]


@pytest.mark.parametrize("limit", [1, 8, 64, 1 << 20])
def test_the_digest_is_the_shared_files_one_for_every_layout_and_chunk(limit: int) -> None:
    # One rule: sharing.py's tensor_digest (what `shared` records) and the proof agree, so a
    # tensor stored once and later referenced keeps its digest.
    for t in _layouts():
        assert hash_tensor(t, chunk_bytes=limit) == tensor_digest(t), (t.shape, t.stride())


def test_hashing_copies_at_most_one_chunk_of_a_strided_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    original = reference._byte_chunks

    def spy(t: torch.Tensor, limit: int):  # type: ignore[no-untyped-def]
        for chunk in original(t, limit):
            seen.append(chunk.numel())
            yield chunk

    monkeypatch.setattr(reference, "_byte_chunks", spy)
    t = torch.randn(64, 256).t()  # 64 KiB, not contiguous
    want = tensor_digest(t.contiguous())
    seen.clear()
    assert hash_tensor(t, chunk_bytes=4096) == want
    assert seen and max(seen) <= 4096  # every chunk, copied blocks and the recursion's alike


def _base(live: dict[str, torch.Tensor], source: str | None = "hf:gpt2@607a30d") -> ReferencedBase:
    tensors = {
        path: ReferencedTensor(
            dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), size=t.nbytes, digest=hash_tensor(t)
        )
        for path, t in live.items()
    }
    return ReferencedBase(source=source, algorithm="xxh3-128", tensors=tensors)


def _live() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"objects/model/a.weight": torch.randn(8, 8), "objects/model/b.weight": torch.randn(4, 2)}


def test_the_same_base_is_proven_and_nothing_is_written() -> None:
    live = _live()
    base = _base(live)
    before = {p: (t.clone(), t._version) for p, t in live.items()}
    assert prove(live, [base]) == 8 * 8 * 4 + 4 * 2 * 4
    assert first_difference(live, [base]) is None
    for p, t in live.items():
        assert torch.equal(t, before[p][0]) and t._version == before[p][1]


def test_another_base_is_refused_naming_the_tensor_what_differs_and_the_source() -> None:
    live = _live()
    base = _base(live)
    other = {p: t.clone() for p, t in live.items()}
    other["objects/model/b.weight"][1, 1] += 1  # one value of the second tensor
    kept = other["objects/model/b.weight"].clone()
    with pytest.raises(StateMismatchError) as info:
        prove(other, [base], url="/r", step=7)
    err = info.value
    assert err.mismatches == ["objects/model/b.weight"] and err.url == "/r" and err.step == 7
    expected = base.tensors["objects/model/b.weight"].digest
    text = str(err)
    assert "'objects/model/b.weight'" in text and "hf:gpt2@607a30d" in text and expected in text
    assert re.search(r"found float32 \[4, 2\] digest [0-9a-f]{32}", text) and "nothing was restored" in text
    assert torch.equal(other["objects/model/b.weight"], kept)


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (lambda live: live.pop("objects/model/b.weight"), "absent"),
        (lambda live: live.update({"objects/model/b.weight": torch.zeros(2, 4)}), "float32 [2, 4]"),
        (
            lambda live: live.update({"objects/model/b.weight": torch.zeros(4, 2, dtype=torch.float16)}),
            "float16 [4, 2]",
        ),
        (lambda live: live.update({"objects/model/b.weight": torch.empty(4, 2, device="meta")}), "meta device"),
    ],
)
def test_a_difference_seen_without_hashing_is_found_before_any_byte_is_hashed(
    change, found: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = _live()
    base = _base(live, source=None)
    change(live)
    monkeypatch.setattr(reference, "hash_tensor", lambda *a, **k: pytest.fail("hashed before the cheap checks"))
    diff = first_difference(live, [base])
    assert diff is not None and diff.path == "objects/model/b.weight" and found in diff.found
    assert "an unnamed source" in diff.message()


def test_an_unknown_digest_algorithm_refuses_before_any_work() -> None:
    live = _live()
    base = _base(live).model_copy(update={"algorithm": "blake9"})
    with pytest.raises(ConfigError, match="unknown digest algorithm 'blake9'.*upgrade ckptsdk"):
        prove(live, [base])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_tensor_is_hashed_through_the_bounded_host_buffer() -> None:
    for t in _layouts():
        assert hash_tensor(t.cuda(), chunk_bytes=64) == tensor_digest(t)
    big = torch.randn(1 << 20, device="cuda")
    assert hash_tensor(big, chunk_bytes=1 << 16) == tensor_digest(big.cpu())
    live = {"w": big}
    assert prove(live, [_base({"w": big.cpu()})]) == big.nbytes
