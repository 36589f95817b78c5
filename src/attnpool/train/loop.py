"""The training loop: FSDP2 data parallelism, with core attention planned once per step.

One step, on every rank::

    batch = stream.next_batch()               # the same global batch on every rank (same seed)
    layout, plan = plan_batch(batch, ...)     # who holds which tokens; who computes which attention shard
    loss = model(tokens, positions, core_attention(plan))  -> backward -> clip -> AdamW -> lr schedule

The model never sees the strategy: its attention is ``core_attention`` bound to
this step's plan, reused by every layer. Every rank plans the same batch the
same way, so the plans agree (core_attention checks their fingerprints).

The loss is the mean over every real token of the global batch, however the
tokens are spread: each rank divides its summed token loss by the global
label-token count, and FSDP is told to sum gradients over ranks instead of
averaging them.

Launching (:func:`run`): under torchrun, one process per GPU; otherwise ``nproc``
processes started here (gloo on CPU, NCCL on CUDA). Bad input is refused before
any process starts; what can only be checked on a rank is checked on every rank
and agreed on (:func:`agree`) before the first collective that depends on it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from attnpool.comm import all_gather_flat, comm_stats, end_process, process_group
from attnpool.comm.watchdog import RANKS_DIR, RankRecords, is_collective_failure
from attnpool.data import DocumentStream, GlobalBatch, RankTensors, make_source
from attnpool.errors import ConfigError, TrainingError
from attnpool.kernels import serves_positions
from attnpool.kernels.sparse import device_problem as sparse_device_problem
from attnpool.kernels.sparse import launch_problem as sparse_launch_problem
from attnpool.model import ModelConfig, Transformer, apply_activation_checkpointing, model_config
from attnpool.model.compile import compile_linear_parts
from attnpool.model.fused_loss import resolve_loss_kernel, use_loss_kernel
from attnpool.model.hf_causal_lm import (HFCausalLM, HFModelSpec, build_hf_model, export_dtype, hf_model_dir,
                                         hf_state_shapes, load_hf_spec, save_hf_export)
from attnpool.parallel import ParallelDims, RankMesh, apply_tensor_parallel, build_rank_mesh, tensor_parallel_problem
from attnpool.parallel.pipeline import (PipelineRunner, PipelineStageModel, activations_in_flight, build_stage_models,
                                        merged_stages, pipeline_problem, rank_layers)
from attnpool.parallel.pooled_pipeline import POOLED, PooledPipelineRunner, pooled_problem, pooled_table, ticks
from attnpool.plan import (AttentionShape, PieceTable, linear_table, load_cost_model, pad_ranks, plan_attention,
                           wlb_table)
from attnpool.plan.metrics import AttentionRows, home_loads, imbalance, server_loads
from attnpool.plan.plan import Plan
from attnpool.runtime import CoreAttention
from attnpool.runtime.sparse import SparseStats
from attnpool.sparse import SparseConfig
from attnpool.sparse.cost import SparsePrior
from attnpool.train.checkpoint import (check_compatible, checkpoint_config, checkpoint_path, checkpoint_root,
                                       finished_checkpoints, load_checkpoint, save_checkpoint, select_checkpoint)
from attnpool.train.config import DATA_PATH_OPTION, HF_PREFIX, RUN_FIELDS, TrainConfig, load_config, save_config
from attnpool.train.memory import (Calibration, Capacity, MemoryEstimate, MemoryInputs, RowRatios, estimate,
                                   format_bytes, report, saved_bytes_per_layer, settings, undominated)
from attnpool.train.offload import ActivationOffload
from attnpool.train.metrics import (PLOT_FILE, SUMMARY_FILE, AttentionTimer, MetricsLog, Progress, logger_problem,
                                    open_logger, peak_memory_bytes, peak_reserved_bytes,
                                    plot_run, print_summary, reset_peak_memory, summarize)

# Models above this many weights are built on the meta device and initialised
# shard by shard; smaller ones are built whole first, so their initial weights do
# not depend on the number of ranks.
META_INIT_PARAMS = 1_000_000_000
# Batches whose plans bound core attention's buffers in the memory check (the run's first ones).
MEMORY_SAMPLE_BATCHES = 8
# Under the run directory: an hf: model's weights at the end of the run, as transformers reads them.
HF_EXPORT_DIR = "hf"  # the end's export
HF_CHECKPOINT_EXPORTS_DIR = "hf-exports"  # one per checkpoint (hf_export_checkpoints), named as the checkpoint


# --- What a run is built from (checked before any process group exists) ---------------------


@dataclass
class Setup:
    model_config: ModelConfig
    source: object  # a DocumentSource
    cost_model: object
    resume_from: str | None  # checkpoint directory, when resuming
    sparse: SparseConfig | None  # with its cost coefficients read here, on every rank alike
    memory: MemoryEstimate | None = None  # the predicted peak, where a rank's device was checked
    # The kernel backend core attention runs (attnpool.kernels); "auto" only in a launcher, which leaves
    # the choice to the ranks' devices.
    attention_backend: str = "auto"
    hf: HFModelSpec | None = None  # an hf: model (model_config is then its shape as the planner sees it)


def tokenizer_path(config: TrainConfig) -> str | None:
    """The tokenizer of hf: and jsonl data: ``tokenizer``, else an hf: model's own directory."""
    return config.tokenizer or hf_model_dir(config.model)


