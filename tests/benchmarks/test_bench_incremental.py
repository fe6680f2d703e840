"""benchmarks/bench_incremental.py runs, and its figures mean what its report says (issue 25).

Not a speed test: the smoke run (a tiny GPT-2, both cases, both stores, every mode this ckptsdk
has) runs as a user runs it, in its own process, and the test checks what must hold whatever the
machine's speed: every restore bit-exact, the full mode sending at least every tensor's bytes at
every save, an incremental mode (once it exists) sending less than the full one for LoRA.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.bench_incremental import build_job, compare, parse_args

REPO = Path(__file__).resolve().parents[2]


def test_the_bit_exact_check_catches_one_changed_element() -> None:
    # The benchmark prints "bit-exact OK" from compare(): it must see a change in the last bit of
    # one element of a frozen base tensor or of the optimizer state, not only gross differences.
    args = parse_args(["--smoke", "--no-peft"])
    a, b = build_job("lora", args), build_job("lora", args, seed=7)
    x = torch.randint(0, args.vocab, (1, args.seq))
    a.model(input_ids=x, labels=x).loss.backward()
    a.opt.step()
    assert compare(a, b)  # other seed, no optimizer state yet: different
    b.model.load_state_dict(a.model.state_dict())
    b.opt.load_state_dict(copy.deepcopy(a.opt.state_dict()))  # torch would share a's tensors
    assert compare(a, b) == []

    frozen = b.model.transformer.wte.weight
    assert not frozen.requires_grad
    with torch.no_grad():
        frozen.view(-1)[3] = torch.nextafter(frozen.view(-1)[3], torch.tensor(float("inf")))
    assert compare(a, b) == ["model/transformer.wte.weight", "model/lm_head.weight"]  # tied: one storage
    b.model.load_state_dict(a.model.state_dict())
    moment = next(iter(b.opt.state.values()))["exp_avg"]
    moment.view(-1)[0] = torch.nextafter(moment.view(-1)[0], torch.tensor(float("inf")))
    assert compare(a, b) == ["optimizer/state/0/exp_avg"]


def test_the_frozen_base_is_counted_apart_from_what_training_changes() -> None:
    args = parse_args(["--smoke", "--no-peft"])
    lora, full = build_job("lora", args), build_job("full", args)
    ls, fs = lora.sizes(), full.sizes()
    trainable = sum(p.numel() * p.element_size() for p in lora.model.parameters() if p.requires_grad)
    assert 0 < trainable < ls["changing"]  # adapters, plus the RNG states
    assert ls["frozen"] == ls["distinct"] - ls["changing"]
    assert ls["frozen_with_aliases"] > ls["frozen"]  # lm_head.weight is wte.weight
    assert fs["frozen"] == 0 and fs["changing"] == fs["distinct"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_run_restores_bit_exact_and_counts_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_incremental",
            "--smoke",
            "--dir",
            str(tmp_path),
            "--json-out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {(r["case"], r["store"]): r for r in report["rows"]}
    assert set(rows) == {(c, s) for c in ("lora", "full") for s in ("local", "drive")}
    assert list(tmp_path.iterdir()) == [out]  # the run's roots are gone
    for (case, store), row in rows.items():
        where = f"{case} on {store}"
        assert set(row["modes"]) == set(report["modes"]), where
        full = row["modes"]["full"]
        assert full["bit_exact"] and full["mismatches"] == [], where
        assert len(full["bytes_per_save"]) == 4 and len(full["restore_s"]) == 1, where
        # Today's saves rewrite every tensor: each sends at least the state's distinct bytes.
        assert min(full["bytes_per_save"]) >= row["sizes"]["distinct"], where
        assert full["footprint"] >= 3 * row["sizes"]["distinct"], where
        if "incremental" in row["modes"]:
            inc = row["modes"]["incremental"]
            assert inc["bit_exact"] and inc["mismatches"] == [], where
            if case == "lora":  # the frozen base is not sent again (full training may send a few more bytes)
                assert max(inc["bytes_per_save"][1:]) < min(full["bytes_per_save"][1:]), (where, inc, full)
    if "incremental" not in report["modes"]:
        assert "full only (this CheckpointManager has no `incremental` keyword" in proc.stdout
    assert proc.stdout.count("bit-exact OK") == 4 * len(report["modes"]), proc.stdout
    assert "FAIL" not in proc.stdout
