"""The sections of a training config: each a frozen dataclass of settings that coerces its values (numbers given
as strings, sizes like 4K) and checks them. attnpool.train.config puts them together; no torch here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from attnpool.errors import ConfigError
from attnpool.kernels.names import BACKENDS
from attnpool.model.float8_options import RECIPES as FLOAT8_RECIPES
from attnpool.model.loss_kernels import LOSS_KERNELS
from attnpool.model.hf_config import OWN_MODEL_TYPES
from attnpool.model.spec import HF_PREFIX, MODEL_IMPLS
from attnpool.plan import LAYOUTS, STRATEGIES
from attnpool.plan.cost import gibps_problem
from attnpool.sizes import parse_size
from attnpool.sparse import SparseConfig

PRECISIONS = ("auto", "bf16", "fp32")
CHECKPOINTING = ("none", "full", "keep_attention", "auto")
# The share of the device's memory auto's choice leaves free (the default of auto_headroom). The full 8B on 2 x H200
# (bench/results/2026-11-28-h200x2-auto-checkpointing.md): the allocated peaks were predicted within 1-8%, but the
# allocator reserved 1.07-1.25x its allocated peak, not the calibration's 1.008x; with 5% left, auto's choice ran at
# 98% of the device and 6% slower than full; with 15%, 2.8% faster, and with 25%, 1.7%.
AUTO_HEADROOM = 0.15
DEVICES = ("auto", "cpu", "cuda")
DATA_KINDS = ("stdlib", "synthetic", "text", "npy", "jsonl", "retrieval")
LOGGERS = ("none", "tensorboard", "wandb")
ATTENTION_BACKENDS = ("auto", *BACKENDS)
# The source option that ``data_path`` fills, per source kind.
DATA_PATH_OPTION = {"text": "paths", "npy": "tokens_path", "jsonl": "path"}
SPARSE_SIZE_ARGS = ("vertical_cap", "slash_cap", "last_queries", "sink_tokens", "local_window", "block",
                    "vertical_chunk")
SPARSE_ARGS = SPARSE_SIZE_ARGS + ("kv_transfer", "cost_coefficients", "price_from_kernels")  # every sparse_args option


def _setting(key: str, help_text: str, metavar: str | None = None, **kw):
    """A section's field: ``key`` is the setting's one name in YAML files, flags and errors; ``metavar`` what its
    flag's help shows for its value (default: its type's name)."""
    return field(metadata={"key": key, "help": help_text, **({"metavar": metavar} if metavar else {})}, **kw)


class Section:
    """A frozen dataclass of settings: each value coerced to its field's type, then :meth:`check`."""

    TITLE = ""

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f, getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Refuse what this section's own values make impossible (ConfigError naming the key)."""

    @classmethod
    def keys(cls) -> dict[str, str]:
        """key -> field name."""
        return {f.metadata["key"]: f.name for f in fields(cls)}