def _main_process() -> bool:
    """The launcher, or rank 0 (of torchrun's or of the built-in launcher's ranks)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


def build_source(config: TrainConfig, vocab_size: int):
    options = dict(config.data_args)
    kind = config.data
    if config.data_path is not None:
        options[DATA_PATH_OPTION[config.data]] = config.data_path
    tokenizer = tokenizer_path(config)
    if config.data.startswith(HF_PREFIX):
        kind, options["name"] = "hf", config.data[len(HF_PREFIX):]
        if tokenizer is None:
            raise ConfigError("tokenizer", None, f"--data {config.data} needs a tokenizer: set tokenizer: DIR (an hf: "
                                                 "model's directory is the default)")
        options["tokenizer"] = tokenizer
        options.setdefault("progress", config.progress and _main_process())
        options["model_vocab_size"] = vocab_size  # a tokenizer too large is refused before the data is read
    if config.data == "jsonl" and tokenizer is not None:
        options.setdefault("tokenizer_path", tokenizer)
    if config.data == "synthetic":
        options.setdefault("dist", "pretrain")
        options.setdefault("vocab_size", vocab_size)
        options.setdefault("seed", config.seed)
    if config.data == "npy":
        options.setdefault("vocab_size", vocab_size)  # token ids are then checked against the model
    try:
        source = make_source(kind, **options)
    except ConfigError as exc:  # name what the user typed: --data-path, or --data-args KEY
        path_option = DATA_PATH_OPTION.get(config.data)
        if exc.field == path_option and config.data_path is not None:
            raise ConfigError("data_path", exc.value, exc.problem) from None
        if exc.field in config.data_args:
            raise ConfigError(f"data_args.{exc.field}", exc.value, exc.problem) from None
        raise
    if source.vocab_size is not None and source.vocab_size > vocab_size:
        raise ConfigError("data", config.data, f"has {source.vocab_size} token ids but the model's vocab_size is "
                                               f"{vocab_size}; raise it with --model-args vocab_size=N")
    return source


def prepare(config: TrainConfig, device: torch.device | None = None, world: int | None = None) -> Setup:
    """Build and check everything that needs no process group: model config, data source, cost model, checkpoint,
    and (with ``config.memory_check``) that the predicted peak memory fits the device.

    ``device``: the rank's device, whose kind the sparse kernels must support and whose memory must hold
    the run; None in a launcher, which must not touch its GPUs (asking one initialises CUDA and would hold
    a context on it for the whole run). ``world``: the number of ranks (checked against ``tp``), where known."""
    hf_dir = hf_model_dir(config.model)
    hf = load_hf_spec(hf_dir, config.max_doc_len) if hf_dir is not None else None
    model_cfg = hf.model_config if hf is not None else model_config(config.model, **config.model_args)
    problem = logger_problem(config.logger)
    if problem is not None:
        raise ConfigError("logger", config.logger, problem)
    problem = tensor_parallel_problem(model_cfg, config.tp)
    if problem is not None:
        raise ConfigError("tp", config.tp, problem)
    problem = pipeline_problem(model_cfg, config.pp, config.pp_schedule, config.microbatches)
    if problem is not None:
        raise ConfigError(*problem)
    if config.pp > 1 and config.attention == "wlb":
        raise ConfigError("attention", "wlb", "pipeline stages exchange hidden states of one shape, and wlb gives ranks "
                                              "different numbers of tokens; use local, percp or cad with pp > 1")
    if config.pp > 1 and config.pp_schedule == POOLED:
        problem = pooled_problem(model_cfg.n_layers, config.pp, config.activation_checkpointing,
                                 config.sparse != "none")
        if problem is not None:
            raise ConfigError(*problem)
    if config.pp > 1 and config.pingpong:
        raise ConfigError("pingpong", True, "ping-pong's nano-batches differ in size, and pipeline stages exchange "
                                            "hidden states of one shape; the pipeline's micro-batches overlap instead")
    dims = ParallelDims.of(world, config.tp, config.pp) if world is not None else None
    source = build_source(config, model_cfg.vocab_size)
    backend = attention_backend(config, device)
    if device is not None:  # (a launcher or `attnpool memory` leaves liger's import to the ranks)
        resolve_loss_kernel(config.loss_kernel, device.type, config.tp)
    cost_model = load_cost_model(config.cost_model, backend=backend)
    if config.tp > 1 and hasattr(cost_model, "scaled_to"):  # a server's cost is its heads' share of a task's
        cost_model = cost_model.scaled_to(model_cfg.n_heads // config.tp, model_cfg.head_dim)
    sparse = check_sparse(config, model_cfg, device)
    found = None
    if config.resume:
        # Sizes and manifests here (no process group yet); train() checks every file's hash before loading.
        found, skipped = select_checkpoint(config.out, checksum=False, distributed=False)
        if found is None:
            refuse_damaged(config.out, skipped)
            raise ConfigError("resume", config.out, f"no finished checkpoint in {checkpoint_root(config.out)}")
        check_compatible(found, model_cfg, hf_state_shapes(hf) if hf is not None else None)
        config_changes(config, found)
    elif finished_checkpoints(config.out):
        raise ConfigError("out", config.out, "holds checkpoints of an earlier run: pass --resume to continue it, "
                                             "or choose another --out")
    memory = None
    if device is not None and dims is not None and config.memory_check:
        memory = check_memory(config, model_cfg, source, cost_model, sparse, dims, device, backend)
    return Setup(model_cfg, source, cost_model, found if config.resume else None, sparse, memory, backend, hf)


def attention_backend(config: TrainConfig, device: torch.device | None = None) -> str:
    """The kernel backend (attnpool.kernels) of this run's core attention, refused with a ConfigError naming
    attention_backend where it cannot run: fa4 without flash_attn.cute or on a GPU older than sm90, fa4 or
    flash on the CPU or in float32. ``device``: the rank's; None in a launcher, which must not touch its GPUs
    and only refuses what the device kind and precision decide ("auto" then stays "auto")."""
    from attnpool.kernels import resolve_backend_name

    name = config.attention_backend
    # Without a device (a launcher, or `attnpool memory` planning GPUs from a machine without one) the
    # configured kind decides; only "auto" asks this machine.
    device_type = device.type if device is not None else config.device if config.device != "auto" \
        else resolve_device(config)
    bf16 = uses_bf16(config, device_type)
    if name in ("fa4", "flash") and device_type == "cuda" and not bf16:
        raise ConfigError("attention_backend", name, f"the {name} kernels take bf16, and this run computes in float32 "
                                                     f"(precision={config.precision}); use reference, or bf16")
    if device is None and device_type == "cuda":
        return name
    # Attention inputs are bf16 on CUDA (autocast) unless precision is fp32; float32 on the CPU.
    dtype = torch.bfloat16 if bf16 and device_type == "cuda" else torch.float32
    return resolve_backend_name(name, device if device is not None else torch.device(device_type), dtype,
                                field="attention_backend")


def same_attention_backend(backend: str, requested: str) -> None:
    """Refuse, on every rank, a run whose ranks resolved attention_backend to different kernels ("auto" on
    GPUs where fa4 runs on some only): their cost tables, and so their plans, would differ."""
    backends = [None] * dist.get_world_size()
    dist.all_gather_object(backends, backend)
    if len(set(backends)) > 1:
        found = ", ".join(f"rank {r}: {b}" for r, b in enumerate(backends))
        raise ConfigError("attention_backend", requested, f"the ranks run different kernels ({found}); name one "
                                                          "that runs on every rank")


def refuse_damaged(out: str, skipped: list[tuple[str, str]]) -> None:
    """Refuse a resume whose every checkpoint is damaged, naming the newest one's problem."""
    if skipped:
        more = f" (and {len(skipped) - 1} older checkpoints are damaged too)" if len(skipped) > 1 else ""
        raise ConfigError("resume", out, f"no valid checkpoint: {skipped[0][1]}{more}")


def config_changes(config: TrainConfig, checkpoint: str) -> list[tuple[str, object, object]]:
    """(key, the checkpoint's value, this config's) of every setting that changes what the run computes
    (config.RUN_FIELDS); refused unless ``allow_config_change``."""
    saved = checkpoint_config(checkpoint, config.out)
    if saved is None:
        return []
    now = config.to_dict()
    changes = [(k, saved[k], now[k]) for k in RUN_FIELDS if k in saved and saved[k] != now[k]]
    if changes and not config.allow_config_change:
        key, before, after = changes[0]
        also = f" (also {', '.join(k for k, _, _ in changes[1:])})" if len(changes) > 1 else ""
        raise ConfigError(key, after, f"the checkpoint's run has {key}={before!r}{also}: resuming with another value "
                                      "changes the run; pass --allow-config-change to continue with it")
    return changes


def check_sparse(config: TrainConfig, model_cfg: ModelConfig,
                 device: torch.device | None = None) -> SparseConfig | None:
    """The sparse options (None for dense attention), refused where this model or device cannot run them
    (the CPU twin runs anything); the GPU's kind only when ``device`` is given (see prepare)."""
    sparse = config.sparse_config()
    if sparse is None:
        return None
    if sparse.dense_layers >= model_cfg.n_layers:
        raise ConfigError("dense_layers", sparse.dense_layers, f"the model has {model_cfg.n_layers} layers, so none "
                                                               "would be sparse; use --sparse none for dense attention")
    if resolve_device(config) == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise ConfigError("sparse", config.sparse, "the sparse kernels need Triton on CUDA, and it is not installed")
        problem = sparse_device_problem(device) if device is not None and device.type == "cuda" else None
        if problem is not None:
            raise ConfigError("sparse", config.sparse, str(problem))
        # Attention runs in bf16 on CUDA unless --precision fp32 (see train).
        problem = sparse_launch_problem(model_cfg.head_dim, 4 if config.precision == "fp32" else 2, sparse.block,
                                        sparse.vertical_chunk)
        if problem is not None:
            raise ConfigError("sparse", config.sparse, str(problem))
    return sparse


