"""``attnpool bench``'s strategies and arguments: apart from attnpool.bench.e2e (which needs torch), so that
the command line starts fast."""

from __future__ import annotations

import argparse

from attnpool.sizes import parse_size
from attnpool.train.sections import ATTENTION_BACKENDS, CHECKPOINTING, MEASURED

STRATEGIES = {  # name -> (attention, pingpong, vertical-slash sparse attention: None or its kv_transfer)
    "local": ("local", False, None),
    "wlb": ("wlb", False, None),
    "percp": ("percp", False, None),
    "ulysses": ("ulysses", False, None),
    "cad": ("cad", False, None),
    "cad+pingpong": ("cad", True, None),
    "local+sparse": ("local", False, "prefix"),
    "cad+sparse": ("cad", False, "prefix"),
    "cad+pingpong+sparse": ("cad", True, "prefix"),
    "cad+sparse+readkv": ("cad", False, "read"),  # servers receive only the KV their patterns read
}
DEFAULT_STRATEGIES = ("local", "wlb", "percp", "ulysses", "cad", "cad+pingpong")
BALANCED = "+balanced"  # after any strategy but wlb: laid out by attnpool train's layout balanced


def link_rate(text: str) -> float | str:
    """--exchange-gibps / --inter-node-gibps: a number of GiB/s, or auto (the config's check refuses the rest)."""
    return MEASURED if text.strip().lower() == MEASURED else float(text)


def strategy_settings(name: str) -> tuple[str, bool, str | None, str] | None:
    """A benchmark strategy's (attention, pingpong, sparse kv_transfer or None, layout); None for an unknown name."""
    base = name.removesuffix(BALANCED)
    if base not in STRATEGIES or (base != name and STRATEGIES[base][0] == "wlb"):
        return None
    return (*STRATEGIES[base], "balanced" if base != name else "linear")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for e2e.json and e2e.md")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, a smoke test of the benchmark itself")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sliding-window", type=parse_size, default=None,
                   help="a sliding window of this many keys in every layer, or in those --layer-types marks")
    p.add_argument("--layer-types", default=None, help='which layers slide: "S/F", S sliding layers then F full ones, '
                                                       'repeated (Gemma 3: 5/1)')
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (torchrun's world = pp x dp x tp)")
    p.add_argument("--pp-schedule", default="1f1b", help="pipeline schedule (attnpool train's pp_schedule)")
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches per step, of the configuration's tokens")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism (torchrun's world = dp x tp); --configs tokens stay per GPU, so a dp rank "
                        "(a TP group) holds tp x them")
    p.add_argument("--configs", default="prolong:64K,pretrain:64K,prolong:128K",
                   help="dist:tokens_per_gpu pairs, comma-separated (pretrain is elongated to the global batch)")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help=f"comma-separated, from {', '.join(STRATEGIES)} (the +sparse ones train with "
                        "--sparse vertical-slash at the default coverage; +readkv with kv_transfer=read), each "
                        f"but wlb also with {BALANCED} after it (layout balanced)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--warmup-tokens", type=parse_size, default=None, metavar="SIZE",
                   help="run the warm-up steps on batches of this many tokens per GPU (e.g. 16K), in a run of their "
                        "own before each measured one: kernels compile in seconds where a configuration's steps take "
                        "minutes; the measured steps train on the same batches as without it, from the initial weights "
                        "(not with sparse strategies)")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--ablation", action="store_true", help="also cad+pingpong (plain cad where --pp is above 1) with one-element messages: what the exchange's bytes cost")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no new run after this many seconds")
    p.add_argument("--end-by-s", type=float, default=float("inf"),
                   help="start a run only where one as long as the longest so far would end within this many seconds")
    p.add_argument("--activation-checkpointing", default="keep_attention", choices=CHECKPOINTING,
                   help="what the backward recomputes (default: everything but core attention); 'none' shows what "
                        "the recompute costs, which the ideal leaves out, where memory allows")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="core attention's kernel (attnpool train's attention_backend; default auto: fa4 where "
                        "flash_attn.cute imports on an sm90+ GPU, else flash on CUDA); the one run is recorded")
    p.add_argument("--sparse-args", default="", metavar="K=V,...",
                   help="options of the +sparse strategies, e.g. coverage=0.9,slash_cap=64,vertical_cap=1024 "
                        "(coverage, min_doc_len, and any --sparse-args key of attnpool train)")
    p.add_argument("--hierarchical-exchange", action="store_true",
                   help="core attention's KV crosses between nodes once per node, a server there forwarding it "
                        "(attnpool train's hierarchical_exchange; needs ranks on several nodes); ulysses, which "
                        "exchanges heads, runs without it")
    p.add_argument("--head-chunks", type=int, default=1,
                   help="core attention in this many groups of heads, one group's kernel while another's exchanges "
                        "are on the wire (attnpool train's head_chunks), for the strategies whose exchanges run "
                        "through it (local, wlb, percp, cad; ulysses and the +sparse ones run without)")
    p.add_argument("--exchange-gibps", type=link_rate, default=None, metavar="GIBPS|auto",
                   help="GiB/s per GPU of the link inside a node, or auto (measured at each run's start), for the "
                        "cad strategies' planner (attnpool train's exchange_gibps: each move's bytes weighed against "
                        "the balance it buys; records keep the rate planned with); the others plan no moves. "
                        "Default: cad balances whatever the bytes")
    p.add_argument("--inter-node-gibps", type=link_rate, default=None, metavar="GIBPS|auto",
                   help="GiB/s per GPU between nodes, or auto, for the cad strategies' planner (attnpool train's "
                        "inter_node_gibps: a byte between nodes priced at the links' ratio). Default: the DistCA "
                        "paper's 50 GB/s")
    p.add_argument("--activation-offload", action="store_true",
                   help="keep the activations saved for backward in host memory (attnpool train's activation_offload)")
    p.add_argument("--memory-breakdown", action="store_true",
                   help="record the CUDA allocator's history during each run and write what was live at the peak "
                        "of the rank with the highest one, by allocating code (memory-*.md; slows the steps)")
    p.add_argument("--trace-ranks", default="0", metavar="RANKS",
                   help="the ranks whose traces --trace writes: rank numbers, comma-separated, or all; rank 0's as "
                        "trace-*, each other's as trace-*-rankN (default 0: a rank that waits at an exchange for "
                        "another shows its wait, not the other's kernels)")
    p.add_argument("--trace", default=None, metavar="STRATEGY[,STRATEGY...]",
                   help="profile two extra steps of each of these strategies in the first configuration with torch.profiler "
                        "(not part of the measured steps): trace-*.txt (ops by GPU time) and trace-*.json.gz")
