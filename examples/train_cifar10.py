"""Train (or resume) the ResNet-18 CIFAR-10 job with checkpoints under any storage URL.

    python -m examples.train_cifar10 --ckpt drive://runs/resnet18 --data-cache drive://cache
    python -m examples.train_cifar10 --ckpt /tmp/run --preset quick --data synthetic

Run the same command again after the runtime dies: it resumes from the last checkpoint. Only
argument wiring lives here; the job is ``adapters.cifar10.train``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

# cuBLAS reads this when CUDA is first used; set it before torch can touch the GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from adapters.cifar10.train import PRESETS, describe_audit, run_job  # noqa: E402
from ckptsdk.errors import CkptError  # noqa: E402


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's real default; None means "see the help text" and is not shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def _preset(field: str, what: str) -> str:
    """Help text for an option whose default comes from --preset, with each preset's value."""
    values = {name: getattr(cfg, field) for name, cfg in sorted(PRESETS.items())}
    if len(set(values.values())) == 1:
        return f"{what} (default: {next(iter(values.values()))})"
    return f"{what} (default: " + ", ".join(f"{v} with --preset {n}" for n, v in values.items()) + ")"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
    # Defaults shown by the formatter are the real ones; preset-derived ones say each preset's.
    p.add_argument("--ckpt", required=True, help="checkpoint root URL: /path, drive://REL, gs://bucket/prefix")
    p.add_argument(
        "--data",
        choices=["cifar10", "synthetic"],
        default="cifar10",
        help="CIFAR-10 itself (downloaded once, verified) or synthetic images of the same format",
    )
    p.add_argument(
        "--data-cache", help="URL of the verified data cache, e.g. drive://datacache (cifar10 only; default: none)"
    )
    p.add_argument(
        "--data-dir",
        default=os.path.expanduser("~/.cache/ckptsdk/cifar10"),
        help="local folder for the decoded data set (cifar10 only)",
    )
    p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic data set")
    p.add_argument(
        "--hf-base", help="mirror of the Hugging Face parquet pair (cifar10 only; default: the pinned Hub revision)"
    )
    p.add_argument("--tv-url", help="mirror of cifar-10-python.tar.gz (cifar10 only; default: the Toronto URL)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="full",
        help="full: the story's ResNet-18 job; quick: a small one for CPUs",
    )
    p.add_argument("--epochs", type=int, help=_preset("epochs", "epochs"))
    p.add_argument(
        "--max-steps", type=int, help="stop (with a checkpoint) after this global step (default: all epochs)"
    )
    p.add_argument("--batch-size", type=int, help=_preset("batch_size", "images per step"))
    p.add_argument("--width", type=int, help=_preset("width", "channels of the first ResNet stage (64 = ResNet-18)"))
    p.add_argument("--n-train", type=int, help=_preset("n_train", "synthetic training images (multiple of 5)"))
    p.add_argument("--n-test", type=int, help=_preset("n_test", "synthetic test images"))
    p.add_argument(
        "--save-every", type=int, help=_preset("save_every", "checkpoint every this many steps, and at each epoch end")
    )
    p.add_argument("--seed", type=int, help=_preset("seed", "seed of the model, the shuffle and the augmentation"))
    p.add_argument(
        "--amp",
        choices=["auto", "off", "fp16", "bf16"],
        help=_preset("amp", "mixed precision; auto = fp16 + GradScaler on CUDA, off on CPU"),
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to train")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument(
        "--lease-ttl",
        type=float,
        help="seconds a dead writer's lease must stay silent before this run takes over "
        "(default: 60 on local disk and GCS, 300 on Drive)",
    )
    p.add_argument("--force", action="store_true", help="break the lease now (the old writer is surely gone)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--result-json", help="write this attempt's figures (steps, save/restore times, audit) to this file")
    p.add_argument(
        "--events", action="store_true", help="print '@@ NAME STEP' marker lines (step/saving/saved) for test harnesses"
    )
    return p.parse_args(argv)


def load_data(args: argparse.Namespace, n_train: int, n_test: int):  # noqa: ANN201 (CifarData)
    if args.data == "synthetic":
        from adapters.cifar10.synthetic import synthetic_cifar10

        return synthetic_cifar10(n_train=n_train, n_test=n_test, seed=args.data_seed)
    from adapters.cifar10.data import load_cifar10

    return load_cifar10(cache=args.data_cache, local=args.data_dir, hf_base=args.hf_base, tv_url=args.tv_url)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = PRESETS[args.preset].replace(
        epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        width=args.width,
        n_train=args.n_train,
        n_test=args.n_test,
        save_every=args.save_every,
        seed=args.seed,
        amp=args.amp,
    )

    def echo(line: str) -> None:
        tqdm.write(line)
        sys.stdout.flush()

    def on_event(name: str, step: int) -> None:
        print(f"@@ {name} {step}", flush=True)

    try:
        data = load_data(args, cfg.n_train, cfg.n_test)
        echo(
            f"data: {data.source}, {data.train_images.shape[0]} train / {data.test_images.shape[0]} "
            f"test images, ready in {data.seconds:.1f} s (tensor hash {str(data.tensor_hash)[:16]})"
        )
        result = run_job(
            cfg,
            data,
            args.ckpt,
            device=args.device,
            lease_ttl=args.lease_ttl,
            force=args.force,
            echo=echo,
            progress=not args.no_progress,
            on_event=on_event if args.events else None,
        )
    except CkptError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    echo(f"done at step {result.final_step}; audit {describe_audit(result.audit)}")
    if args.result_json:
        figures = {k: v for k, v in dataclasses.asdict(result).items() if k != "audit"}
        figures["audit"] = result.audit.model_dump(mode="json")
        with open(args.result_json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if result.audit.ok else 1


if __name__ == "__main__":
    sys.exit(main())