@dataclass(frozen=True)
class ModelSection(Section):
    TITLE = "model"
    name: str = _setting("model", "model preset (tiny, llama3-8b, llama-34b, qwen2.5-3b), or hf:DIR, a Hugging Face "
                                  "model directory (config.json, safetensors weights if any)", default="tiny")
    impl: str = _setting("model_impl", "how an hf: model runs: auto or attnpool (attnpool's own model, every "
                                       f"feature; families {', '.join(OWN_MODEL_TYPES)}) or transformers (its "
                                       "modules behind attnpool's core attention, for what attnpool's model does "
                                       "not implement, e.g. attention biases: no tp, pp, ping-pong, keep_attention "
                                       "or compile)", default="auto")
    args: dict = _setting("model_args", "model fields to override, e.g. n_layers=2 dim=64; for hf:DIR, settings of its "
                                        "config.json, e.g. rope_theta=500000 max_position_embeddings=131072 "
                                        "rope_scaling='{rope_type: yarn, factor: 4.0}'", default_factory=dict)
    precision: str = _setting("precision", "auto (bf16 autocast on CUDA, fp32 on CPU), bf16 or fp32", default="auto")
    compile: bool = _setting("compile", "torch.compile every layer's linear parts (norms, projections, RoPE, SwiGLU), "
                                        "fusing the elementwise work between the matmuls; core attention stays eager. "
                                        "The first steps compile", default=False)
    float8: bool = _setting("float8", "the decoder layers' linear layers in float8 through torchao (GPUs of compute "
                                      "capability 8.9+; pip install 'attnpool[float8]'); attention, norms, embedding "
                                      "and the LM head stay bf16", default=False)
    float8_recipe: str = _setting("float8_recipe", "float8's scaling: tensorwise (one scale per tensor), rowwise "
                                                   "(one per row) or rowwise_with_gw_hp (rowwise, the weight gradient "
                                                   "in bf16)", default="tensorwise")
    float8_all_gather: bool = _setting("float8_all_gather", "float8 tensorwise: FSDP2 gathers the decoder layers' "
                                                            "linear weights in float8, half bf16's bytes, their scales "
                                                            "made in one all-reduce before each step",
                                       default=False)
    loss_kernel: str = _setting("loss_kernel", "the LM head's loss (projection and cross-entropy): auto (liger where "
                                               "liger_kernel imports on a CUDA run with tp=1, else chunked), liger "
                                               "(Liger-Kernel's fused linear cross-entropy: gradients made in the forward, "
                                               "no logits recomputed) or chunked (float32 logits in chunks, recomputed in "
                                               "backward)", default="auto")

    def check(self) -> None:
        if self.name == HF_PREFIX:
            raise ConfigError("model", self.name, "name a model directory after hf:")
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("loss_kernel", self.loss_kernel, LOSS_KERNELS)
        _one_of("model_impl", self.impl, MODEL_IMPLS)
        _one_of("float8_recipe", self.float8_recipe, FLOAT8_RECIPES)
        if self.impl != "auto" and not self.name.startswith(HF_PREFIX):
            raise ConfigError("model_impl", self.impl, f"chooses how an hf: model runs; {self.name} is attnpool's own")


@dataclass(frozen=True)
class DataSection(Section):
    TITLE = "data"
    source: str = _setting("data", f"document source: {', '.join(DATA_KINDS)}, or hf:NAME_OR_PATH "
                                   "(datasets.load_dataset: json/jsonl/parquet/text files, a saved dataset, a Hub name)",
                           default="stdlib")
    path: str | None = _setting("data_path", "text: file, directory or glob; npy: tokens .npy; jsonl: .jsonl file",
                                default=None)
    args: dict = _setting("data_args", "more source options, e.g. offsets_path=... tokenizer_path=... dist=prolong; hf: "
                                       "text_field, split, subset, streaming, documents, add_special_tokens, append_eos, cache_dir",
                          default_factory=dict)
    tokenizer: str | None = _setting("tokenizer", "Hugging Face tokenizer directory for hf: and jsonl data (default: "
                                                  "the hf: model's directory)", default=None)
    tokens_per_rank: int = _setting("tokens_per_rank", "tokens per data-parallel rank per micro-batch (the global "
                                                       "batch is dp x this; dp = nproc / (pp x tp))", default=1024)
    max_doc_len: int | None = _setting("max_doc_len", "cut longer documents into pieces of this many tokens",
                                       default=None)
    seed: int = _setting("seed", "seed of the initial weights and of the document order", default=0)

    def check(self) -> None:
        if self.source.startswith(HF_PREFIX):
            if self.source == HF_PREFIX:
                raise ConfigError("data", self.source, "name a dataset or a path after hf:")
        elif self.source not in DATA_KINDS:
            raise ConfigError("data", self.source, f"unknown source; choose one of {', '.join(DATA_KINDS)}, or "
                                                   f"{HF_PREFIX}NAME_OR_PATH")
        if self.path is not None and self.source not in DATA_PATH_OPTION:
            raise ConfigError("data_path", self.path, f"the {self.source} source takes no path")
        if self.source in DATA_PATH_OPTION and self.path is None and DATA_PATH_OPTION[self.source] not in self.args:
            raise ConfigError("data_path", None, f"the {self.source} source needs a path")
        _at_least("tokens_per_rank", self.tokens_per_rank, 1, "the token budget per rank")
        if self.max_doc_len is not None:
            # (a one-token piece has no next token within its document to predict: nothing would be trained)
            _at_least("max_doc_len", self.max_doc_len, 2, "a piece with a token to predict")
        _at_least("seed", self.seed, 0)


