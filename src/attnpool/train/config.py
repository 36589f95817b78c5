"""Training configuration: one dataclass, read from one YAML file, every key overridable on the command line.

A YAML file holds a flat mapping of the fields below (``model_args`` and
``data_args`` are nested mappings passed on to the model preset and the data
source). ``attnpool train --config FILE --steps 50 --attention cad`` reads the
file, then applies the flags; an unknown key in the file is an error, as is an
unknown flag. Validation happens here, before any process is started, so a bad
value is refused on every rank alike.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from attnpool.sizes import parse_size
from attnpool.errors import ConfigError
from attnpool.plan import STRATEGIES
from attnpool.sparse import SparseConfig

PRECISIONS = ("auto", "bf16", "fp32")
CHECKPOINTING = ("none", "full", "keep_attention")
DEVICES = ("auto", "cpu", "cuda")
DATA_KINDS = ("stdlib", "synthetic", "text", "npy", "jsonl", "retrieval")
# ``model: hf:DIR`` is a Hugging Face model directory; ``data: hf:NAME_OR_PATH`` a dataset datasets.load_dataset reads.
HF_PREFIX = "hf:"
LOGGERS = ("none", "tensorboard", "wandb")
# "auto" and the names of attnpool.kernels.BACKENDS (this module must not import torch, so they are
# written out; a test keeps them equal).
ATTENTION_BACKENDS = ("auto", "fa4", "flash", "reference")
LOSS_KERNELS = ("auto", "liger", "chunked")  # attnpool.model.fused_loss.LOSS_KERNELS (a test keeps them equal)
# Keys read under another name: (old key -> key, what an unset old value means). ``kernel`` is the
# earlier name of attention_backend; run directories' config.yaml files still hold it.
ALIASES = {"kernel": ("attention_backend", "auto")}
# The source option that ``data_path`` fills, per source kind.
DATA_PATH_OPTION = {"text": "paths", "npy": "tokens_path", "jsonl": "path"}


def _help(text: str, **kw):
    return field(metadata={"help": text}, **kw)


@dataclass
class TrainConfig:
    # Model
    model: str = _help("model preset (tiny, llama3-8b, llama-34b, qwen2.5-3b), or hf:DIR, a Hugging Face model "
                       "directory (config.json, safetensors weights if any)", default="tiny")
    model_args: dict = _help("model fields to override, e.g. n_layers=2 dim=64", default_factory=dict)
    # Data
    data: str = _help(f"document source: {', '.join(DATA_KINDS)}, or hf:NAME_OR_PATH (datasets.load_dataset: "
                      "json/jsonl/parquet/text files, a saved dataset, a Hub name)", default="stdlib")
    data_path: str | None = _help("text: file, directory or glob; npy: tokens .npy; jsonl: .jsonl file", default=None)
    data_args: dict = _help("more source options, e.g. offsets_path=... tokenizer_path=... dist=prolong; hf: "
                            "text_field, split, subset, streaming, documents, add_special_tokens, cache_dir",
                            default_factory=dict)
    tokenizer: str | None = _help("Hugging Face tokenizer directory for hf: and jsonl data (default: the hf: model's "
                                  "directory)", default=None)
    tokens_per_rank: int = _help("tokens per data-parallel rank per micro-batch (the global batch is dp x this; "
                                 "dp = nproc / (pp x tp))", default=1024)
    max_doc_len: int | None = _help("cut longer documents into pieces of this many tokens", default=None)
    seed: int = _help("seed of the initial weights and of the document order", default=0)
    # Core attention
    attention: str = _help(f"core attention strategy: {', '.join(STRATEGIES)}", default="cad")
    cost_model: str = _help("attention cost model: table (measured H200), pairs, or a cost-table JSON", default="table")
    min_shard: int | None = _help("smallest query shard a scheduler may cut (default: from the cost model)", default=None)
    eps: float = _help("cad balances until max/mean attention load <= 1 + eps", default=0.02)
    memory_cap: float = _help("wlb: tokens per rank may reach this multiple of tokens_per_rank", default=1.1)
    attention_backend: str = _help("core attention kernel: auto (fa4 where flash_attn.cute imports on an sm90+ GPU, "
                                   "else flash on CUDA; reference on CPU and for fp32), fa4, flash or reference",
                                   default="auto")
    sparse: str = _help("sparse core attention: none, or vertical-slash (a pattern per layer, step, document and head, "
                        "estimated online)", default="none")
    sparse_coverage: float = _help("vertical-slash: keep columns and diagonals until they hold this share of the "
                                   "attention mass, in (0, 1]", default=0.9)
    sparse_min_doc_len: int = _help("vertical-slash: documents shorter than this stay dense", default=8192)
    dense_layers: int = _help("vertical-slash: the first this many layers stay dense", default=0)
    sparse_args: dict = _help("more vertical-slash options: vertical_cap, slash_cap, last_queries, sink_tokens, "
                              "local_window, block, vertical_chunk, kv_transfer (prefix or read)",
                              default_factory=dict)
    # Optimisation
    steps: int = _help("optimizer steps of the whole run (the schedule's length)", default=100)
    lr: float = _help("peak learning rate", default=3e-4)
    min_lr_ratio: float = _help("the cosine decays to lr x this", default=0.1)
    warmup_steps: int = _help("linear warmup steps", default=10)
    weight_decay: float = _help("AdamW weight decay (matrices only)", default=0.1)
    beta1: float = _help("AdamW beta1", default=0.9)
    beta2: float = _help("AdamW beta2", default=0.95)
    grad_clip: float = _help("clip the gradient norm to this (0: off)", default=1.0)
    precision: str = _help("auto (bf16 autocast on CUDA, fp32 on CPU), bf16 or fp32", default="auto")
    pingpong: bool = _help("split each step's batch into two nano-batches of whole documents, each planned on its own, "
                           "and overlap one's attention traffic with the other's compute", default=False)
    activation_checkpointing: str = _help("none, full (recompute each layer) or keep_attention (recompute all but core attention)",
                                          default="none")
    activation_offload: bool = _help("keep the activations saved for backward in pinned host memory, copied on a side "
                                     "stream while compute goes on (on CPU runs the same function, nothing saved)",
                                     default=False)
    compile: bool = _help("torch.compile every layer's linear parts (norms, projections, RoPE, SwiGLU), fusing the "
                          "elementwise work between the matmuls; core attention stays eager. The first steps compile",
                          default=False)
    loss_kernel: str = _help("the LM head's loss (projection and cross-entropy): auto (liger where liger_kernel "
                             "imports on a CUDA run with tp=1, else chunked), liger (Liger-Kernel's fused linear "
                             "cross-entropy: gradients made in the forward, no logits recomputed) or chunked "
                             "(float32 logits in chunks, recomputed in backward)", default="auto")
    optimizer_offload: bool = _help("keep parameters, gradients and optimizer states in host memory and step the "
                                    "optimizer there (FSDP2's CPUOffloadPolicy)", default=False)
    memory_check: bool = _help("refuse, before anything is allocated, a configuration whose predicted peak memory "
                               "exceeds the device's (attnpool memory shows the prediction)", default=True)
    # Parallelism
    microbatches: int = _help("micro-batches of tokens_per_rank per dp rank in each step, gradients accumulated "
                              "over them (each planned on its own; one optimizer step)", default=1)
    pp: int = _help("pipeline stages: the layers split over this many ranks (ranks = pp x dp x tp)", default=1)
    pp_schedule: str = _help("pipeline schedule: 1f1b, gpipe, interleaved-1f1b (two stages per rank), or pooled "
                             "(GPipe in lock-step, core attention pooled over every stage's ranks: bubbles serve "
                             "attention)",
                             default="1f1b")
    tp: int = _help("tensor parallel degree: this many neighbouring ranks split every layer by heads and the "
                    "sequence between layers; ranks = dp x tp, and tokens_per_rank is per dp rank", default=1)
    # Run
    nproc: int = _help("processes to start on this machine (gloo on CPU, NCCL on GPUs, one per GPU; under torchrun leave at 1)", default=1)
    device: str = _help("auto, cpu or cuda", default="auto")
    out: str = _help("run directory: metrics.jsonl, checkpoints/, summary.png", default="runs/train")
    checkpoint_every: int = _help("save a checkpoint every this many steps (0: only at the end; -1: never)", default=0)
    hf_export_checkpoints: bool = _help("hf: models: also write a Hugging Face export of every checkpoint, "
                                        "OUT/hf-exports/step-NNNNNN (the end's is OUT/hf), as many as keep_checkpoints",
                                        default=False)
    resume: bool = _help("continue from the latest checkpoint in OUT/checkpoints", default=False)
    stop_at: int | None = _help("stop (and checkpoint) after this step without changing the schedule", default=None)
    progress: bool = _help("show a live progress bar on rank 0 (the start line and the final summary always print)", default=True)
    logger: str = _help(f"also send every step's metrics to: {', '.join(LOGGERS)} (rank 0; wandb follows WANDB_MODE, "
                        "WANDB_PROJECT)", default="none")
    # Failures
    keep_checkpoints: int = _help("keep only the newest this many checkpoints (0: all)", default=0)
    allow_config_change: bool = _help("resume although a setting that changes what the run computes (model, "
                                      "data, batch, schedule, optimizer, precision) differs from the checkpoint's",
                                      default=False)
    max_nonfinite_steps: int = _help("a step whose loss or gradient norm is not finite is skipped on every rank; "
                                     "this many in a row end the run", default=3)
    max_restarts: int = _help("when a worker is lost, start all workers again from the latest valid checkpoint, up "
                              "to this many times (the built-in launcher; under torchrun give torchrun "
                              "--max-restarts, and a restarted worker resumes by itself)", default=0)
    collective_timeout_s: float = _help("a collective that waits this long on a silent rank fails, and the survivors "
                                        "name that rank", default=600.0)

    def __post_init__(self):
        for f in fields(self):
            setattr(self, f.name, _coerce(f, getattr(self, f.name)))
        if self.data.startswith(HF_PREFIX):
            if self.data == HF_PREFIX:
                raise ConfigError("data", self.data, "name a dataset or a path after hf:")
        elif self.data not in DATA_KINDS:
            raise ConfigError("data", self.data, f"unknown source; choose one of {', '.join(DATA_KINDS)}, or "
                                                 f"{HF_PREFIX}NAME_OR_PATH")
        if self.data_path is not None and self.data not in DATA_PATH_OPTION:
            raise ConfigError("data_path", self.data_path, f"the {self.data} source takes no path")
        if self.data in DATA_PATH_OPTION and self.data_path is None and DATA_PATH_OPTION[self.data] not in self.data_args:
            raise ConfigError("data_path", None, f"the {self.data} source needs a path")
        _at_least("tokens_per_rank", self.tokens_per_rank, 1, "the token budget per rank")
        if self.max_doc_len is not None:
            _at_least("max_doc_len", self.max_doc_len, 1)
        _at_least("seed", self.seed, 0)
        if self.attention not in STRATEGIES:
            raise ConfigError("attention", self.attention, f"unknown strategy; choose one of {', '.join(STRATEGIES)}")
        if self.min_shard is not None:
            _at_least("min_shard", self.min_shard, 1)
        if not 0.0 <= self.eps < 1.0:
            raise ConfigError("eps", self.eps, "must be in [0, 1)")
        if not self.memory_cap >= 1.0:
            raise ConfigError("memory_cap", self.memory_cap, "must be >= 1.0")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError("attention_backend", self.attention_backend,
                              f"unknown attention backend; choose one of {', '.join(ATTENTION_BACKENDS)}")
        self.sparse_config()  # refuses bad sparse options
        _at_least("steps", self.steps, 1)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("lr", self.lr, "must be a positive finite number")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _at_least("warmup_steps", self.warmup_steps, 0)
        if not self.weight_decay >= 0:
            raise ConfigError("weight_decay", self.weight_decay, "must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, getattr(self, name), "must be in [0, 1)")
        if not self.grad_clip >= 0:
            raise ConfigError("grad_clip", self.grad_clip, "must be >= 0 (0 turns clipping off)")
        for name, allowed in (("precision", PRECISIONS), ("activation_checkpointing", CHECKPOINTING), ("device", DEVICES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(name, getattr(self, name), f"choose one of {', '.join(allowed)}")
        _at_least("tp", self.tp, 1)
        _at_least("pp", self.pp, 1)
        _at_least("microbatches", self.microbatches, 1)
        _at_least("nproc", self.nproc, 1)
        if self.model.startswith(HF_PREFIX):
            self._check_hf_model()
        if self.compile and self.tp > 1:
            # Measured on CPU (torch 2.13, gloo): tp=2 with the DTensor projections inside the compiled graphs
            # trains 5e-3 away from one process after three steps (forward equal, gradients not).
            raise ConfigError("compile", True, f"not with tensor parallelism (tp={self.tp}): the compiled "
                                               "backward of the tensor-parallel projections is not exact; use tp=1")
        if self.loss_kernel not in LOSS_KERNELS:
            raise ConfigError("loss_kernel", self.loss_kernel, f"choose one of {', '.join(LOSS_KERNELS)}")
        if self.loss_kernel == "liger" and (self.tp > 1 or self.device == "cpu"):
            raise ConfigError("loss_kernel", "liger", f"not with tp={self.tp}: the head's weight is split by "
                                                      "vocabulary; use chunked" if self.tp > 1 else
                                                      "Liger-Kernel runs on CUDA GPUs, and device is cpu")
        if self.hf_export_checkpoints and not self.model.startswith(HF_PREFIX):
            raise ConfigError("hf_export_checkpoints", True, f"exports {HF_PREFIX}DIR models; for attnpool's own, "
                                                             "`attnpool export --checkpoint PATH` writes any checkpoint")
        if self.logger not in LOGGERS:
            raise ConfigError("logger", self.logger, f"choose one of {', '.join(LOGGERS)}")
        if not self.out:
            raise ConfigError("out", self.out, "needs a run directory")
        _at_least("checkpoint_every", self.checkpoint_every, -1)
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ConfigError("stop_at", self.stop_at, f"must be in [1, steps={self.steps}]")
        _at_least("keep_checkpoints", self.keep_checkpoints, 0)
        _at_least("max_nonfinite_steps", self.max_nonfinite_steps, 1)
        _at_least("max_restarts", self.max_restarts, 0)
        if not (math.isfinite(self.collective_timeout_s) and self.collective_timeout_s > 0):
            raise ConfigError("collective_timeout_s", self.collective_timeout_s, "must be a positive number of seconds")

    def _check_hf_model(self) -> None:
        """What a Hugging Face model (transformers' modules, core attention from outside) cannot run with."""
        if self.model == HF_PREFIX:
            raise ConfigError("model", self.model, "name a model directory after hf:")
        if self.model_args:
            raise ConfigError("model_args", self.model_args, "an hf: model takes its settings from its config.json")
        unsupported = (("tp", self.tp != 1, "tensor parallelism splits attnpool's own layers only"),
                       ("pp", self.pp != 1, "pipeline stages split attnpool's own layers only"),
                       ("pingpong", self.pingpong, "ping-pong interleaves attnpool's own layers only"),
                       ("activation_checkpointing", self.activation_checkpointing == "keep_attention",
                        "keep_attention recomputes attnpool's own linear parts only; use full"),
                       ("compile", self.compile, "it compiles attnpool's own layers' linear parts only"))
        for name, refused, why in unsupported:
            if refused:
                raise ConfigError(name, getattr(self, name), f"not available with an hf: model: {why}")

    def sparse_config(self) -> SparseConfig | None:
        """The SparseConfig of ``--sparse`` and its options, or None for dense attention."""
        if self.sparse == "none":
            SparseConfig(mode="none", coverage=self.sparse_coverage, min_doc_len=self.sparse_min_doc_len,
                         dense_layers=self.dense_layers)  # still refuses bad values
            return None
        sizes = ("vertical_cap", "slash_cap", "last_queries", "sink_tokens", "local_window", "block", "vertical_chunk")
        allowed = sizes + ("kv_transfer", "cost_coefficients")
        unknown = sorted(set(self.sparse_args) - set(allowed))
        if unknown:
            raise ConfigError("sparse_args", unknown[0], f"unknown option; choose from {', '.join(allowed)}")
        args = {k: (_parse_size(f"sparse_args.{k}", v) if isinstance(v, str) and k in sizes else v)
                for k, v in self.sparse_args.items()}
        return SparseConfig(mode=self.sparse, coverage=self.sparse_coverage, min_doc_len=self.sparse_min_doc_len,
                            dense_layers=self.dense_layers, **args)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in fields(TrainConfig)}