def resolve_device(config: TrainConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda", "no CUDA device is available")
    return config.device


def agree(build):
    """``build()`` on every rank; if it raises ConfigError on any rank, the same error is raised on every rank."""
    try:
        result, problem = build(), None
    except ConfigError as exc:
        result, problem = None, _portable(exc)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        r, (field, value, text) = failed[0]
        if len(failed) < len(problems):
            text = f"{text} (on rank {r}; {len(failed)} of {len(problems)} ranks failed)"
        raise ConfigError(field, value, text)
    return result


def _portable(exc: ConfigError) -> tuple:
    """(field, value, problem), with the value replaced by its repr if it does not pickle."""
    value = exc.value
    try:
        pickle.dumps(value)
    except Exception:
        value = repr(value)
    return exc.field, value, exc.problem


# --- Memory ------------------------------------------------------------------------------------


def attention_shape(model_cfg: ModelConfig, tp: int, bf16: bool) -> AttentionShape:
    """What a token's Q, K+V and O weigh in one tp rank's core attention (its share of the heads)."""
    return AttentionShape(model_cfg.n_heads // tp, model_cfg.n_kv_heads // tp, model_cfg.head_dim, 2 if bf16 else 4)


def uses_bf16(config: TrainConfig, device_type: str) -> bool:
    """bf16 compute (FSDP2 mixed precision, autocast): asked for, or by default on CUDA."""
    return config.precision == "bf16" or (config.precision == "auto" and device_type == "cuda")


def sample_row_ratios(config: TrainConfig, source, cost_model, dims: ParallelDims, model_cfg: ModelConfig,
                      sparse: SparseConfig | None, bf16: bool,
                      batches: int = MEMORY_SAMPLE_BATCHES, copies: bool = True) -> dict:
    """Core attention's rows per token of tokens_per_rank, from the plans of the run's first ``batches``
    batches (with ping-pong, both nano-batches' rows; with a pooled pipeline, every tick's plan over all
    stages' ranks, of the first ``batches`` steps), as MemoryInputs fields: ``rows``, the largest of each
    count over the plans and dp ranks, and each plan's rank rows that no other matches in every count
    (memory.undominated): ``row_candidates``, or for a pooled pipeline, whose rank holds every tick's
    rows at once, ``held_candidates``: each step's rank rows summed over its ticks. ``copies``: whether the
    kernel copies prefixes (prefix_copies); counted anyway where a layer is sparse (the sparse serving does)."""
    pooled = dims.pp > 1 and config.pp_schedule == POOLED
    if dims.dp == 1 and not pooled:
        return {"rows": RowRatios()}
    world = dims.dp
    stream = DocumentStream(source, world, config.tokens_per_rank, config.seed, config.max_doc_len)
    shape = attention_shape(model_cfg, dims.tp, bf16)
    prior = SparsePrior(sparse, model_cfg.n_heads // dims.tp, model_cfg.head_dim, model_cfg.n_layers) if sparse else None
    names = ("home", "query", "returned", "unique_kv", "expanded_kv")
    copies = copies or sparse is not None
    worst, candidates = np.zeros(len(names)), []

    def ratios(counts) -> RowRatios:
        return RowRatios(*(counts / config.tokens_per_rank).tolist(), batches=batches)

    for _ in range(batches):
        if pooled:  # one unit per tick, each with its own plan's rows
            tables = [plan_batch(stream.next_batch(), config, world, cost_model, shape, prior, dims.tp,
                                 strategy="local").plan.pieces for _ in range(config.microbatches)]
            units = [[AttentionRows.of(t.plan, copies)] for t in plan_pooled_ticks(tables, dims.pp, config, cost_model, shape)]
        else:
            batch = stream.next_batch()
            nanos = batch.split_documents(2) if config.pingpong else [batch]
            units = [[AttentionRows.of(plan_batch(nano, config, world, cost_model, shape, prior, dims.tp).plan,
                                       copies) for nano in nanos]]
        # (counts, ranks) of each unit; a pooled rank holds every tick's at once, the others one unit at a time
        per_unit = [np.array([np.sum([getattr(r, name) for r in rows], axis=0) for name in names]) for rows in units]
        worst = np.maximum(worst, np.max([counts.max(axis=1) for counts in per_unit], axis=0))
        for counts in [sum(per_unit)] if pooled else per_unit:
            candidates += [ratios(rank) for rank in counts.T]
    return {"rows": ratios(worst), "held_candidates" if pooled else "row_candidates": undominated(candidates)}


def memory_inputs(config: TrainConfig, model_cfg: ModelConfig, dims: ParallelDims, bf16: bool,
                  rows: RowRatios = RowRatios(), gpu: bool = True) -> MemoryInputs:
    """The memory model's view of a run (on CPU runs offload moves nothing, so it counts as off). The loss
    kernel is the one asked for, or for auto the one this machine would run (a GPU run planned from a
    machine without liger_kernel is predicted with the chunked loss, the larger)."""
    loss_kernel = config.loss_kernel if config.loss_kernel != "auto" else \
        resolve_loss_kernel("auto", "cuda" if gpu else "cpu", dims.tp)
    stages = rank_layers(model_cfg, config.pp_schedule, dims.pp) if dims.pp > 1 else [0]
    return MemoryInputs(model_cfg, config.tokens_per_rank, config.activation_checkpointing,
                        config.activation_offload and gpu, config.optimizer_offload and gpu, bf16, dp=dims.dp,
                        tp=dims.tp, pp=dims.pp, microbatches=config.microbatches,
                        in_flight=activations_in_flight(config.pp_schedule, dims.pp, config.microbatches), rows=rows,
                        rank_layers=sum(stages), stage_layers=max(stages),
                        loss_kernel=loss_kernel)


def run_memory_inputs(config: TrainConfig, model_cfg: ModelConfig, source, cost_model, sparse: SparseConfig | None,
                      dims: ParallelDims, gpu: bool, capacity: Capacity, calibration: Calibration,
                      copies: bool = True) -> MemoryInputs:
    """The memory model's inputs for a run, core attention's rows from plans of its first batches (at most
    MEMORY_SAMPLE_BATCHES, and no more than the run trains on). Those are drawn only if, with the fewest
    rows core attention can hold (RowRatios(), a lower bound of the
    busiest rank's), some memory setting fits: a batch far too large is refused before one is drawn.
    ``copies``: whether core attention copies prefixes (prefix_copies)."""
    bf16 = uses_bf16(config, "cuda" if gpu else "cpu")
    x = memory_inputs(config, model_cfg, dims, bf16, gpu=gpu)
    if any(capacity.holds(estimate(s, calibration)) for s in settings(x, offloads=gpu)):
        # A run shorter than the sample plans no more batches than it draws (from the stream's start, also
        # when it resumes later on); a pooled pipeline's sample is of steps, the others' of micro-batches.
        steps = config.stop_at or config.steps
        run_batches = steps if dims.pp > 1 and config.pp_schedule == POOLED else steps * config.microbatches
        x = replace(x, **sample_row_ratios(config, source, cost_model, dims, model_cfg, sparse, bf16,
                                           batches=min(MEMORY_SAMPLE_BATCHES, run_batches), copies=copies))
    return x


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ranks_on_this_machine(config: TrainConfig, world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world if _under_torchrun() else config.nproc))


def prefix_copies(backend: str | None, device: torch.device | None, model_cfg: ModelConfig) -> bool:
    """Whether core attention under ``backend`` copies each kernel segment's key prefix where a server holds
    shards of one document that do not continue each other: unless the backend serves queries at given
    positions on ``device`` (kernels.serves_positions; with no device known, fa4 is assumed to copy)."""
    return not serves_positions(backend, device, model_cfg.head_dim)


def check_memory(config: TrainConfig, model_cfg: ModelConfig, source, cost_model, sparse: SparseConfig | None,
                 dims: ParallelDims, device: torch.device, backend: str | None = None) -> MemoryEstimate:
    """The predicted peak of a rank (attnpool.train.memory), refused with the field to change where it does
    not fit: on GPU the device's memory (with the packaged calibration) and, for offloaded state, this
    machine's memory shared by its ranks; on CPU that shared memory alone (the hand count alone)."""
    gpu = device.type == "cuda"
    local_ranks = ranks_on_this_machine(config, dims.world)
    host = host_memory_bytes() // local_ranks
    for_each = f" for each of its {local_ranks} ranks" if local_ranks > 1 else ""
    if gpu:
        calibration = Calibration.load()
        capacity = Capacity(torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device),
                            host)
    else:
        calibration, capacity = Calibration.none(), Capacity(host, "this machine's memory" + for_each)
    x = run_memory_inputs(config, model_cfg, source, cost_model, sparse, dims, gpu, capacity, calibration,
                          prefix_copies(backend, device, model_cfg))
    predicted = estimate(x, calibration)
    if not capacity.holds(predicted):
        raise report(x, capacity, calibration, offloads=gpu).refusal()
    return predicted


# --- Model, optimizer, schedule ----------------------------------------------------------------


def build_model(model_cfg: ModelConfig, config: TrainConfig, device: torch.device, bf16: bool = False,
                mesh: RankMesh | None = None, hf: HFModelSpec | None = None) -> Transformer | HFCausalLM:
    """The model (``hf``: transformers' model of that directory), tensor-parallel over ``mesh``'s "tp" ranks
    where tp > 1 (attnpool.parallel.tensor), then FSDP2-sharded over its "dp" ranks (all ranks without a mesh)
    per layer and at the root, with gradients summed over ranks.

    With ``bf16`` FSDP gathers parameters in bf16 for compute (half the all-gather bytes,
    no per-use casts) and reduces gradients in float32; the sharded master weights and the
    optimizer stay float32."""
    torch.manual_seed(config.seed)
    if hf is not None:  # built whole on every rank (the same weights everywhere), then sharded
        return shard_model(build_hf_model(hf, device), config, device, bf16, mesh, on_meta=False)
    on_meta = model_cfg.num_params() > META_INIT_PARAMS
    with torch.device("meta" if on_meta else device):
        model = Transformer(model_cfg)
    return shard_model(model, config, device, bf16, mesh, on_meta)


def build_stages(model_cfg: ModelConfig, config: TrainConfig, device: torch.device, bf16: bool,
                 mesh: RankMesh) -> tuple[list[int], list[PipelineStageModel]]:
    """This pipeline rank's stages (attnpool.parallel.pipeline) of the model :func:`build_model` builds,
    each sharded as it shards the whole model. A model small enough to be built whole starts from the
    same weights as without pipelining."""
    torch.manual_seed(config.seed)
    on_meta = model_cfg.num_params() > META_INIT_PARAMS
    with torch.device("meta" if on_meta else device):
        model = PipelineStageModel(model_cfg)
    stage_ids, models = build_stage_models(model, config.pp_schedule, mesh.dims.pp, mesh.pp_rank)
    return stage_ids, [shard_model(m, config, device, bf16, mesh, on_meta) for m in models]


def shard_model(model: Transformer, config: TrainConfig, device: torch.device, bf16: bool, mesh: RankMesh | None,
                on_meta: bool) -> Transformer:
    """Activation checkpointing, tensor parallelism, ``compile`` and FSDP2 applied to ``model`` (see build_model)."""
    if isinstance(model, HFCausalLM) and config.activation_checkpointing == "full":
        model.checkpoint_layers()  # (keep_attention is refused for hf: models in TrainConfig)
    elif config.activation_checkpointing != "none":
        apply_activation_checkpointing(model, recompute_attention=config.activation_checkpointing == "full")
    if mesh is not None and mesh.dims.tp > 1:
        apply_tensor_parallel(model, mesh.tp_mesh)
    if config.compile and isinstance(model, Transformer):  # (refused with hf: models in TrainConfig)
        compile_linear_parts(model)
    use_loss_kernel(model, resolve_loss_kernel(config.loss_kernel, device.type, config.tp))
    # cast_forward_inputs=False: a layer's input is already bf16, and FSDP2 would otherwise round RoPE's
    # float32 cos and sin to bf16 at every layer (and keep that copy for backward).
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False) if bf16 else MixedPrecisionPolicy()
    shard_options = dict(mp_policy=mp_policy, mesh=mesh.dp_mesh if mesh is not None else None)
    if config.optimizer_offload:  # sharded parameters, gradients and the optimizer's state live in host memory
        shard_options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in model.layers.values():
        fully_shard(layer, **shard_options)
    fully_shard(model, **shard_options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss is already a share of the global mean (see forward_backward):
            # sum the gradients over ranks. Plain SUM, which gloo supports (no PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    if on_meta:
        model.to_empty(device="cpu" if config.optimizer_offload else device)
    if isinstance(model, Transformer):  # (an hf: model keeps the weights it was built with)
        # Drawn per weight by name and seed, whole, each rank keeping its part: every layout (tp, pp, dp;
        # built on the meta device or not) starts from the weights of the one-process model.
        model.init_weights(seed=config.seed, device=device)
    return model


def build_optimizer(model: torch.nn.Module, config: TrainConfig, fused: bool = False) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms or biases). ``fused`` (GPU runs, offloaded state
    included): one kernel per step, and no temporaries the size of the parameters, which the
    multi-tensor implementation allocates (attnpool.train.memory counts none)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=fused or None)