@dataclass(frozen=True)
class AttentionSection(Section):
    TITLE = "attention"
    strategy: str = _setting("attention", f"core attention strategy: {', '.join(STRATEGIES)}", default="cad")
    layout: str = _setting("layout", "which dp rank holds which documents of a step, before core attention is planned: "
                                     "linear (poured in order, as DistCA) or balanced (equal tokens too, whole "
                                     "documents placed to even out attention work first, so that cad moves less; "
                                     "wlb packs by its own memory_cap)", default="linear")
    cost_model: str = _setting("cost_model", "attention cost model: table (measured H200), pairs, or a cost-table JSON",
                               default="table")
    min_shard: int | None = _setting("min_shard", "smallest query shard a scheduler may cut (default: from the cost "
                                                  "model)", default=None)
    eps: float = _setting("eps", "cad balances until max/mean attention load <= 1 + eps", default=0.02)
    memory_cap: float = _setting("memory_cap", "wlb: tokens per rank may reach this multiple of tokens_per_rank",
                                 default=1.1)
    backend: str = _setting("attention_backend", "core attention kernel: auto (fa4 where flash_attn.cute imports on an "
                                                 "sm90+ GPU, else flash on CUDA; reference on CPU and for fp32), fa4, "
                                                 "flash or reference", default="auto")
    pingpong: bool = _setting("pingpong", "split each step's batch into two nano-batches of whole documents, each "
                                          "planned on its own, and overlap one's attention traffic with the other's "
                                          "compute", default=False)
    head_chunks: int = _setting("head_chunks", "run each layer's core attention in this many groups of heads, one "
                                               "group's kernel while another's Q/KV and outputs are on the wire: it "
                                               "hides exchanges where ping-pong has no second nano-batch (one long "
                                               "document, pipeline stages); must divide the KV heads a rank holds, or "
                                               "be a multiple of them that divides its query heads (groups of one KV "
                                               "head's queries, which its first group sends). "
                                               "4 for links between nodes (over an emulated one, pretrain 128K's "
                                               "steps 1.18x faster in two calls, 1.19x predicted at one rate); 1 "
                                               "inside an NVLink node (4 slowed steps there by up to 1.8 percent)",
                                default=1)
    exchange_gibps: float | str | None = _setting(
        "exchange_gibps", "GiB/s per GPU of the link core attention's exchanges take inside a node, or auto: "
                          "measured at the run's start (an all-to-all of every node's ranks, as bench/a2a_probe.py "
                          "measures it; a byte between nodes costs inter-node times more). cad then weighs each "
                          "move's bytes against the balance it buys and keeps the faster plan, balanced or not: on a "
                          "slow link it may move less than eps asks, or nothing. Default: balance whatever the bytes",
        metavar="GIBPS|auto", default=None)

    def check(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError("attention", self.strategy, f"unknown strategy; choose one of {', '.join(STRATEGIES)}")
        if self.layout not in LAYOUTS:
            raise ConfigError("layout", self.layout, f"unknown layout; choose one of {', '.join(LAYOUTS)}")
        if self.strategy == "wlb" and self.layout != "linear":
            raise ConfigError("layout", self.layout, "wlb lays documents out by its own packing (memory_cap); the "
                                                     "layout is for the other strategies")
        if self.min_shard is not None:
            _at_least("min_shard", self.min_shard, 1)
        if not 0.0 <= self.eps < 1.0:
            raise ConfigError("eps", self.eps, "must be in [0, 1)")
        if not (math.isfinite(self.memory_cap) and self.memory_cap >= 1.0):
            raise ConfigError("memory_cap", self.memory_cap, "must be a finite number >= 1.0")
        _at_least("head_chunks", self.head_chunks, 1)
        problem = link_rate_problem(self.exchange_gibps)
        if problem:
            raise ConfigError("exchange_gibps", self.exchange_gibps, problem)
        if self.exchange_gibps is not None and self.strategy != "cad":
            raise ConfigError("exchange_gibps", self.exchange_gibps, f"prices cad's moves; attention {self.strategy} "
                                                                     "plans no moves to price")
        if self.backend not in ATTENTION_BACKENDS:
            raise ConfigError("attention_backend", self.backend,
                              f"unknown attention backend; choose one of {', '.join(ATTENTION_BACKENDS)}")


@dataclass(frozen=True)
class SparseSection(Section):
    TITLE = "sparse attention"
    mode: str = _setting("sparse", "sparse core attention: none, or vertical-slash (a pattern per layer, step, "
                                   "document and head, estimated online)", default="none")
    coverage: float = _setting("sparse_coverage", "vertical-slash: keep columns and diagonals until they hold this "
                                                  "share of the attention mass, in (0, 1]", default=0.9)
    min_doc_len: int = _setting("sparse_min_doc_len", "vertical-slash: documents shorter than this stay dense",
                                default=8192)
    dense_layers: int = _setting("dense_layers", "vertical-slash: the first this many layers stay dense", default=0)
    args: dict = _setting("sparse_args", f"more vertical-slash options: {', '.join(SPARSE_SIZE_ARGS)}, kv_transfer "
                                         "(prefix or read), cost_coefficients (a GPU's sparse cost coefficients, "
                                         "a JSON file), price_from_kernels (true: the tiles' prices follow the "
                                         "kernels' measured seconds; default false)", default_factory=dict)

    def check(self) -> None:
        self.sparse_config()  # refuses bad sparse options

    def sparse_config(self) -> SparseConfig | None:
        """The SparseConfig of ``--sparse`` and its options, or None for dense attention."""
        if self.mode == "none":
            if self.args:  # (options of a sparse mode a dense run would ignore: a forgotten --sparse)
                raise ConfigError("sparse_args", self.args, "vertical-slash options, and sparse is none: give "
                                                            "--sparse vertical-slash, or leave them out")
            SparseConfig(mode="none", coverage=self.coverage, min_doc_len=self.min_doc_len,
                         dense_layers=self.dense_layers)  # still refuses bad values
            return None
        unknown = sorted(set(self.args) - set(SPARSE_ARGS))
        if unknown:
            raise ConfigError("sparse_args", unknown[0], f"unknown option; choose from {', '.join(SPARSE_ARGS)}")
        args = {k: (_parse_size(f"sparse_args.{k}", v) if isinstance(v, str) and k in SPARSE_SIZE_ARGS else v)
                for k, v in self.args.items()}
        try:
            return SparseConfig(mode=self.mode, coverage=self.coverage, min_doc_len=self.min_doc_len,
                                dense_layers=self.dense_layers, **args)
        except ConfigError as exc:  # name what the user typed: --sparse-args KEY
            key = exc.field.removeprefix("sparse_")
            if key in args:
                raise ConfigError(f"sparse_args.{key}", exc.value, exc.problem) from None
            raise


@dataclass(frozen=True)
class OptimSection(Section):
    TITLE = "optimisation"
    steps: int = _setting("steps", "optimizer steps of the whole run (the schedule's length)", default=100)
    lr: float = _setting("lr", "peak learning rate", default=3e-4)
    min_lr_ratio: float = _setting("min_lr_ratio", "the cosine decays to lr x this", default=0.1)
    warmup_steps: int = _setting("warmup_steps", "linear warmup steps", default=10)
    weight_decay: float = _setting("weight_decay", "AdamW weight decay (matrices only)", default=0.1)
    beta1: float = _setting("beta1", "AdamW beta1", default=0.9)
    beta2: float = _setting("beta2", "AdamW beta2", default=0.95)
    grad_clip: float = _setting("grad_clip", "clip the gradient norm to this (0: off)", default=1.0)

    def check(self) -> None:
        _at_least("steps", self.steps, 1)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("lr", self.lr, "must be a positive finite number")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _at_least("warmup_steps", self.warmup_steps, 0)
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError("weight_decay", self.weight_decay, "must be a finite number >= 0")
        for key, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(key, value, "must be in [0, 1)")
        if not self.grad_clip >= 0:
            raise ConfigError("grad_clip", self.grad_clip, "must be >= 0 (0 turns clipping off)")


@dataclass(frozen=True)
class ParallelSection(Section):
    TITLE = "parallelism"
    tp: int = _setting("tp", "tensor parallel degree: this many neighbouring ranks split every layer by heads and the "
                             "sequence between layers; ranks = dp x tp, and tokens_per_rank is per dp rank", default=1)
    pp: int = _setting("pp", "pipeline stages: the layers split over this many ranks (ranks = pp x dp x tp)", default=1)
    pp_schedule: str = _setting("pp_schedule", "pipeline schedule: 1f1b, gpipe, interleaved-1f1b (two stages per rank), "
                                               "pooled (GPipe in lock-step, core attention pooled over every stage's "
                                               "ranks: bubbles serve attention), or auto (pooled where the simulator "
                                               "predicts it at least 5 percent faster than 1f1b on the run's batches, else "
                                               "1f1b)", default="1f1b")
    microbatches: int = _setting("microbatches", "micro-batches of tokens_per_rank per dp rank in each step, gradients "
                                                 "accumulated over them (each planned on its own; one optimizer step)",
                                 default=1)
    ranks_per_node: int = _setting("ranks_per_node", "ranks (GPUs) of one node, where bytes between nodes cost cad's "
                                                     "planner more than bytes inside one (0: torchrun's "
                                                     "LOCAL_WORLD_SIZE, else every rank on one node)", default=0)
    hierarchical_exchange: bool = _setting("hierarchical_exchange", "KV that servers of one node need from a rank of "
                                                                    "another crosses between the nodes once, and one "
                                                                    "of them forwards it inside the node (not "
                                                                    "ulysses; needs ranks on several nodes; not "
                                                                    "measured faster yet)",
                                           default=False)
    inter_node_gibps: float | str | None = _setting(
        "inter_node_gibps", "GiB/s per GPU between nodes, or auto: measured at the run's start (an all-to-all between "
                            "the nodes, every local rank at once): cad's planner prices a byte between nodes at the "
                            "link inside a node (exchange_gibps, else NVLink's measured 260) over this (default: the "
                            "DistCA paper's 50 GB/s, 46.6 GiB/s)", metavar="GIBPS|auto", default=None)

    def check(self) -> None:
        _at_least("tp", self.tp, 1)
        _at_least("pp", self.pp, 1)
        _at_least("microbatches", self.microbatches, 1)
        _at_least("ranks_per_node", self.ranks_per_node, 0)
        problem = link_rate_problem(self.inter_node_gibps)
        if problem:
            raise ConfigError("inter_node_gibps", self.inter_node_gibps, problem)


@dataclass(frozen=True)
class MemorySection(Section):
    TITLE = "memory"
    activation_checkpointing: str = _setting("activation_checkpointing", "none, full (recompute each layer), "
                                                                         "keep_attention (recompute all but core "
                                                                         "attention) or auto (each layer's mode, the "
                                                                         "least recompute the memory model says fits; "
                                                                         "on a GPU also activation offload where it "
                                                                         "costs less)", default="none")
    activation_offload: bool = _setting("activation_offload", "keep the activations saved for backward in pinned host "
                                                              "memory, copied on a side stream while compute goes on "
                                                              "(on CPU runs the same function, nothing saved)",
                                        default=False)
    optimizer_offload: bool = _setting("optimizer_offload", "keep parameters, gradients and optimizer states in host "
                                                            "memory and step the optimizer there (FSDP2's "
                                                            "CPUOffloadPolicy)", default=False)
    auto_headroom: float = _setting("auto_headroom", "activation_checkpointing auto: the share of the device's (and "
                                                    "host's) memory its choice leaves free of the predicted peak",
                                    default=AUTO_HEADROOM)
    memory_check: bool = _setting("memory_check", "refuse, before anything is allocated, a configuration whose "
                                                  "predicted peak memory exceeds the device's (attnpool memory shows "
                                                  "the prediction)", default=True)

    def check(self) -> None:
        _one_of("activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
        if not 0.0 <= self.auto_headroom < 1.0:
            raise ConfigError("auto_headroom", self.auto_headroom, "must be in [0, 1)")


@dataclass(frozen=True)
class CheckpointSection(Section):
    TITLE = "checkpoints and resume"
    every: int = _setting("checkpoint_every", "save a checkpoint every this many steps (0: only at the end; -1: never)",
                          default=0)
    keep: int = _setting("keep_checkpoints", "keep only the newest this many checkpoints (0: all)", default=0)
    resume: bool = _setting("resume", "continue from the latest checkpoint in OUT/checkpoints", default=False)
    stop_at: int | None = _setting("stop_at", "stop (and checkpoint) after this step without changing the schedule",
                                   default=None)
    allow_unverified: bool = _setting("allow_unverified", "resume from a checkpoint without a manifest (written "
                                                          "before manifests, or its manifest lost): its files' sizes "
                                                          "are checked against DCP's metadata, their bytes cannot be",
                                      default=False)
    allow_config_change: bool = _setting("allow_config_change", "resume although a setting that changes what the run "
                                                                "computes (model, data, batch, schedule, optimizer, "
                                                                "precision) differs from the checkpoint's", default=False)
    hf_export: bool = _setting("hf_export", "hf: models: write the trained model to OUT/hf at the end of the run, as "
                                            "transformers reads it", default=True)
    hf_exports: bool = _setting("hf_export_checkpoints", "hf: models: also write a Hugging Face export of every "
                                                         "checkpoint, OUT/hf-exports/step-NNNNNN (the end's is OUT/hf), "
                                                         "as many as keep_checkpoints", default=False)

    def check(self) -> None:
        _at_least("checkpoint_every", self.every, -1)
        _at_least("keep_checkpoints", self.keep, 0)


@dataclass(frozen=True)
class FaultsSection(Section):
    TITLE = "failures"
    max_nonfinite_steps: int = _setting("max_nonfinite_steps", "a step whose loss or gradient norm is not finite is "
                                                               "skipped on every rank; this many in a row end the run",
                                        default=3)
    max_restarts: int = _setting("max_restarts", "when a worker is lost, start all workers again from the latest valid "
                                                 "checkpoint, up to this many times (the built-in launcher; under "
                                                 "torchrun give torchrun --max-restarts, and a restarted worker resumes "
                                                 "by itself)", default=0)
    collective_timeout_s: float = _setting("collective_timeout_s", "a collective that waits this long on a silent rank "
                                                                   "fails, and the survivors name that rank",
                                           default=600.0)

    def check(self) -> None:
        _at_least("max_nonfinite_steps", self.max_nonfinite_steps, 1)
        _at_least("max_restarts", self.max_restarts, 0)
        if not (math.isfinite(self.collective_timeout_s) and self.collective_timeout_s > 0):
            raise ConfigError("collective_timeout_s", self.collective_timeout_s, "must be a positive number of seconds")


@dataclass(frozen=True)
class RunSection(Section):
    TITLE = "run"
    out: str = _setting("out", "run directory: metrics.jsonl, checkpoints/, summary.png", default="runs/train")
    overwrite: bool = _setting("overwrite", "start a new run in an out that holds an earlier run's metrics but no "
                                            "checkpoint (they are replaced)", default=False)
    nproc: int = _setting("nproc", "processes to start on this machine (gloo on CPU, NCCL on GPUs, one per GPU; under "
                                   "torchrun leave at 1)", default=1)
    device: str = _setting("device", "auto, cpu or cuda", default="auto")
    progress: bool = _setting("progress", "show a live progress bar on rank 0 (the start line and the final summary "
                                          "always print)", default=True)
    logger: str = _setting("logger", f"also send every step's metrics to: {', '.join(LOGGERS)} (rank 0; wandb follows "
                                     "WANDB_MODE, WANDB_PROJECT)", default="none")
    deterministic: bool = _setting("deterministic", "the same run gives the same losses bit for bit (on the same GPUs, "
                                                   "software and parallel layout): torch's deterministic algorithms, "
                                                   "FlashAttention's deterministic backward, cuBLAS's fixed workspace; "
                                                   "slower",
                                   default=False)

    def check(self) -> None:
        if not self.out:
            raise ConfigError("out", self.out, "needs a run directory")
        _at_least("nproc", self.nproc, 1)
        _one_of("device", self.device, DEVICES)
        _one_of("logger", self.logger, LOGGERS)


SECTIONS = {"model": ModelSection, "data": DataSection, "attention": AttentionSection, "sparse": SparseSection,
            "optim": OptimSection, "parallel": ParallelSection, "memory": MemorySection,
            "checkpoint": CheckpointSection, "faults": FaultsSection, "run": RunSection}


def _at_least(name: str, value, low: int, what: str | None = None):
    if value < low:
        raise ConfigError(name, value, f"{what + ' ' if what else ''}must be at least {low}")


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"choose one of {', '.join(allowed)}")


# a link's rate measured at the run's start instead of given (exchange_gibps, inter_node_gibps)
MEASURED = "auto"


def link_rate_problem(gibps) -> str | None:
    """Why ``gibps`` is neither a link's rate (GiB/s per GPU) nor auto, or None (unset included)."""
    if gibps is None or gibps == MEASURED:
        return None
    if isinstance(gibps, str):
        return f"must be a positive number of GiB/s, or {MEASURED} (measured at the run's start)"
    return gibps_problem(gibps)


def field_kind(f) -> str:
    """'int', 'float', 'str', 'bool' or 'dict' from the field's annotation (a string here)."""
    return str(f.type).split("|")[0].strip()


def _parse_size(name: str, text: str) -> int:
    """'4096' -> 4096, '4K' -> 4096, '1M' -> 1048576."""
    try:
        return parse_size(text)
    except ValueError:
        raise ConfigError(name, text, "must be an integer (sizes like 4K allowed)") from None


def _coerce(f, value):
    """Check one value against its field's type; numbers given as strings ('3e-4', '4K') are read."""
    kind, key = field_kind(f), f.metadata["key"]
    optional = "None" in str(f.type)
    if optional and isinstance(value, str) and value.lower() in ("none", "null"):
        value = None
    if value is None:
        if optional:
            return None
        raise ConfigError(key, value, f"needs a value ({kind})")
    if kind == "dict":
        if not isinstance(value, dict):
            raise ConfigError(key, value, "must be a mapping of names to values")
        return dict(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(key, value, "must be true or false")
    if kind == "int":
        if isinstance(value, bool):
            raise ConfigError(key, value, "must be an integer")
        if isinstance(value, str):
            return _parse_size(key, value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise ConfigError(key, value, "must be an integer")
        return value
    if kind == "float":
        if isinstance(value, bool):
            raise ConfigError(key, value, "must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            # a number or a word (exchange_gibps: auto), which the section's check names
            if isinstance(value, str) and "str" in (part.strip() for part in str(f.type).split("|")):
                return value.strip().lower()
            raise ConfigError(key, value, "must be a number") from None
    if not isinstance(value, (str, Path)):
        raise ConfigError(key, value, "must be a string")
    return str(value)