# What the run computes: a resume that changes one of these asks for allow_config_change. The rest may
# change freely: attention strategy, kernels and memory settings compute the same function, and a
# resume on another layout (nproc, tp, pp) is what DCP's resharding is for (another dp changes the
# global batch from there on, as any resume on more or fewer data-parallel ranks does).
RUN_FIELDS = ("model", "model_args", "data", "data_path", "data_args", "tokenizer", "tokens_per_rank", "max_doc_len",
              "seed", "sparse", "sparse_coverage", "sparse_min_doc_len", "dense_layers", "sparse_args", "steps", "lr",
              "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "precision",
              "microbatches")


def _at_least(name: str, value, low: int, what: str | None = None):
    if value < low:
        raise ConfigError(name, value, f"{what + ' ' if what else ''}must be at least {low}")


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
    kind = field_kind(f)
    optional = "None" in str(f.type)
    if optional and isinstance(value, str) and value.lower() in ("none", "null"):
        value = None
    if value is None:
        if optional:
            return None
        raise ConfigError(f.name, value, f"needs a value ({kind})")
    if kind == "dict":
        if not isinstance(value, dict):
            raise ConfigError(f.name, value, "must be a mapping of names to values")
        return dict(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f.name, value, "must be true or false")
    if kind == "int":
        if isinstance(value, bool):
            raise ConfigError(f.name, value, "must be an integer")
        if isinstance(value, str):
            return _parse_size(f.name, value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise ConfigError(f.name, value, "must be an integer")
        return value
    if kind == "float":
        if isinstance(value, bool):
            raise ConfigError(f.name, value, "must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f.name, value, "must be a number") from None
    if not isinstance(value, (str, Path)):
        raise ConfigError(f.name, value, "must be a string")
    return str(value)


def read_yaml(path: str | os.PathLike) -> dict:
    """The mapping in a YAML config file (refused with ConfigError if missing or malformed)."""
    path = str(path)
    if not os.path.isfile(path):
        raise ConfigError("config", path, "no such file")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise ConfigError("config", path, f"not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", path, f"must hold a mapping of keys to values, not a {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike | None = None, overrides: dict | None = None) -> TrainConfig:
    """The config in ``path`` (defaults if None) with ``overrides`` applied on top.

    Dict-valued keys (``model_args``, ``data_args``) are merged key by key, so
    ``--model-args n_layers=2`` keeps the file's other model arguments.
    """
    where = f"in {path}" if path is not None else ""
    values = _renamed_aliases(read_yaml(path) if path is not None else {}, where)
    overrides = _renamed_aliases(overrides or {}, "")
    for source, mapping in ((where, values), ("", overrides)):
        unknown = sorted(set(mapping) - set(FIELDS))
        if unknown:
            raise ConfigError("config", unknown[0], f"unknown key{' ' + source if source else ''}; known keys: "
                              f"{', '.join(FIELDS)}")
    merged = dict(values)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return TrainConfig(**merged)


def _renamed_aliases(mapping: dict, where: str) -> dict:
    """``mapping`` with every alias key (ALIASES) under its current name; refused where both are given."""
    out = dict(mapping)
    for alias, (key, unset) in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        value = unset if value is None or (isinstance(value, str) and value.lower() in ("none", "null")) else value
        if key in out and out[key] != value:
            given = f"given {where}" if where else "given"
            raise ConfigError(alias, value, f"is the old name of {key}, which is also {given} ({key}={out[key]!r}); "
                                            f"give {key} only")
        out[key] = value
    return out


def save_config(config: TrainConfig, path: str | os.PathLike) -> None:
    with open(path, "w") as fh:
        yaml.safe_dump(config.to_dict(), fh, sort_keys=False)
