#!/usr/bin/env python
"""Incremental saves (issue 25): what a save writes when most of the state never changes. Not a test.

A GPT-2-small-sized model built from a config (no hub), trained on CPU with AdamW on tiny random
token batches, in two cases: LoRA (peft, r=8 on c_attn and c_proj; the base frozen) and full
fine-tuning (everything trains). Each case is saved every ``--steps-per-save`` steps on two stores,
a local disk folder and the Drive simulation (``DriveBackend`` on a plain folder through
``CKPTSDK_DRIVE_ROOT``, retention in its default recycle mode), by one writer per mode:
``incremental=True`` (a tensor unchanged since a kept checkpoint is not written again) and
``incremental=False`` (today: every save rewrites every tensor). The two writers save the same
state after the same steps, taking turns (order rotated at every save), so a shared machine's
drift hits both alike. Where ``CheckpointManager`` has no ``incremental`` keyword (before the
feature) only the full mode runs, and the report says so.

    python -m benchmarks.bench_incremental                      # GPT-2 small: ~10-20 min on 2 cores
    python -m benchmarks.bench_incremental --layers 4 --embd 256 --cases lora --stores local
    python -m benchmarks.bench_incremental --smoke              # seconds: a tiny model (the test runs this)
    python -m benchmarks.bench_incremental --reference [ARGS]   # reference mode: bench_reference.py

Per case x store x mode: bytes written per save after the first (every byte streamed through
``write``/``create``/``replace``/``overwrite`` of a ``CountingBackend`` around the store: tensors,
manifest, lease renewal, run log; ``copy`` calls, which stream nothing, are counted apart), the
blocking save's time (``save(blocking=True)``, rotation included: the loop waits for it), the
root's footprint after the last save with ``keep_last`` (every distinct file under the folder,
hard links once, as ``du`` counts; and ``ckptsdk du``'s total), and the restore time into a fresh
model and optimizer by a new read-only manager (page cache of the root dropped first), checked
bit-exact tensor by tensor with ``torch.equal``.

``--reference`` runs the fine-tune comparison of issue 48 instead (``benchmarks/bench_reference.py``,
the rest of the arguments are its own): a 1 GiB frozen base with LoRA adapters and AdamW on the
gpu-like step, ``frozen="reference"`` against ``frozen="store"`` (this benchmark's incremental
mode) and against the Hugging Face Trainer's ``checkpoint-N`` files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_checkpoint import drop_cache, loadavg  # noqa: E402
from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend  # noqa: E402
from ckptsdk.checkpoint.pruning.usage import usage  # noqa: E402
from ckptsdk.testing.counting import CountingBackend  # noqa: E402

#: Whether this ckptsdk has the feature: the option, not a version number, decides.
HAS_INCREMENTAL = "incremental" in {f.name for f in dataclasses.fields(SaveOptions)}
MODES = ("incremental", "full") if HAS_INCREMENTAL else ("full",)

# The targets (ratios of medians in one run, incremental against full).
LORA_BYTES_MAX = 0.02  # each save after the first writes <= 2 % of the full state's bytes
LORA_TIME_MAX = 0.10  # ... in <= 10 % of a full save's time
LORA_FOOTPRINT_MAX = 1.10  # footprint with keep_last=3 <= 1.1x (one base + three adapter states)
FULL_TIME_MAX = 1.03  # full training: save time within 3 % of today's
RESTORE_MAX = 1.0  # restore no slower than today's restore of the same state

# vocab 4200 x embd 64: a 1.03 MiB embedding, above ckptsdk's 1 MiB threshold for shared tensors.
SMOKE = dict(layers=2, embd=64, heads=2, vocab=4200, positions=64, seq=8, saves=4, steps_per_save=1, restore_reps=1)


# ------------------------------------------------------------------------------ the job


@dataclass
class Job:
    """A model and its AdamW, and what of its state can never change (the frozen base)."""

    case: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    lora: str = ""  # "peft", "own" or "" (full fine-tuning)
    state: TrainState = field(init=False)

    def __post_init__(self) -> None:
        self.state = TrainState(model=self.model, optimizer=self.opt)

    def sizes(self) -> dict[str, int]:
        """Bytes of the state's tensors, each storage once (``total``: as the tree lists them).

        Frozen: model entries that are not trainable parameters (the frozen base, buffers).
        Changing: trainable parameters, the optimizer's state, the RNG states. By storage, not by
        name: GPT-2 ties lm_head.weight to wte.weight (``frozen_with_aliases`` counts it twice).
        """
        trainable = {_alias(p) for p in self.model.parameters() if p.requires_grad}
        seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
        out = {"frozen": 0, "frozen_with_aliases": 0, "changing": 0, "total": 0, "distinct": 0}
        for path, t in _tensors(self.state.state_dict()):
            n = t.numel() * t.element_size()
            out["total"] += n
            frozen = path.startswith("objects/model/") and _alias(t) not in trainable
            out["frozen_with_aliases"] += n if frozen else 0
            if _alias(t) in seen:
                continue
            seen.add(_alias(t))
            out["distinct"] += n
            out["frozen" if frozen else "changing"] += n
        return out


def _alias(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...]]:
    return (t.data_ptr(), t.dtype, tuple(t.shape))


def _tensors(node: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _tensors(v, f"{path}/{k}" if path else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _tensors(v, f"{path}/{i}")


class _OwnLoRA(torch.nn.Module):
    """A LoRA of our own around a GPT-2 ``Conv1D`` (y = x W + b), for when peft does not import."""

    def __init__(self, base: torch.nn.Module, r: int = 8, alpha: int = 16) -> None:
        super().__init__()
        self.base_layer = base
        fan_in, fan_out = base.weight.shape  # Conv1D stores (in, out)
        self.lora_A = torch.nn.Parameter(torch.randn(fan_in, r) / r)
        self.lora_B = torch.nn.Parameter(torch.zeros(r, fan_out))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base_layer(x) + (x @ self.lora_A @ self.lora_B) * self.scale
        return out


def build_job(case: str, args: argparse.Namespace, seed: int = 0) -> Job:
    """A GPT-2 from ``args`` (seeded), LoRA-wrapped for ``case == "lora"``, and its AdamW."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.embd,
        n_head=args.heads or max(1, args.embd // 64),
        vocab_size=args.vocab,
        n_positions=args.positions,
        bos_token_id=args.vocab - 1,
        eos_token_id=args.vocab - 1,
    )
    model: torch.nn.Module = GPT2LMHeadModel(config)
    lora = ""
    if case == "lora":
        model, lora = _with_lora(model, args.no_peft)
    params = [p for p in model.parameters() if p.requires_grad]
    return Job(case, model, torch.optim.AdamW(params, lr=1e-4), lora)


