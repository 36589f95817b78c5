"""``attnpool export``: a run's checkpoint as a Hugging Face model directory that transformers loads.

    attnpool export --run runs/pp --out hf-model                   # the run's newest valid checkpoint
    attnpool export --checkpoint runs/pp/checkpoints/step-000100 --out hf-model --dtype fp32

Checkpoints keep the whole model's weight names whatever the layout that trained them (data, tensor or
pipeline parallel), so one process reads every shard and writes one ``config.json`` and
``model.safetensors``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnpool.errors import check_checkpoint_source


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory",
                       description="Write a checkpoint of `attnpool train` (any dp, tp or pp layout) as a Hugging "
                                   "Face model directory: config.json and model.safetensors.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="a run directory: its newest valid checkpoint")
    source.add_argument("--checkpoint", metavar="DIR", help="one checkpoint directory (OUT/checkpoints/step-NNNNNN)")
    p.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face model directory to write")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="weights' dtype, written into config.json too (default auto: the model's own, the one an hf: "
                        "model's config.json names; bf16 for a preset)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what --out holds (the new export is written beside it and renamed into place)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="read a checkpoint without a manifest (written before manifests, or its manifest lost): its "
                        "files' sizes are checked against DCP's metadata, their bytes cannot be")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_checkpoint_source(args.run, args.checkpoint)  # (a missing one refused at once, before torch loads)
    from attnpool.train.export import export_hf  # torch: only once the command runs

    path, skipped = export_hf(run_dir=args.run, checkpoint=args.checkpoint, out=args.out, dtype=args.dtype,
                              overwrite=args.overwrite, allow_unverified=args.allow_unverified)
    for bad, problem in skipped:
        print(f"skipping {bad}: {problem}")
    written = json.loads(Path(args.out, "config.json").read_text())  # (auto: the dtype it resolved to, said)
    dtype = written.get("torch_dtype") or written.get("dtype") or args.dtype
    print(f"attnpool export: {path} -> {args.out} (config.json, safetensors, {dtype})")
    return 0
