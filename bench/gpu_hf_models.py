"""Hugging Face models on GPUs (bf16): attnpool's core attention against transformers' own, and `cad`
training against `local`.

    python3 bench/gpu_hf_models.py --out DIR [--gpus 2] [--tokens 16K] [--steps 4]

1. Logits. For each supported architecture a random model (hidden 512, 4 layers, 8 query heads of 64, 4 KV
   heads), bf16 on one GPU: packed documents under attnpool's attention (one process, the default kernel:
   fa4 where installed, else flash) against transformers' eager attention on each document alone. Both run
   in bf16, so they differ by bf16's rounding of two computation orders; transformers' own bf16 run against
   its float32 one gives the scale of that noise. (Eager: transformers has no sdpa path for Gemma 2.)
2. Training. `attnpool train --model hf:DIR` (a Qwen3 of the same size, random weights) on `--gpus` GPUs
   (NCCL), synthetic prolong documents, `local` and `cad`: the losses' largest relative difference, and the
   median step time of each.

Writes hf_models.json and hf_models.md under DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
SHAPE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, dtype="float32")
DOC_LENS = [3000, 700, 1900, 64, 2500]  # under the Gemma windows below (then planned as causal attention)
WINDOW = 4096


def architectures():
    import transformers

    return {
        "llama": transformers.LlamaConfig(**SHAPE),
        "mistral": transformers.MistralConfig(**SHAPE, sliding_window=None),
        "qwen2": transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
        "qwen3": transformers.Qwen3Config(**SHAPE),
        "gemma": transformers.GemmaConfig(**SHAPE),
        "gemma2": transformers.Gemma2Config(**SHAPE, attn_logit_softcapping=None, final_logit_softcapping=None,
                                            query_pre_attn_scalar=48, sliding_window=WINDOW),
        "gemma3_text": transformers.Gemma3TextConfig(**SHAPE, query_pre_attn_scalar=48, sliding_window=WINDOW),
    }


def compare_logits(root: str) -> dict:
    import transformers
    from test_hf_models import randomize_

    from attnpool.comm import free_port, process_group
    from attnpool.model.hf_causal_lm import build_hf_model, load_hf_spec
    from attnpool.plan import DocPiece
    from attnpool.runtime import plan_layer_kinds

    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen) for n in DOC_LENS]
    tokens = torch.cat(docs).to(device)
    positions = torch.cat([torch.arange(n) for n in DOC_LENS]).to(device)
    pieces = [[DocPiece(d, n, 0, n) for d, n in enumerate(DOC_LENS)]]
    results = {}
    with process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                       timeout=timedelta(seconds=120), device_id=device):
        for arch, config in architectures().items():
            directory = os.path.join(root, arch)
            randomize_(transformers.AutoModelForCausalLM.from_config(config)).save_pretrained(directory)
            spec = load_hf_spec(directory)
            model = build_hf_model(spec, device).eval()
            attention = plan_layer_kinds(spec.config.layer_kinds(), pieces, "local")  # a plan per window
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                ours = model(tokens, positions, attention).float()
            reference = {}
            for dtype in (torch.bfloat16, torch.float32):
                hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                                       dtype=dtype).to(device).eval()
                with torch.no_grad():
                    reference[dtype] = torch.cat([hf(input_ids=d[None].to(device)).logits[0] for d in docs]).float()
            scale = reference[torch.float32].abs().max().item()
            results[arch] = {
                "attnpool_bf16_vs_eager_fp32": (ours - reference[torch.float32]).abs().max().item() / scale,
                "eager_bf16_vs_eager_fp32": (reference[torch.bfloat16] - reference[torch.float32]).abs().max().item()
                / scale,
            }
            print(arch, results[arch], flush=True)
    return results




def compare_training(root: str, gpus: int, tokens: str, steps: int) -> dict:
    import transformers

    model_dir = os.path.join(root, "train-model")
    transformers.Qwen3Config(**SHAPE).save_pretrained(model_dir)
    runs = {}
    for strategy in ("local", "cad"):
        out = os.path.join(root, strategy)
        command = [sys.executable, "-m", "attnpool.cli.main", "train", "--model", f"hf:{model_dir}", "--data",
                   "synthetic", "--data-args", "dist=prolong", "--tokens-per-rank", tokens, "--steps", str(steps),
                   "--warmup-steps", "1", "--nproc", str(gpus), "--attention", strategy, "--device", "cuda",
                   "--no-progress", "--out", out]
        subprocess.run(command, check=True)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        runs[strategy] = {"losses": [r["loss"] for r in rows],
                          "median_step_s": float(np.median([r["step_time_s"] for r in rows[1:]])),
                          "imbalance_after": [r["imbalance_after"] for r in rows]}
        exported = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
        runs[strategy]["export_params"] = sum(p.numel() for p in exported.parameters())
    local, cad = np.array(runs["local"]["losses"]), np.array(runs["cad"]["losses"])
    runs["max_relative_loss_difference"] = float(np.max(np.abs(cad - local) / np.abs(local)))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--tokens", default="16K")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import transformers

    with tempfile.TemporaryDirectory() as root:
        result = {"torch": torch.__version__, "transformers": transformers.__version__,
                  "gpu": torch.cuda.get_device_name(0), "doc_lens": DOC_LENS, "shape": SHAPE,
                  "logits": compare_logits(root),
                  "training": compare_training(root, args.gpus, args.tokens, args.steps)}
    with open(os.path.join(args.out, "hf_models.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    lines = [f"# Hugging Face models under core attention, {result['gpu']}, torch {result['torch']}, "
             f"transformers {result['transformers']}", "",
             f"Command: `python3 bench/gpu_hf_models.py --out DIR --gpus {args.gpus} --tokens {args.tokens} "
             f"--steps {args.steps}`", "",
             "Logits (bf16) relative to transformers' eager attention in float32, documents " + str(DOC_LENS) + ":", "",
             "| architecture | attnpool attention, bf16 | transformers' eager attention, bf16 |", "|---|---|---|"]
    for arch, r in result["logits"].items():
        lines.append(f"| {arch} | {r['attnpool_bf16_vs_eager_fp32']:.2e} | {r['eager_bf16_vs_eager_fp32']:.2e} |")
    t = result["training"]
    lines += ["", f"Training (Qwen3 shape, {args.gpus} GPUs, {args.tokens} tokens per GPU, prolong, {args.steps} "
                  "steps, bf16):", "",
              "| strategy | losses | median step (s) | attention max/mean |", "|---|---|---|---|"]
    for strategy in ("local", "cad"):
        r = t[strategy]
        lines.append(f"| {strategy} | {', '.join(f'{x:.4f}' for x in r['losses'])} | {r['median_step_s']:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in r['imbalance_after'])} |")
    lines += ["", f"Largest relative loss difference, cad vs local: {t['max_relative_loss_difference']:.2e}"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "hf_models.md"), "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