def lr_factor(done: int, warmup_steps: int, steps: int, min_ratio: float) -> float:
    """Peak-lr multiplier for the step after ``done`` steps: linear warmup, then cosine down to ``min_ratio``."""
    if done < warmup_steps:
        return (done + 1) / warmup_steps
    progress = min(1.0, (done - warmup_steps) / max(1, steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    factor = functools.partial(lr_factor, warmup_steps=config.warmup_steps, steps=config.steps,
                               min_ratio=config.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_gradients(params: list, max_norm: float, pp_group=None) -> torch.Tensor:
    """The gradients' total 2-norm over every rank's parameters (``pp_group``: also over the other
    pipeline stages'), clipped to ``max_norm`` (inf: not clipped); returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        squared = norm ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


# --- One step ----------------------------------------------------------------------------------


@dataclass
class StepPlan:
    plan: Plan | None  # its ``pieces`` are the layout (None for a step's combined nano-batches)
    batch: GlobalBatch | None  # the batch the plan's pieces refer to (with any padding documents)
    load_local: list[float]  # per rank: attention load if every rank served its own tokens of the linear layout
    load_planned: list[float]  # per rank: attention load under the plan
    imbalance_local: float  # max / mean of load_local
    imbalance_planned: float  # max / mean of load_planned


def plan_batch(batch: GlobalBatch, config: TrainConfig, num_ranks: int, cost_model,
               shape: AttentionShape = AttentionShape(), sparse_prior: SparsePrior | None = None,
               tokens_multiple: int = 1, strategy: str | None = None) -> StepPlan:
    """Lay out the batch (linear, or wlb's re-packing) and plan its core attention for ``config.attention``
    (or ``strategy``: "local" where only the layout is wanted, as a pooled pipeline plans its ticks itself).

    With sparse attention the cost of a task is its expected sparse work (``sparse_prior``).
    ``tokens_multiple`` (tensor parallelism's tp): every rank's tokens are padded to a multiple of it
    by a padding document (plan.layout.pad_ranks), which the returned ``batch`` holds."""
    linear = linear_table(batch.doc_lens, num_ranks, batch.tokens_per_rank)
    table = wlb_table(batch.doc_lens, num_ranks, batch.tokens_per_rank, config.memory_cap) \
        if config.attention == "wlb" else linear
    if tokens_multiple > 1:
        table = pad_ranks(table, tokens_multiple)
        batch = batch.padded(table.doc_len[batch.num_docs:])
    if sparse_prior is not None:  # the tables number documents in batch order, padding last
        cost_model = sparse_prior.cost_model(table.doc_len, cost_model)
    plan = plan_attention(table, strategy or config.attention, cost_model=cost_model,
                          min_shard_tokens=config.min_shard, eps=config.eps, shape=shape)
    local = home_loads(linear, cost_model)  # "before" is always plain packing served at home
    planned = server_loads(plan, cost_model)
    return StepPlan(plan, batch, local.tolist(), planned.tolist(), imbalance(local), imbalance(planned))


def plan_pooled_ticks(tables: list[PieceTable], stages: int, config: TrainConfig, cost_model,
                      shape: AttentionShape) -> list[StepPlan]:
    """Every tick's plan of a pooled pipeline step (attnpool.parallel.pooled_pipeline) over all stages' dp
    ranks, with its loads divided by the number of stages: each micro-batch runs on every stage, a
    stage's share of its layers, so the ticks' summed loads are then the step's attention work per layer,
    as a step's plans count it without pooling."""
    out = []
    for tick in range(ticks(len(tables), stages)):
        table = pooled_table(tables, tick, stages)
        plan = plan_attention(table, config.attention, cost_model=cost_model, min_shard_tokens=config.min_shard,
                              eps=config.eps, shape=shape)
        local, planned = home_loads(table, cost_model) / stages, server_loads(plan, cost_model) / stages
        out.append(StepPlan(plan, None, local.tolist(), planned.tolist(), imbalance(local), imbalance(planned)))
    return out


def combine_plans(plans: list[StepPlan], in_turn: bool = False) -> StepPlan:
    """One step's balance over its nano-batches: per-rank loads summed (the plans themselves stay separate).
    ``in_turn``: the plans run one after another, each as long as its busiest rank, so the step's imbalance is
    the sum of their busiest ranks' loads over the sum of their means (a pooled pipeline's ticks)."""
    if len(plans) == 1:
        return plans[0]
    local = np.sum([p.load_local for p in plans], axis=0).tolist()
    planned = np.sum([p.load_planned for p in plans], axis=0).tolist()
    if in_turn:
        def step_imbalance(loads):
            mean = sum(float(np.mean(x)) for x in loads)
            return sum(max(x) for x in loads) / mean if mean > 0 else 1.0  # as imbalance(): 1.0 without work
        return StepPlan(None, None, local, planned, step_imbalance([p.load_local for p in plans]),
                        step_imbalance([p.load_planned for p in plans]))
    return StepPlan(None, None, local, planned, imbalance(local), imbalance(planned))


@contextlib.contextmanager
def step_context(device_type: str, bf16: bool, vocab_parallel: bool):
    """What a training step's forward and backward run under: bf16 autocast, and with tensor parallelism
    PyTorch's ``loss_parallel`` (the logits are split by vocabulary)."""
    with loss_parallel() if vocab_parallel else nullcontext(), \
            torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        yield


def forward_backward(model: Transformer, batches: list[RankTensors], attentions: list, global_label_tokens: int,
                     bf16: bool = False, offload: ActivationOffload | None = None,
                     vocab_parallel: bool = False) -> torch.Tensor:
    """Forward and backward of this rank's tokens; returns the rank's summed token loss (detached).

    One batch with its core attention, or (ping-pong) several nano-batches whose
    layers the model interleaves. The rank back-propagates its summed loss / the
    global batch's label tokens, and FSDP sums gradients over ranks
    (:func:`build_model`), so the gradient is that of the mean loss over every real
    token of the global batch. With ``offload``, what the forward saves for
    backward waits in host memory. ``vocab_parallel`` (tensor parallelism): the
    logits are split by vocabulary over the tp ranks, and the cross-entropy, forward
    and backward, is PyTorch's ``loss_parallel``; every tp rank gets the whole loss.
    """
    with step_context(batches[0].tokens.device.type, bf16, vocab_parallel):
        with offload or nullcontext():
            if len(batches) == 1:
                losses = [model(batches[0].tokens, batches[0].positions, attentions[0], labels=batches[0].labels)]
            else:
                losses = model([b.tokens for b in batches], [b.positions for b in batches], attentions,
                               labels=[b.labels for b in batches])
        loss_sum = sum(losses)  # summed token cross-entropy, computed in chunks inside the model
        (loss_sum / global_label_tokens).backward()
    loss_sum = loss_sum.detach()
    return loss_sum.full_tensor() if isinstance(loss_sum, DTensor) else loss_sum


def _all_gather_floats(values: list[float], device: torch.device) -> np.ndarray:
    """(world, len(values)): every rank's values."""
    out = all_gather_flat(torch.tensor(values, dtype=torch.float64, device=device))
    return out.cpu().numpy().reshape(dist.get_world_size(), len(values))


# --- The loop ----------------------------------------------------------------------------------


@dataclass
class TrainResult:
    rows: list[dict]  # metrics of every step of the run so far (earlier runs' rows included on resume)
    model: Transformer
    summary: dict | None  # rank 0 only
    memory: MemoryEstimate | None = None  # this rank's predicted peak, where its device was checked

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]


def rank_device(config: TrainConfig) -> torch.device:
    if resolve_device(config) == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def train(config: TrainConfig, on_step=None) -> TrainResult:
    """Train (or, with ``config.resume``, continue) on the ranks of the initialised default process group.

    ``on_step()``, if given, is called after every step (e.g. a torch.profiler's ``step``). A SIGTERM at
    any time from here on stops the run after its current (or first) step, checkpointed."""
    with Preemption() as preemption:
        return _train(config, on_step, preemption)


def _train(config: TrainConfig, on_step, preemption: "Preemption") -> TrainResult:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(config)
    setup = agree(lambda: prepare(config, device, world))
    same_attention_backend(setup.attention_backend, config.attention_backend)
    model_cfg, cost_model = setup.model_config, setup.cost_model
    bf16 = uses_bf16(config, device.type)
    # The plan is made over the dp ranks; this rank holds its dp rank's tokens and runs core attention
    # on its share of the heads (and, pipelined, its stage's layers) with the dp ranks of its tp and
    # pipeline index (attnpool.parallel.mesh).
    mesh = build_rank_mesh(ParallelDims.of(world, config.tp, config.pp), device.type)
    dp, tp, pp, dp_rank = mesh.dims.dp, mesh.dims.tp, mesh.dims.pp, mesh.dp_rank

    records = RankRecords(config.out, rank, world)
    resume_from = verified_checkpoint(config, setup, model_cfg) if setup.resume_from is not None else None
    pipeline = None
    if pp > 1:
        stage_ids, stages = build_stages(model_cfg, config, device, bf16, mesh)
        model = merged_stages(stages)
        tokens = config.tokens_per_rank + (-config.tokens_per_rank) % tp  # padded for tp (plan_batch)
        hidden, hidden_dtype = (tokens // tp, model_cfg.dim), torch.bfloat16 if bf16 else torch.float32
        if config.pp_schedule == POOLED:
            pipeline = PooledPipelineRunner(
                model, [int(k) for k in model.layers], mesh.pp_rank, pp, mesh.pp_peers(), hidden, hidden_dtype,
                (model_cfg.n_heads // tp, model_cfg.n_kv_heads // tp, model_cfg.head_dim), device)
            pooled_group = mesh.pooled_attention_group()
        else:
            pipeline = PipelineRunner.build(stage_ids, stages, config.pp_schedule, config.microbatches, tokens,
                                            hidden, hidden_dtype, device, mesh.pp_group)
    else:
        model = build_model(model_cfg, config, device, bf16, mesh, setup.hf)
    pooled = isinstance(pipeline, PooledPipelineRunner)
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params) if setup.hf is not None else model_cfg.num_params()
    optimizer = build_optimizer(model, config, fused=device.type == "cuda")
    offload = None
    if config.activation_offload:  # prefetch in backward: one layer's saved activations ahead
        layer_bytes = saved_bytes_per_layer(memory_inputs(config, model_cfg, mesh.dims, bf16))
        offload = ActivationOffload(device, prefetch_bytes=layer_bytes)
    scheduler = build_scheduler(optimizer, config)
    stream = DocumentStream(setup.source, dp, config.tokens_per_rank, config.seed, config.max_doc_len)
    sparse = setup.sparse
    prior = SparsePrior(sparse, model_cfg.n_heads // tp, model_cfg.head_dim, model_cfg.n_layers) if sparse else None
    extra_state = {"sparse_prior": prior} if prior else {}
    # With ping-pong, the sparse exchanges get a communicator of their own (CoreAttention.pattern_group).
    pattern_group = mesh.new_attention_group() if sparse and config.pingpong else None
    step = 0
    if resume_from is not None:
        step = load_checkpoint(resume_from, model, optimizer, scheduler, stream, extra_state, device)
    start_step, last_step = step, config.stop_at or config.steps
    shape = attention_shape(model_cfg, tp, bf16)
    attention_kwargs = {"backend": setup.attention_backend}

    if rank == 0:
        os.makedirs(config.out, exist_ok=True)
        write_config(config, resume_from, step)
    log = MetricsLog(config.out, write=rank == 0, resume_step=step if resume_from else None,
                     logger=open_logger(config.logger, config.out, config.to_dict()) if rank == 0 else None)
    dist.barrier()  # every rank has read the earlier rows before rank 0 rewrites the file
    log.start()
    if rank == 0:
        resumed = f", resumed from {resume_from}" if resume_from else ""
        layout = f" (pp {pp} x dp {dp} x tp {tp})" if pp > 1 else f" (dp {dp} x tp {tp})" if tp > 1 else ""
        micro = f" in {config.microbatches} micro-batches" if config.microbatches > 1 else ""
        print(f"attnpool train: {config.model} ({num_params / 1e6:.2f}M params) on {world} x {device.type}"
              f"{layout}, {config.attention} attention ({setup.attention_backend} kernel), "
              f"{dp} x {config.microbatches * config.tokens_per_rank} tokens "
              f"per step{micro}, steps {step + 1}..{last_step} of {config.steps}{resumed} -> {config.out}", flush=True)
        if getattr(cost_model, "backend", setup.attention_backend) != setup.attention_backend and device.type == "cuda":
            print(f"cost model: {cost_model.source}", flush=True)  # a stand-in table plans this kernel
        if setup.memory is not None and device.type == "cuda":
            capacity = torch.cuda.get_device_properties(device).total_memory
            print(f"memory: predicted peak {format_bytes(setup.memory.peak_bytes)} per GPU of its "
                  f"{format_bytes(capacity)} ({setup.memory.inputs.setting})", flush=True)
        if sparse is not None and device.type == "cuda" and config.precision == "fp32":
            print("the float32 sparse kernels (IEEE products) compile for minutes the first time they run", flush=True)

    last_plan = None
    wall0 = time.perf_counter()
    nonfinite_total = sum(1 for r in log.rows if r.get("skipped_step"))
    nonfinite_in_a_row = 0
    comm_stats.timing = True
    try:
        with Progress(rank == 0 and config.progress, last_step, step, config.attention) as progress:
            while step < last_step:
                step += 1
                records.step(step)
                t0 = time.perf_counter()
                reset_peak_memory(device)
                micro_batches = [stream.next_batch() for _ in range(config.microbatches)]
                # A step may hold no target at all (task sources mark only answers; a batch of ordinary
                # documents has none): its loss is then 0, not 0 / 0, and the optimizer does not step (AdamW's
                # momentum and weight decay would move the weights without a gradient).
                targets = sum(b.num_label_tokens for b in micro_batches)
                label_tokens = max(1, targets)
                t_plan = time.perf_counter()
                # Every micro-batch's plans (a plan per nano-batch with ping-pong) are made at the start of the step;
                # a pooled pipeline's only lay its micro-batches out, and its ticks are planned over all stages.
                plans = [[plan_batch(nano, config, dp, cost_model, shape, prior, tp, "local" if pooled else None)
                          for nano in (batch.split_documents(2) if config.pingpong else [batch])]
                         for batch in micro_batches]
                last_plan = combine_plans([p for mb in plans for p in mb])
                if pooled:
                    # The ticks' plans over every stage's ranks are what runs; the step's balance is theirs.
                    tick_plans = plan_pooled_ticks([mb[0].plan.pieces for mb in plans], pp, config, cost_model, shape)
                    last_plan = combine_plans(tick_plans, in_turn=True)
                plan_time = time.perf_counter() - t_plan
                comm_stats.reset()
                stats = SparseStats()
                tensors = [[p.batch.rank_batch(p.plan.pieces, dp_rank).to_torch(device) for p in mb] for mb in plans]
                attentions = [[CoreAttention(p.plan, mesh.attention_group, sparse=sparse, sparse_stats=stats,
                                             pattern_group=pattern_group, **attention_kwargs) for p in mb] for mb in plans]
                # Interleaved phases (ping-pong) leave core attention no wall time of its own to measure.
                # (Pooled pipeline ticks make core attentions of their own.)
                timers = [AttentionTimer(mb[0], device) for mb in attentions] \
                    if all(len(mb) == 1 for mb in attentions) and not pooled \
                    else None
                if timers is not None:
                    attentions = [[timer] for timer in timers]
                if pooled:
                    with step_context(device.type, bf16, tp > 1), offload or nullcontext():
                        loss_sum = pipeline.step(
                            [mb[0].tokens for mb in tensors], [mb[0].positions for mb in tensors],
                            [mb[0].labels for mb in tensors],
                            lambda tick: CoreAttention(tick_plans[tick].plan, pooled_group, **attention_kwargs),
                            1.0 / label_tokens) * label_tokens
                elif pipeline is not None:
                    with step_context(device.type, bf16, tp > 1), offload or nullcontext():
                        # The loss shares of the step's mean, summed back into token losses for the log.
                        loss_sum = pipeline.step([mb[0].tokens for mb in tensors], [mb[0].positions for mb in tensors],
                                                 [mb[0].labels for mb in tensors], [mb[0] for mb in attentions],
                                                 1.0 / label_tokens) * label_tokens
                else:
                    loss_sum = 0.0
                    for i, (mb_tensors, mb_attentions) in enumerate(zip(tensors, attentions)):
                        if config.microbatches > 1:  # FSDP2 reduces gradients once, after the last micro-batch
                            model.set_requires_gradient_sync(i == config.microbatches - 1)
                        loss_sum = loss_sum + forward_backward(model, mb_tensors, mb_attentions, label_tokens, bf16,
                                                               offload, tp > 1)
                grad_norm = clip_gradients(params, config.grad_clip or float("inf"), mesh.pp_group if pp > 1 else None)
                lr = scheduler.get_last_lr()[0]
                # A step whose loss or gradient is not finite is skipped on every rank (its gradients dropped),
                # and the schedule goes on, so that step numbers keep their learning rates.
                finite = agree_finite(loss_sum, grad_norm, device)
                if finite:
                    if targets:  # the same on every rank: the micro-batches are the global batches
                        optimizer.step()
                    nonfinite_in_a_row = 0
                else:
                    nonfinite_total += 1
                    nonfinite_in_a_row += 1
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                attention_seconds = sum(t.seconds() for t in timers) if timers is not None else float("nan")
                per_rank = _all_gather_floats([float(loss_sum), attention_seconds, comm_stats.seconds(),
                                               float(comm_stats.bytes_sent), float(peak_memory_bytes(device)),
                                               float(peak_reserved_bytes(device)),
                                               float(offload.offloaded_bytes if offload else 0), float(preemption.requested),
                                               *stats.values()], device)
                stop = bool(per_rank[:, 7].max() > 0)  # a SIGTERM reached some rank: all stop after this step
                sparse_sums = per_rank[:, 8:].sum(0)  # each document was estimated on one rank
                if prior is not None:
                    prior.update(*sparse_sums[:3])
                step_time = time.perf_counter() - t0
                step_tokens = sum(b.num_tokens for b in micro_batches)
                row = {
                    "step": step,
                    # a dp rank's tp ranks agree on its loss; off the last pipeline stage ranks report none
                    "loss": float(per_rank[:, 0].sum() / tp / label_tokens),
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens": step_tokens,
                    "tokens_per_s": step_tokens / step_time,
                    "step_time_s": step_time,
                    "plan_time_s": plan_time,
                    "attention_time_s": None if timers is None else float(per_rank[:, 1].max()),
                    "comm_time_s": float(per_rank[:, 2].max()),
                    "comm_bytes": int(per_rank[:, 3].sum()),
                    "peak_memory_bytes": int(per_rank[:, 4].max()),
                    "peak_reserved_bytes": int(per_rank[:, 5].max()) if device.type == "cuda" else None,
                    "activation_offload_bytes": int(per_rank[:, 6].max()) if offload else None,
                    "attention_work_total": float(np.sum(last_plan.load_local)),  # cost-model units
                    "attention_density": float(sparse_sums[3] / sparse_sums[4]) if sparse else None,
                    "imbalance_before": last_plan.imbalance_local,
                    "imbalance_after": last_plan.imbalance_planned,
                    "num_docs": sum(b.num_docs for b in micro_batches),
                    "longest_doc": int(max(b.doc_lens.max() for b in micro_batches)),
                    "skipped_step": not finite,
                    "nonfinite_steps": nonfinite_total,
                }
                log.append(row)
                progress.update(row)
                if on_step is not None:
                    on_step()
                every = config.checkpoint_every
                # No checkpoint of a skipped step: a run that diverges leaves the last good one newest.
                if finite and every >= 0 and (step == last_step or stop or (every and step % every == 0)):
                    save_checkpoint(checkpoint_path(config.out, step), model, optimizer, scheduler, stream, step, extra_state,
                                    device, config.to_dict(), config.keep_checkpoints)
                    if config.hf_export_checkpoints:
                        export_hf_model(model, setup.hf, config, checkpoint_export_dir(config.out, step))
                if nonfinite_in_a_row >= config.max_nonfinite_steps:
                    raise TrainingError(f"step {step}: the loss or gradient norm was not finite in {nonfinite_in_a_row} "
                                        f"steps in a row (max_nonfinite_steps={config.max_nonfinite_steps}); their "
                                        "updates were skipped, so the weights are those of the last finite step. Lower "
                                        "--lr, or clip gradients (--grad-clip)")
                if stop:
                    if rank == 0:
                        saved = f"checkpoint {checkpoint_path(config.out, step)} written" if finite and every >= 0 \
                            else "no checkpoint written (checkpoint_every=-1)" if every < 0 else "no checkpoint (a skipped step)"
                        print(f"SIGTERM: stopped after step {step}, {saved}; --resume continues", flush=True)
                    break
    except (ConfigError, TrainingError):
        raise
    except Exception as exc:
        if not is_collective_failure(exc):
            raise
        # A peer is gone (or silent past collective_timeout_s): name it, on every survivor.
        raise TrainingError(records.describe_failure(exc, step, config.collective_timeout_s), restartable=True) from None
    finally:
        comm_stats.timing = False
        log.close()
    if setup.hf is not None and step == last_step:
        export_hf_model(model, setup.hf, config)

    summary = None
    if rank == 0:
        info = {"model": config.model, "params": num_params, "world": world, "dp": dp, "tp": tp, "pp": pp,
                "predicted_peak_memory_bytes": setup.memory.peak_bytes if setup.memory and device.type == "cuda" else None,
                "tokens_per_rank": config.tokens_per_rank, "microbatches": config.microbatches,
                "strategy": config.attention, "steps": config.steps,
                "start_step": start_step, "end_step": step, "wall_s": time.perf_counter() - wall0}
        summary = _report(config, log, last_plan, getattr(cost_model, "unit", "work"), info)
    return TrainResult(log.rows, model, summary, setup.memory)


def checkpoint_export_dir(out: str, step: int) -> str:
    """Where hf_export_checkpoints puts the export of step ``step``'s checkpoint."""
    return os.path.join(out, HF_CHECKPOINT_EXPORTS_DIR, os.path.basename(checkpoint_path(out, step)))


def export_hf_model(model: HFCausalLM, hf: HFModelSpec, config: TrainConfig, directory: str | None = None) -> str:
    """``directory`` (default OUT/hf): the trained weights (gathered from every rank's shards; a collective)
    in the dtype of the model's config.json, with ``save_pretrained``, and the tokenizer where there is one.
    Written beside it and renamed into place, so a reader never finds half an export; per-checkpoint
    exports beyond the newest ``keep_checkpoints`` are deleted, as their checkpoints are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    directory = directory or os.path.join(config.out, HF_EXPORT_DIR)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        tokenizer = tokenizer_path(config)
        has_tokenizer = tokenizer is not None and any(
            os.path.isfile(os.path.join(tokenizer, name)) for name in ("tokenizer.json", "tokenizer_config.json"))
        partial, replaced = directory + ".partial", directory + ".replaced"
        for stale in (partial, replaced):
            shutil.rmtree(stale, ignore_errors=True)
        save_hf_export(model, full, partial, export_dtype(hf), tokenizer if has_tokenizer else None)
        if os.path.isdir(directory):  # a resumed run's export of the same step, or the end's again
            os.replace(directory, replaced)
        os.replace(partial, directory)
        shutil.rmtree(replaced, ignore_errors=True)
        exports = os.path.dirname(directory)
        if config.keep_checkpoints > 0 and os.path.basename(exports) == HF_CHECKPOINT_EXPORTS_DIR:
            finished = sorted(name for name in os.listdir(exports) if re.fullmatch(r"step-\d+", name))
            for name in finished[:-config.keep_checkpoints]:
                shutil.rmtree(os.path.join(exports, name), ignore_errors=True)
        print(f"hf export: {directory} (transformers: AutoModelForCausalLM.from_pretrained)", flush=True)
    dist.barrier()
    return directory


def _report(config: TrainConfig, log: MetricsLog, last_plan: StepPlan | None, unit: str, info: dict) -> dict | None:
    """Rank 0 at the end: summary.json, summary.png and the printed summary."""
    if last_plan is None:
        print(f"nothing to do: the checkpoint is at step {info['end_step']}, the run stops there")
        return None
    loads = {"local": last_plan.load_local, "planned": last_plan.load_planned, "unit": unit}
    summary = summarize(log.rows, loads, info)
    with open(os.path.join(config.out, SUMMARY_FILE), "w") as fh:
        json.dump(summary, fh, indent=1)
    plot = os.path.join(config.out, PLOT_FILE)
    plot_run(log.rows, loads, config.attention, plot)
    checkpoint = checkpoint_path(config.out, info["end_step"])
    print_summary(summary, [log.path, plot] + ([checkpoint] if os.path.isdir(checkpoint) else []))
    return summary



# --- Resume, preemption, non-finite steps --------------------------------------------------------


def verified_checkpoint(config: TrainConfig, setup: Setup, model_cfg: ModelConfig) -> str:
    """The newest checkpoint whose every file matches its manifest's hash (the ranks share the hashing and
    agree); rank 0 says which newer ones it skipped. Refused on every rank alike where none is valid."""
    path, skipped = select_checkpoint(config.out)
    if dist.get_rank() == 0:
        for bad, problem in skipped:
            print(f"skipping {bad}: {problem}", flush=True)
    if path is None:
        refuse_damaged(config.out, skipped)
    if path != setup.resume_from:
        shapes = hf_state_shapes(setup.hf) if setup.hf is not None else None
        agree(lambda: (check_compatible(path, model_cfg, shapes), config_changes(config, path)))
    return path


def write_config(config: TrainConfig, resume_from: str | None, step: int) -> None:
    """OUT/config.yaml: this run's settings. A resume that changes them (--allow-config-change) keeps the
    earlier file as config.step-NNNNNN.yaml and says what changed; one that changes nothing keeps it."""
    path = os.path.join(config.out, "config.yaml")
    if resume_from is not None and os.path.isfile(path):
        changes = config_changes(config, resume_from)
        if changes:
            print("resuming with changed settings: " + ", ".join(f"{k}: {a} -> {b}" for k, a, b in changes), flush=True)
            kept = os.path.join(config.out, f"config.step-{step:06d}.yaml")
            if os.path.exists(kept):  # a resume from this step before (a restart): that copy is the original
                os.remove(path)
            else:
                os.replace(path, kept)
        elif load_config(path).to_dict() == config.to_dict():
            return
    save_config(config, path)


class _OnSigterm:
    """A SIGTERM handler for the block (where signals can be handled: the main thread), the previous one
    restored after it."""

    def _handle(self, signum, frame):
        raise NotImplementedError

    def __enter__(self):
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class Preemption(_OnSigterm):
    """SIGTERM asks for a stop: the rank finishes its step, and the ranks agree at the step's end (every
    step gathers each rank's flag) to checkpoint and leave."""

    requested = False

    def _handle(self, signum, frame):
        self.requested = True


def agree_finite(loss_sum, grad_norm, device: torch.device) -> bool:
    """Whether every rank's loss and the gradient norm are finite (one all-reduce): a step that is not
    is skipped on all ranks alike."""
    finite = math.isfinite(float(loss_sum)) and math.isfinite(float(grad_norm))
    flag = torch.tensor([1.0 if finite else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)



# --- Launching ---------------------------------------------------------------------------------


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(config: TrainConfig, rank: int, world: int, init_method: str | None) -> None:
    device = rank_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.collective_timeout_s)
    store = _torchrun_attempt_store(world, timeout) if init_method is None else None
    with process_group(backend, init_method=init_method, store=store, rank=rank, world_size=world, timeout=timeout,
                       device_id=device if device.type == "cuda" else None):
        train(config)


FINAL_ERROR = "final-error.txt"  # under OUT/ranks: a run's end that a restart cannot get past


def _torchrun_attempt_store(world: int, timeout: timedelta):
    """Under torchrun, the agent's store with a prefix of this attempt (None where the agent hosts none).
    The agent keeps one store across restarts, and the process group's keys of an attempt that died stay
    in it: a restarted worker would read its dead peers' addresses and hang or fail connecting."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"attnpool/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def _die_with_parent() -> None:
    """Linux: a SIGTERM to this worker when its launcher dies (even by SIGKILL), so that no worker trains
    on as an orphan; it checkpoints and leaves as on any SIGTERM."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _spawned(index: int, config: TrainConfig, world: int, init_method: str, errors_dir: str) -> None:
    _die_with_parent()
    os.environ["LOCAL_RANK"] = str(index)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        _run_rank(config, index, world, init_method)
    except (ConfigError, TrainingError) as exc:
        report = ("config", *_portable(exc)) if isinstance(exc, ConfigError) else \
            ("training", str(exc), exc.restartable)
        with open(os.path.join(errors_dir, f"{index}.tmp"), "wb") as fh:
            pickle.dump(report, fh)
        os.replace(os.path.join(errors_dir, f"{index}.tmp"), os.path.join(errors_dir, f"{index}.err"))
        end_process(2 if isinstance(exc, ConfigError) else 1)
    end_process(0)  # see attnpool.comm.process: no interpreter teardown with a group still referenced


def _reported_errors(errors_dir: str) -> dict[int, tuple]:
    found = {}
    for name in sorted(os.listdir(errors_dir)):
        if name.endswith(".err"):
            with open(os.path.join(errors_dir, name), "rb") as fh:
                found[int(name[:-4])] = pickle.load(fh)
    return found


def use_growable_segments() -> None:
    """Every step's shapes differ (documents are packed anew): growable segments keep the caching allocator
    from fragmenting (attnpool.train.memory's calibration is measured with them). Takes effect where it
    runs before CUDA starts in the process (the allocator reads its settings then); a user's own
    PYTORCH_CUDA_ALLOC_CONF wins. Set after CUDA started, it would be silently off: warned of here."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if torch.cuda.is_initialized():
        warnings.warn("growable segments asked for after CUDA started in this process: the allocator keeps the "
                      "settings it started with (call use_growable_segments() before anything touches the GPU)",
                      stacklevel=2)


class _ForwardSigterm(_OnSigterm):
    """The launcher passes a SIGTERM on to its workers (each finishes its step, checkpoints and leaves with
    0) instead of dying and leaving them to train on."""

    def __init__(self, processes):
        self.processes = processes
        self.forwarded = False

    def _handle(self, signum, frame):
        self.forwarded = True
        for p in self.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)


def _launch(config: TrainConfig) -> str | None:
    """One start of ``config.nproc`` workers. None when they all finished; bad input and runs that cannot go
    on are raised; a worker lost (killed, crashed, or named by its peers as stopped) comes back as one line
    saying which, for the caller to restart from."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory() as errors_dir:
        context = mp.start_processes(_spawned, args=(config, config.nproc, init_method, errors_dir),
                                     nprocs=config.nproc, join=False, start_method="spawn")
        try:
            with _ForwardSigterm(context.processes) as forward:
                # On the first failure join() gives the others a grace period to leave on their own (agreed
                # errors; their collectives with a lost rank fail), then kills what is left.
                while not context.join(grace_period=10):
                    pass
            return None
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:  # exited with an error, or raised one
            first = exc
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()  # a stopped (SIGSTOP) process never acts on SIGTERM
                    p.join()
        errors = _reported_errors(errors_dir)
    # Bad input first, then a run that cannot go on; else the rank that was lost.
    for kind, *said in errors.values():
        if kind == "config":
            raise ConfigError(*said) from None
    for kind, *said in errors.values():
        if kind == "training" and not said[1]:
            raise TrainingError(said[0]) from None
    if forward.forwarded:  # stopped on request: no restart
        raise TrainingError(f"stopped by SIGTERM, and rank {first.error_index} did not leave cleanly ({first})")
    if getattr(first, "signal_name", None):
        return f"rank {first.error_index} was killed by {first.signal_name}"
    lost = [said[0] for kind, *said in errors.values() if kind == "training"]
    if lost:
        return lost[0]
    return f"rank {first.error_index} failed: {str(first).strip().splitlines()[-1][:200]}"


def run(config: TrainConfig) -> int:
    """Train ``config``: under torchrun in this process (one of torchrun's); otherwise in ``nproc`` processes,
    started again from the latest valid checkpoint up to ``max_restarts`` times when one is lost.

    Returns 0; bad input raises ConfigError and a run that cannot go on TrainingError (in this process,
    whichever rank found it).
    """
    use_growable_segments()
    if _under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if config.nproc not in (1, world):
            raise ConfigError("nproc", config.nproc, f"under torchrun the processes are torchrun's ({world}); "
                                                     "leave nproc at 1")
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        final = os.path.join(config.out, RANKS_DIR, FINAL_ERROR)
        if restart and os.path.isfile(final):  # what ended the last attempt would end this one too
            with open(final) as fh:
                raise TrainingError(f"{fh.read().strip()} (torchrun's restart {restart} would repeat it)")
        if not restart and int(os.environ["RANK"]) == 0 and os.path.isfile(final):
            os.remove(final)  # an earlier run's
        if restart and not config.resume:  # torchrun --max-restarts started this worker again
            path, _ = select_checkpoint(config.out, checksum=False, distributed=False)
            if path is not None:
                if int(os.environ["RANK"]) == 0:
                    print(f"attnpool train: torchrun's restart {restart}: resuming from {path}", flush=True)
                config = replace(config, resume=True)
        try:
            _run_rank(config, int(os.environ["RANK"]), world, None)
        except (ConfigError, TrainingError) as exc:  # bad input, or a run that cannot go on: final
            if not getattr(exc, "restartable", False) and int(os.environ["RANK"]) == 0:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                with open(final, "w") as fh:
                    fh.write(str(exc))
            raise
        return 0
    device = resolve_device(config)
    if device == "cuda" and config.nproc > torch.cuda.device_count():
        raise ConfigError("nproc", config.nproc, f"one process per GPU, and this machine has {torch.cuda.device_count()}")
    prepare(config, world=config.nproc)  # refuse bad input before any process starts
    if config.nproc == 1:
        _run_rank(config, 0, 1, f"tcp://127.0.0.1:{_free_port()}")
        return 0
    restarts = 0
    while (lost := _launch(config)) is not None:
        if restarts >= config.max_restarts:
            raise TrainingError(f"{lost}; no restarts left (max_restarts={config.max_restarts})"
                                if config.max_restarts else lost)
        restarts += 1
        path, _ = select_checkpoint(config.out, checksum=False, distributed=False)
        if path is None and finished_checkpoints(config.out):
            raise TrainingError(f"{lost}; no valid checkpoint to restart from in {checkpoint_root(config.out)}")
        print(f"attnpool train: {lost}; restart {restarts} of {config.max_restarts}, resuming from "
              f"{path or 'the first step (no checkpoint yet)'}", flush=True)
        config = replace(config, resume=path is not None)
    return 0