def _with_lora(model: torch.nn.Module, no_peft: bool) -> tuple[torch.nn.Module, str]:
    if not no_peft:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            pass
        else:  # GPT-2's Conv1D stores its weight transposed: fan_in_fan_out
            cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
            cfg.lora_dropout = 0.0
            return get_peft_model(model, cfg), "peft"
    model.requires_grad_(False)
    for block in model.transformer.h:
        block.attn.c_attn = _OwnLoRA(block.attn.c_attn)
        block.attn.c_proj = _OwnLoRA(block.attn.c_proj)
        block.mlp.c_proj = _OwnLoRA(block.mlp.c_proj)
    return model, "own"


def train(job: Job, steps: int, args: argparse.Namespace, gen: torch.Generator) -> None:
    """Real training steps on random tokens: cheap on purpose, the saves are what is measured."""
    job.model.train()
    for _ in range(steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        loss = job.model(input_ids=x, labels=x).loss
        loss.backward()
        job.opt.step()
        job.opt.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------ one case on one store


@dataclass
class Writer:
    """One mode's root: its counted backend, its manager, and what its saves cost."""

    mode: str
    url: str
    folder: Path
    backend: CountingBackend
    mgr: CheckpointManager
    bytes: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    footprint: int = 0
    du: dict[str, Any] = field(default_factory=dict)


def open_writer(mode: str, url: str, folder: Path, store: str, keep_last: int) -> Writer:
    backend = CountingBackend(open_backend(url))
    # settle 0 on Drive: one writer, no rival VM to wait for (the default waits ttl/5).
    leasing = LeaseOptions(ttl=600.0, settle=0.0 if store == "drive" else None)
    saves: dict[str, Any] = dict(on_signal=False)
    if HAS_INCREMENTAL:
        saves["incremental"] = mode == "incremental"
    mgr = CheckpointManager(backend, keep_last=keep_last, lease_options=leasing, save_options=SaveOptions(**saves))
    return Writer(mode, url, folder, backend, mgr)


def run_case_store(case: str, store: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Train one job, save it with every mode in turn, then restore each root into a fresh job."""
    job = build_job(case, args)
    writers = []
    for mode in MODES:
        name = f"{case}-{store}-{mode}"
        if store == "local":
            folder = tmp / name
            writers.append(open_writer(mode, str(folder), folder, store, args.keep_last))
        else:
            folder = Path(os.environ["CKPTSDK_DRIVE_ROOT"]) / name
            writers.append(open_writer(mode, f"drive://{name}", folder, store, args.keep_last))
    gen = torch.Generator().manual_seed(1)
    for s in range(1, args.saves + 1):
        train(job, args.steps_per_save, args, gen)
        for w in _rotated(writers, s):
            gc.collect()
            b0, c0 = w.backend.bytes_written, w.backend.calls["copy"]
            t0 = time.perf_counter()
            w.mgr.save(job.state, step=s * args.steps_per_save, blocking=True)
            w.seconds.append(time.perf_counter() - t0)
            w.bytes.append(w.backend.bytes_written - b0)
            w.copies.append(w.backend.calls["copy"] - c0)
    for w in writers:
        w.mgr.close()
        w.footprint = folder_bytes(w.folder)
        try:
            u = usage(open_backend(w.url))
            w.du = {"total": u.total, "shared": u.shared, "trash_bytes": u.trash_bytes}
        except Exception as exc:  # a benchmark reports a failing `du` rather than dying on it
            w.du = {"error": f"{type(exc).__name__}: {exc}"}
    for r in range(args.restore_reps):
        for w in _rotated(writers, r):
            restore_into_fresh(w, job, args)
    sizes = job.sizes()
    out = {"case": case, "store": store, "lora": job.lora, "sizes": sizes, "loadavg": loadavg(), "modes": {}}
    for w in writers:
        out["modes"][w.mode] = {
            "bytes_per_save": w.bytes,
            "copy_calls_per_save": w.copies,
            "save_s": w.seconds,
            "restore_s": w.restore_s,
            "bit_exact": all(w.exact) and bool(w.exact),
            "mismatches": w.mismatches[:10],
            "footprint": w.footprint,
            "du": w.du,
        }
    del job, writers
    gc.collect()
    return out


def _rotated(items: list[Writer], k: int) -> list[Writer]:
    k %= len(items)
    return items[k:] + items[:k]


def restore_into_fresh(w: Writer, source: Job, args: argparse.Namespace) -> None:
    """Time a cold restore of ``w``'s newest checkpoint into a fresh job, and compare every tensor."""
    fresh = build_job(source.case, args, seed=12345)  # other weights: the restore must bring them all
    drop_cache(w.folder)
    gc.collect()
    t0 = time.perf_counter()
    reader = CheckpointManager(open_backend(w.url), read_only=True)
    reader.restore(fresh.state)
    w.restore_s.append(time.perf_counter() - t0)
    reader.close()
    bad = compare(source, fresh)
    w.exact.append(not bad)
    w.mismatches.extend(bad)
    del fresh, reader
    gc.collect()


def compare(a: Job, b: Job) -> list[str]:
    """Paths where ``b``'s model or optimizer state differs from ``a``'s (dtype, shape or any bit)."""
    bad: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                bad.append(path)
        elif isinstance(x, dict):
            if not isinstance(y, dict) or set(x) != set(y):
                bad.append(path + " (keys)")
                return
            for k in x:
                walk(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            if not isinstance(y, (list, tuple)) or len(x) != len(y):
                bad.append(path + " (length)")
                return
            for i, (xi, yi) in enumerate(zip(x, y, strict=True)):
                walk(xi, yi, f"{path}/{i}")
        elif x != y:
            bad.append(path)

    walk(a.model.state_dict(), b.model.state_dict(), "model")
    walk(a.opt.state_dict(), b.opt.state_dict(), "optimizer")
    return bad


def folder_bytes(folder: Path) -> int:
    """Bytes of every distinct file under ``folder`` (hard links once, temp files included), as du -b."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in folder.rglob("*"):
        st = p.lstat()
        if p.is_file() and not p.is_symlink() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


# ------------------------------------------------------------------------------ report


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def summarise(row: dict[str, Any], keep_last: int) -> dict[str, Any]:
    """Medians (saves after the first), ratios against the full mode, and the targets they meet."""
    sizes = row["sizes"]
    ideal = sizes["frozen"] + keep_last * sizes["changing"]
    summary: dict[str, Any] = {"ideal_footprint": ideal, "modes": {}}
    for mode, m in row["modes"].items():
        summary["modes"][mode] = {
            "bytes": _stats([float(b) for b in m["bytes_per_save"][1:]]),
            "first_bytes": m["bytes_per_save"][0],
            "save_s": _stats(m["save_s"][1:]),
            "first_save_s": m["save_s"][0],
            "restore_s": _stats(m["restore_s"]),
            "footprint_vs_ideal": m["footprint"] / ideal if ideal else float("nan"),
        }
    if "incremental" not in row["modes"]:
        return summary
    inc, full = row["modes"]["incremental"], row["modes"]["full"]
    si, sf = summary["modes"]["incremental"], summary["modes"]["full"]
    r: dict[str, float] = {
        "bytes": si["bytes"]["median"] / sf["bytes"]["median"],
        "save_s": si["save_s"]["median"] / sf["save_s"]["median"],
        # Per save (same state, back to back): less sensitive to drift than a ratio of medians.
        "save_s_paired": statistics.median(a / b for a, b in zip(inc["save_s"][1:], full["save_s"][1:], strict=True)),
        "restore_s": si["restore_s"]["median"] / sf["restore_s"]["median"],
        "footprint_vs_full": inc["footprint"] / full["footprint"],
    }
    summary["ratios"] = r
    exact = inc["bit_exact"] and full["bit_exact"]
    targets: list[tuple[str, bool]] = []
    if row["case"] == "lora":
        targets += [
            (f"bytes/save {r['bytes']:.2%} of full <= {LORA_BYTES_MAX:.0%}", r["bytes"] <= LORA_BYTES_MAX),
            (f"save time {r['save_s']:.1%} of full <= {LORA_TIME_MAX:.0%}", r["save_s"] <= LORA_TIME_MAX),
            (
                f"footprint {si['footprint_vs_ideal']:.2f}x ideal <= {LORA_FOOTPRINT_MAX:.1f}x",
                si["footprint_vs_ideal"] <= LORA_FOOTPRINT_MAX,
            ),
        ]
    else:
        targets.append((f"save time {r['save_s']:.3f}x full <= {FULL_TIME_MAX:.2f}x", r["save_s"] <= FULL_TIME_MAX))
    targets += [
        (f"restore {r['restore_s']:.2f}x full <= {RESTORE_MAX:.1f}x", r["restore_s"] <= RESTORE_MAX),
        ("restore bit-exact (both modes)", exact),
    ]
    summary["targets"] = [{"what": what, "met": met} for what, met in targets]
    return summary


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def print_row(row: dict[str, Any], s: dict[str, Any], keep_last: int) -> None:
    sizes = row["sizes"]
    lora = f", LoRA by {row['lora']}" if row["lora"] else ""
    print(f"\n== {row['case']} on {row['store']}{lora} (load average at its end {row['loadavg']}) ==")
    print(
        f"state {_mb(sizes['total'])}: frozen {_mb(sizes['frozen'])}"
        f" ({_mb(sizes['frozen_with_aliases'])} with tied aliases counted apart), changing {_mb(sizes['changing'])};"
        f" ideal footprint = frozen + {keep_last} x changing = {_mb(s['ideal_footprint'])}"
    )
    cols = ("mode", "MB/save med (min-max)", "save s med (min-max)", "1st MB", "1st s", "restore s med (min-max)")
    print(f"{cols[0]:11s} {cols[1]:>25s} {cols[2]:>23s} {cols[3]:>8s} {cols[4]:>6s} {cols[5]:>24s}", end="")
    print(f" {'footprint MB':>12s} {'x ideal':>7s}  ckptsdk du / restore")
    for mode, m in s["modes"].items():
        raw = row["modes"][mode]
        b, t, rs = m["bytes"], m["save_s"], m["restore_s"]
        du = raw["du"]
        du_s = f"{du['total'] / 1e6:.2f} MB" if "total" in du else f"failed ({du.get('error', '?')})"
        if du.get("trash_bytes") is not None:  # Drive: what rotation sent to the trash (30 days)
            du_s += f", trash {du['trash_bytes'] / 1e6:.2f} MB"
        exact = "bit-exact OK" if raw["bit_exact"] else "bit-exact FAIL: " + ", ".join(raw["mismatches"][:3])
        print(
            f"{mode:11s} {b['median'] / 1e6:9.2f} ({b['min'] / 1e6:.2f}-{b['max'] / 1e6:.2f})".ljust(38)
            + f"{t['median']:7.3f} ({t['min']:.3f}-{t['max']:.3f})".rjust(23)
            + f" {m['first_bytes'] / 1e6:8.2f} {m['first_save_s']:6.3f}"
            + f"{rs['median']:7.3f} ({rs['min']:.3f}-{rs['max']:.3f})".rjust(25)
            + f" {raw['footprint'] / 1e6:12.2f} {m['footprint_vs_ideal']:7.2f}  {du_s} / {exact}"
        )
        copies = sum(raw["copy_calls_per_save"][1:])
        if copies:
            print(f"{'':11s} + {copies} copy calls after the first save (server-side or hard links: no bytes sent)")
    if "ratios" not in s:
        print("incremental vs full: n/a (this CheckpointManager has no `incremental` keyword: full mode only)")
        return
    r = s["ratios"]
    print(
        f"incremental vs full: bytes/save {r['bytes']:.2%}, save time {r['save_s']:.1%}"
        f" (paired per save {r['save_s_paired']:.1%}), restore time {r['restore_s']:.2f}x,"
        f" footprint {r['footprint_vs_full']:.2f}x"
    )
    for t in s["targets"]:
        print(f"  target {t['what']}: {'met' if t['met'] else 'MISSED'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (default 12: GPT-2 small)")
    ap.add_argument("--embd", type=int, default=768, help="width (default 768)")
    ap.add_argument("--heads", type=int, default=0, help="attention heads (default: width // 64)")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary (default GPT-2's 50257)")
    ap.add_argument("--positions", type=int, default=1024, help="position table (default 1024)")
    ap.add_argument("--seq", type=int, default=8, help="tokens per sequence in the training steps")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--saves", type=int, default=6, help="saves per case, store and mode (default 6)")
    ap.add_argument("--steps-per-save", type=int, default=2, help="training steps between saves (default 2)")
    ap.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (default 3)")
    ap.add_argument("--restore-reps", type=int, default=2, help="restores per root (default 2)")
    ap.add_argument("--cases", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--stores", nargs="+", default=["local", "drive"], choices=["local", "drive"])
    ap.add_argument("--no-peft", action="store_true", help="use the benchmark's own LoRA even if peft imports")
    ap.add_argument("--smoke", action="store_true", help="a tiny model and few saves: checks the benchmark runs")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder; a real disk)")
    ap.add_argument("--json-out", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    if args.saves < 2:
        ap.error("--saves must be at least 2: the figures are of the saves after the first")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--reference" in argv:
        from benchmarks import bench_reference

        return bench_reference.main([a for a in argv if a != "--reference"])
    args = parse_args(argv)
    warnings.filterwarnings("ignore")  # peft's fan_in_fan_out notice, transformers' config notices
    logging.basicConfig(level=logging.WARNING)
    for name in ("transformers", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    command = shlex.join(
        [sys.executable, "-m", "benchmarks.bench_incremental", *(sys.argv[1:] if argv is None else argv)]
    )
    print(f"command: {command}")
    print(f"load average at start: {loadavg()}; cpus {os.cpu_count()}; torch {torch.__version__}")
    print(
        "modes: incremental=True vs incremental=False, interleaved"
        if HAS_INCREMENTAL
        else "modes: full only (this ckptsdk has no `SaveOptions.incremental`; today's behaviour)"
    )
    print(
        f"GPT-2 layers={args.layers} embd={args.embd} vocab={args.vocab}; {args.saves} saves x"
        f" {args.steps_per_save} steps (batch {args.batch} x {args.seq} tokens), keep_last={args.keep_last},"
        f" {args.restore_reps} restores per root"
    )
    report: dict[str, Any] = {"command": command, "loadavg_start": loadavg(), "modes": list(MODES), "rows": []}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-incr-", dir=args.dir) as tmp:
        drive = Path(tmp) / "drive"
        drive.mkdir()
        with _env("CKPTSDK_DRIVE_ROOT", str(drive)):
            for case in args.cases:
                for store in args.stores:
                    row = run_case_store(case, store, Path(tmp), args)
                    row["summary"] = summarise(row, args.keep_last)
                    report["rows"].append(row)
                    print_row(row, row["summary"], args.keep_last)
                    sys.stdout.flush()
                    _clear(Path(tmp))
    report["loadavg_end"] = loadavg()
    report["wall_s"] = time.perf_counter() - t_start
    print(
        f"\nload average: start {report['loadavg_start']}, end {report['loadavg_end']}; wall {report['wall_s']:.0f} s;"
        " figures after the first save; ratios are medians of the same run; bytes = every byte sent through"
        " write/create/replace/overwrite; footprint = distinct files under the root after the last save"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def _clear(tmp: Path) -> None:
    """Free the disk between rows (a full GPT-2 root with keep_last=3 holds ~6 GB)."""
    import shutil

    for p in list(tmp.iterdir()) + list((tmp / "drive").iterdir()):
        if p.name != "drive":
            shutil.rmtree(p)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


if __name__ == "__main__":
    sys.exit(main())
