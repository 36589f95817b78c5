"""``attnpool profile``: measure the kernel / linear / network cost table of the GPU at hand (see attnpool.bench.profile)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from attnpool.bench.profile import ProfileOptions, run_profile
from attnpool.errors import ConfigError
from attnpool.kernels.names import GPU_BACKENDS
from attnpool.model.config import MODEL_PRESETS

PARTS = ("attention", "linear", "comm")
PROFILED_BACKENDS = ("auto", *GPU_BACKENDS)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure core-attention, linear-layer and collective costs on this GPU into a cost-table JSON",
        description="Writes one JSON cost table for the GPU it runs on (the format `attnpool plan --cost-model` and "
                    "`attnpool simulate --profile` read). A few minutes on one H200. Collectives are measured only "
                    "under torchrun with several GPUs: torchrun --nproc-per-node 8 -m attnpool.cli.main profile ...")
    p.add_argument("--out", required=True, help="output JSON file")
    p.add_argument("--model", default="llama3-8b",
                   help=f"model preset(s) whose linear layers to time, comma-separated: {', '.join(MODEL_PRESETS)} (default llama3-8b)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"what to measure, comma-separated from {','.join(PARTS)} (default all)")
    p.add_argument("--attention-backend", default="auto",
                   help="the kernel backend(s) whose core-attention table to measure, comma-separated from auto, "
                        "flash, fa4 (default auto: fa4 where flash_attn.cute runs on this sm90+ GPU, else flash); "
                        "flash's table goes to the file's top level, the others' under backends.NAME")
    p.add_argument("--base", help="an earlier profile JSON: keep its sections where this run measures nothing (merge)")
    p.add_argument("--quick", action="store_true", help="a tiny grid: a smoke test in seconds, not a usable table")
    p.add_argument("--q-max", type=int, default=None, help="largest query-shard length measured (default 16384; larger rows are filled)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    parts = tuple(x for x in args.parts.split(",") if x)
    for x in parts:
        if x not in PARTS:
            raise ConfigError("--parts", x, f"unknown; choose from {', '.join(PARTS)}")
    models = tuple(m for m in args.model.split(",") if m)
    for m in models:
        if m not in MODEL_PRESETS:
            raise ConfigError("--model", m, f"unknown preset; known: {', '.join(MODEL_PRESETS)}")
    opts = ProfileOptions.quick() if args.quick else ProfileOptions()
    opts = replace(opts, models=models)
    if args.q_max is not None:
        opts = replace(opts, q_measure_max=args.q_max)
    base = None
    if args.base:
        path = Path(args.base)
        if not path.is_file():
            raise ConfigError("--base", args.base, "no such file")
        try:
            base = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError("--base", args.base, f"not valid JSON ({exc.msg})") from None
    out = Path(args.out)
    if out.parent and not out.parent.exists():
        raise ConfigError("--out", args.out, "its directory does not exist")
    argv = sys.argv[sys.argv.index("profile"):] if "profile" in sys.argv else ["profile"]
    backends = tuple(x for x in args.attention_backend.split(",") if x)
    if not backends:
        raise ConfigError("--attention-backend", args.attention_backend, f"name one of {', '.join(PROFILED_BACKENDS)}")
    for name in backends:
        if name not in PROFILED_BACKENDS:
            raise ConfigError("--attention-backend", name, f"unknown; choose from {', '.join(PROFILED_BACKENDS)}")
    profile = run_profile(opts, parts, base=base, command="attnpool " + shlex.join(argv),
                          log=lambda s: print(s, file=sys.stderr, flush=True), attention_backends=backends)
    if profile is None:  # not rank 0 under torchrun
        return 0
    out.write_text(json.dumps(profile, indent=1))
    print(f"wrote {out} ({profile.get('seconds', 0):.0f} s)")
    return 0
