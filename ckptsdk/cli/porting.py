"""``ckptsdk import FILE.pt URL`` and ``ckptsdk export URL[@STEP|@best:METRIC] OUT.safetensors``: the doors.

The logic is :mod:`ckptsdk.porting.torch_import`'s and :mod:`ckptsdk.porting.export`'s, each imported only when
its command runs: nothing else in the CLI ever imports the ``torch.load`` door.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ckptsdk.cli.common import EXIT_OK, UsageError, emit_json, storage_options

__all__ = ["cmd_export", "cmd_import", "register"]


def cmd_import(args: argparse.Namespace) -> int:
    """``ckptsdk import FILE.pt URL``: see :func:`ckptsdk.porting.torch_import.import_torch_checkpoint`."""
    from ckptsdk.porting.torch_import import import_torch_checkpoint, resume_advice

    mapping = {}
    for pair in args.map or ():
        src, sep, dest = pair.partition("=")
        if not (sep and src and dest):
            raise UsageError(f"--map expects ENTRY=DEST (e.g. ema=objects/ema), got {pair!r}")
        mapping[src] = dest
    info = import_torch_checkpoint(
        args.file,
        args.url,
        allow_numpy_rng=args.allow_numpy_rng,
        step=args.step,
        drop=args.drop or (),
        mapping=mapping,
        storage_options=storage_options(args.storage_option),
        force=args.force,
    )
    tags = info.manifest.tags if info.manifest is not None else {}
    ignored = json.loads(tags.get("ignored_files", "[]"))
    if args.json:
        emit_json(
            {
                "command": "import",
                "url": args.url,
                "file": args.file,
                "step": info.step,
                "key": info.key,
                "ignored_files": ignored,
                "resume_with": resume_advice(args.url, info),
            }
        )
    else:
        if ignored:
            print(f"ignored {', '.join(ignored)}: not among the weight files the model was read from")
        print(f"imported {args.file} as step {info.step} ({info.key}) under {args.url}; resume with")
        print(f"  {resume_advice(args.url, info)}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """``ckptsdk export URL[@STEP] OUT.safetensors``: see :func:`ckptsdk.porting.export.export_safetensors`."""
    from ckptsdk.cli.checkpoints import resolve_selector
    from ckptsdk.porting.export import export_safetensors

    url, step = resolve_selector(args.url, storage_options(args.storage_option))
    tied = []
    for pair in args.tied or ():
        gone, sep, kept = pair.partition("=")
        if not (sep and gone and kept):
            raise UsageError(f"--tied expects REMOVED=KEPT, got {pair!r}")
        tied.append((gone, kept))
    # A distributed checkpoint with --object/--tied is a ConfigError: exit 2, as usage.
    report = export_safetensors(
        url,
        args.out,
        step=step,
        object_path=args.object,
        tied=tied,
        storage_options=storage_options(args.storage_option),
        force=args.force,
        base=args.base,
    )
    if args.json:
        emit_json({"command": "export", "url": url, **report})
    else:
        count = "all" if report["tensors"] is None else report["tensors"]
        print(
            f"wrote {count} tensors of step {report['step']} ({report['object']}) to {args.out}"
            + (f"; tied, left out: {json.dumps(report['removed'])}" if report["removed"] else "")
        )
    return EXIT_OK


def register(sub: Any) -> None:
    """Add ``import`` and ``export`` to the subcommands (their arguments differ from URL-first ones)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec/gcsfs storage option")
    sp = sub.add_parser(
        "import",
        parents=[common],
        help="commit a torch.save checkpoint (.pt, Lightning .ckpt, HF checkpoint-N/ folder) as a new root's "
        "first checkpoint, read with weights_only=True",
    )
    sp.add_argument("file", metavar="FILE.pt", help="the .pt/.ckpt file, or an HF Trainer checkpoint-N/ folder")
    sp.add_argument("url", metavar="URL", help="a new checkpoint root (no checkpoints, not inside another root)")
    sp.add_argument(
        "--allow-numpy-rng",
        action="store_true",
        help="accept the 4 numpy globals np.random.get_state() needs (nothing else)",
    )
    sp.add_argument("--step", type=int, help="the step to record (default: the file's 'step'/'global_step')")
    sp.add_argument("--drop", action="append", metavar="KEY", help="leave this key of the file out (repeatable)")
    sp.add_argument(
        "--map",
        action="append",
        metavar="ENTRY=DEST",
        help="place an entry the known layouts do not (repeatable; a/b reaches into a dict): DEST is model, "
        "optimizer, scheduler, scaler, objects/NAME, rng/{torch,cuda,numpy,python}, step, epoch, batch_idx, "
        "extra/NAME or drop",
    )
    sp.add_argument("--force", action="store_true", help="break a live writer lease on URL")
    sp.set_defaults(fn=cmd_import)
    sp = sub.add_parser("export", parents=[common], help="write a checkpoint's model weights to one .safetensors file")
    sp.add_argument(
        "url",
        metavar="URL[@STEP]",
        help="checkpoint root, optionally @STEP or @best:METRIC[:min|max] (default: newest valid)",
    )
    sp.add_argument("out", metavar="OUT.safetensors")
    sp.add_argument(
        "--object",
        metavar="PATH",
        help="where the state dict is in the tree (default: objects/model, objects/model_0 or lightning/state_dict)",
    )
    sp.add_argument(
        "--tied",
        action="append",
        metavar="REMOVED=KEPT",
        help="declare a tied weight: written once, recorded in the metadata as save_model does",
    )
    sp.add_argument(
        "--base",
        metavar="FILE.safetensors",
        help="the frozen base a checkpoint records by reference (its state dict's names): proven by digest, "
        "then written with the trained weights",
    )
    sp.add_argument("--force", action="store_true", help="replace OUT if it exists (never inside a checkpoint root)")
    sp.set_defaults(fn=cmd_export)
