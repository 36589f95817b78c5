"""``RunSpec``: every decision a run makes once, before its first step, and never again.

The config says what the user asked for; the run spec is what that resolves to on this rank's device: the
model spec (attnpool.model.spec), the ranks' layout (``ParallelDims``), the core-attention kernel as an object
(not a name asked about at every layer), the loss kernel, bf16 or float32, each tp rank's share of the
attention heads, the token padding tensor parallelism needs, whether the kernel copies key prefixes, the cost
model and the sparse options. The planner, the runtime, the memory model and ``parallelize`` read it; nothing
resolves a name again. A training rank resolves it in ``prepare`` (attnpool.train.setup), and the ranks agree
on it before any collective depends on it.

Where no device is at hand (a launcher, which must not touch its GPUs, or ``attnpool memory`` planning for
GPUs from anywhere) the spec is resolved for a device kind: "auto" kernels then stay "auto", and nothing is
asked of a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attnpool.errors import ConfigError
from attnpool.kernels import Backend, backend_named, fa4, get_backend, resolve_backend_name, serves_positions
from attnpool.kernels.sparse import device_problem as sparse_device_problem
from attnpool.kernels.sparse import launch_problem as sparse_launch_problem
from attnpool.model import ModelConfig, ModelSpec, model_spec
from attnpool.model.float8_options import float8_problem
from attnpool.model.loss_kernels import resolve_loss_kernel
from attnpool.parallel import ParallelDims, tensor_parallel_problem
from attnpool.parallel.float8 import float8_all_gather_problem
from attnpool.parallel.pipeline import pipeline_problem
from attnpool.parallel.pooled_pipeline import POOLED, pooled_problem
from attnpool.plan import KV_EXCHANGING, AttentionShape, head_chunks_problem, load_cost_model
from attnpool.plan.cost import byte_price_problem, exchange_byte_seconds
from attnpool.kinds import AttentionKind, plan_windows
from attnpool.plan.plan import Topology, inter_node_byte_cost
from attnpool.plan.ulysses import ulysses_problem
from attnpool.sparse import SparseConfig
from attnpool.sparse.cost import SparsePrior
from attnpool.train.config import TrainConfig
from attnpool.train.sections import MEASURED


@dataclass(frozen=True, eq=False)
class RunSpec:
    """A run, resolved (see the module docstring). Frozen: what it holds is decided once."""

    config: TrainConfig  # the settings as given
    model: ModelSpec
    dims: ParallelDims
    device_type: str  # "cuda" or "cpu": the kind of device the run computes on
    device: torch.device | None  # this rank's; None where resolved without one
    backend_name: str  # core attention's kernel; "auto" only where resolved without a device
    backend: Backend | None  # the kernel object core attention calls; None where resolved without a device
    loss_kernel: str  # chunked or liger
    bf16: bool  # bf16 compute (FSDP2 mixed precision, autocast); float32 master weights either way
    attention_shape: AttentionShape  # what a token's Q, K+V and O weigh in a tp rank's core attention
    # whether the backend lacks a position kernel here (not Backend.serves_positions), so that a server copies key
    # prefixes where a document of its would take one call at its queries' positions (plan.metrics.AttentionRows)
    prefix_copies: bool
    cost_model: object  # the planner's cost of a CA-task on a tp rank's heads
    sparse: SparseConfig | None  # vertical-slash options (their cost coefficients read), None for dense
    topology: Topology | None = None  # the dp ranks' nodes, where they span several (attention_topology)
    layer_kinds: tuple[AttentionKind, ...] = ()  # each layer's attention kind (the model's; attnpool.kinds)
    # activation_checkpointing auto, resolved on a rank (train.memory_check.resolve_auto_checkpointing): each layer's
    # mode, by layer index, and whether it turned activation offload on. Empty where the config names one mode.
    layer_checkpointing: tuple[str, ...] = ()
    auto_offload: bool = False
    # pp_schedule auto, resolved (train.schedule_choice.resolve_pp_schedule): what it chose and why; None where the
    # config names a schedule
    schedule_choice: object = None

    @property
    def relay_nodes(self) -> tuple[int, ...] | None:
        """Each dp rank's node where core attention's KV goes through the hierarchical exchange
        (``hierarchical_exchange``), else None."""
        if not self.config.parallel.hierarchical_exchange or self.topology is None:
            return None
        return self.topology.rank_node

    @property
    def pp_schedule(self) -> str:
        """The pipeline schedule the run uses: the config's, or auto's choice."""
        return self.schedule_choice.chosen if self.schedule_choice is not None else self.config.parallel.pp_schedule

    # What parallelize reads besides (attnpool.parallel.parallelize.ParallelizeSpec), as the settings give it.
    @property
    def activation_checkpointing(self) -> str | tuple[str, ...]:
        """The checkpointing mode of every layer, or auto's choice: each layer's mode, by layer index."""
        return self.layer_checkpointing or self.config.memory.activation_checkpointing

    @property
    def activation_offload(self) -> bool:
        return self.config.memory.activation_offload or self.auto_offload

    compile = property(lambda self: self.config.model.compile)
    # float8's recipe where the linear layers run in float8 (attnpool.parallel.float8), else None
    float8 = property(lambda self: self.config.model.float8_recipe if self.config.model.float8 else None)
    float8_all_gather = property(lambda self: self.config.model.float8_all_gather)
    pingpong = property(lambda self: self.config.attention.pingpong)
    head_chunks = property(lambda self: self.config.attention.head_chunks)

    @property
    def byte_seconds(self) -> float:
        """cad's price of a byte of its exchanges in seconds of attention work (exchange_gibps; 0 where unset): the
        layers whose checkpointing recomputes attention exchange their forward's bytes once more, and ping-pong or
        head groups hide part of each exchange (plan.cost.exchange_byte_seconds)."""
        gibps = given_rate(self.config.attention.exchange_gibps)
        if gibps is None:  # (auto before the run measures it, as the memory check samples plans: balancing)
            return 0.0
        modes = self.activation_checkpointing
        modes = [modes] if isinstance(modes, str) else list(modes)
        # (auto not yet resolved, as the memory check samples plans: priced as full, what it picks at long context)
        recomputed = sum(mode in ("full", "auto") for mode in modes) / len(modes)
        return exchange_byte_seconds(gibps, recomputed, self.pingpong or self.head_chunks > 1)
    optimizer_offload = property(lambda self: self.config.memory.optimizer_offload)

    @property
    def tokens_multiple(self) -> int:
        """Every dp rank's tokens are padded to a multiple of this (tensor parallelism's sequence shards)."""
        return self.dims.tp

    @property
    def padded_tokens(self) -> int:
        """A dp rank's tokens per micro-batch after the padding (what pipeline stages exchange)."""
        tokens = self.config.data.tokens_per_rank
        return tokens + (-tokens) % self.tokens_multiple

    @property
    def pooled(self) -> bool:
        """Pipeline stages whose core attention is pooled over every stage's ranks (pp_schedule: pooled)."""
        return self.dims.pp > 1 and self.pp_schedule == POOLED

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def stage_hidden(self) -> tuple[int, int]:
        """The hidden states a pipeline stage passes on, per tp rank: its sequence shard of a micro-batch."""
        return self.padded_tokens // self.dims.tp, self.model.config.dim

    @property
    def plan_windows(self) -> tuple[int | None, ...]:
        """The windows a micro-batch is planned for: one plan each (attnpool.kinds.plan_windows)."""
        return plan_windows(self.layer_kinds) or (None,)

    def prefix_copies_of(self, kind: AttentionKind) -> bool:
        """Whether core attention copies key prefixes in the layers of ``kind`` where a document would take a
        position call: where the backend has no position kernel (``prefix_copies``), and where its position
        kernel does not take the kind's window or soft-cap (fa4's: Backend.for_kind leaves it out)."""
        if self.prefix_copies or kind.causal:
            return self.prefix_copies
        return backend_named(self.backend_name).for_kind(kind.window, kind.softcap).positions is None

    @property
    def mixed_kinds(self) -> bool:
        """Whether core attention runs per layer kind (runtime.LayerKinds): some layer is not plain causal."""
        return any(not kind.causal for kind in self.layer_kinds)

    def new_sparse_prior(self) -> SparsePrior | None:
        """A fresh planning prior of the sparse work (a run keeps one and updates it every step); None for dense."""
        if self.sparse is None:
            return None
        shape = self.attention_shape
        return SparsePrior(self.sparse, shape.n_q_heads, shape.head_dim, self.model.config.n_layers)


def resolve_run_spec(config: TrainConfig, world: int, device: torch.device | None = None,
                     device_type: str | None = None) -> RunSpec:
    """``config`` resolved for ``world`` ranks on ``device`` (a rank's), or without one for ``device_type``
    (default: the configured device, or this machine's; given, the run is planned for another machine, whose
    installed packages are not this one's to check). Refused with a ConfigError naming the key where the
    model's shape or the device cannot run it."""
    try:
        model = model_spec(config.model.name, config.model.args, config.data.max_doc_len, config.model.impl)
    except ConfigError as exc:  # name what the user typed: --model-args KEY
        if exc.field in config.model.args:
            raise ConfigError(f"model_args.{exc.field}", exc.value, exc.problem) from None
        raise
    dims = ParallelDims.of(world, config.parallel.tp, config.parallel.pp)  # (first: a layout the ranks cannot take)
    check_model_shape(config, model.config)
    here = device is not None or device_type is None
    device_type = device_kind(config, device, device_type)
    bf16 = uses_bf16(config, device_type)
    backend_name = attention_backend(config, device, device_type)
    backend = get_backend(backend_name, device) if device is not None else None  # (a name, never "auto", here)
    if config.model.float8:  # (without a device the GPU's capability and torchao's import are left to the ranks)
        gpu = device is not None and device.type == "cuda"
        problem = float8_problem(device_type, torch.cuda.get_device_capability(device) if gpu else None) \
            if device is not None or device_type != "cuda" else None
        if problem:
            raise ConfigError("float8", True, problem)
    if config.model.float8_all_gather:  # (after float8 itself: a GPU without float8 is the first thing to say)
        problem = float8_all_gather_problem(model.config, dims.dp, dims.tp)
        if problem is not None:
            raise ConfigError("float8_all_gather", True, problem)
    loss_kernel = config.model.loss_kernel
    if device is not None or loss_kernel == "auto":  # (without a device, liger's import is left to the ranks)
        loss_kernel = resolve_loss_kernel(loss_kernel, device_type, dims.tp)
    m = model.config
    shape = AttentionShape(m.n_heads // dims.tp, m.n_kv_heads // dims.tp, m.head_dim, 2 if bf16 else 4)
    problem = head_chunks_problem(config.attention.head_chunks, shape.n_kv_heads, shape.n_q_heads)
    if problem:
        raise ConfigError("head_chunks", config.attention.head_chunks,
                          f"{problem} ({model.name}'s {m.n_kv_heads} KV and {m.n_heads} query heads"
                          + (f" over tp={dims.tp})" if dims.tp > 1 else ")"))
    if config.attention.strategy == "ulysses":
        problem = ulysses_problem(dims.dp, shape.n_q_heads, shape.n_kv_heads)
        if problem:
            raise ConfigError("attention", "ulysses", problem)
    cost_model = load_cost_model(config.attention.cost_model, backend=backend_name)
    if config.attention.exchange_gibps is not None and byte_price_problem(cost_model):
        raise ConfigError("exchange_gibps", config.attention.exchange_gibps, byte_price_problem(cost_model))
    if dims.tp > 1 and hasattr(cost_model, "scaled_to"):  # a server's cost is its heads' share of a task's
        cost_model = cost_model.scaled_to(shape.n_q_heads, shape.head_dim)
    kinds = check_layer_kinds(config, m, dims, backend_name, backend)
    return RunSpec(config, model, dims, device_type, device, backend_name, backend, loss_kernel, bf16, shape,
                   not serves_positions(backend_name, device, m.head_dim), cost_model,
                   check_sparse(config, m, device, device_type, here), attention_topology(config, dims, world), kinds)


def context_note(config: TrainConfig, model, dp: int) -> str | None:
    """A line for the run's start where documents may be longer than the context a checkpoint's weights were trained
    for (its config.json's max_position_embeddings): positions past it are ones the model never saw unless its RoPE
    is scaled for them, which a context extension sets with ``--model-args``. None for random weights (a preset, or a
    config.json alone) and where every document fits."""
    trained = getattr(model.config, "max_position", None)
    if not getattr(model, "has_weights", False) or trained is None:
        return None
    longest, why = config.data.max_doc_len, "data.max_doc_len"
    if longest is None:  # without a cap a document may fill a step
        longest = dp * config.parallel.microbatches * config.data.tokens_per_rank
        why = "no data.max_doc_len: a document may fill the step"
    if longest <= trained:
        return None
    return (f"{model.name}: documents up to {longest:,} tokens ({why}) pass its max_position_embeddings {trained:,}; "
            f"to extend its context give --model-args rope_scaling=... max_position_embeddings={longest} (docs/"
            f"models-and-data.md, 'Extend the context of your model'), or --max-doc-len {trained} to cut documents "
            "to it")


def check_layer_kinds(config: TrainConfig, m: ModelConfig, dims: ParallelDims, backend_name: str,
                      backend: Backend | None) -> tuple[AttentionKind, ...]:
    """The model's layer kinds, refused by name where the run cannot compute them: sparse attention and the
    pooled pipeline plan causal attention only, and the kernel backend must compute each kind (Backend.for_kind; a
    rank resolves "auto" to a backend before this, so only a spec made without a device leaves it unasked)."""
    kinds = m.layer_kinds()
    other = sorted({kind.describe() for kind in kinds if not kind.causal})
    if not other:
        return kinds
    if config.sparse.mode != "none":
        raise ConfigError("sparse", config.sparse.mode, f"sparse attention computes causal attention only; the model's "
                                                        f"layers have {'; '.join(other)}")
    if dims.pp > 1 and config.parallel.pp_schedule == POOLED:
        raise ConfigError("pp_schedule", POOLED, f"the pooled pipeline plans causal attention only; the model's "
                                                 f"layers have {'; '.join(other)} (use 1f1b)")
    if backend_name != "auto":  # (resolved without a device: the ranks resolve it)
        chosen = backend if backend is not None else backend_named(backend_name)
        for kind in dict.fromkeys(kinds):
            try:
                chosen.for_kind(kind.window, kind.softcap)
            except ConfigError as error:
                raise ConfigError("attention_backend", backend_name, f"{error.problem} (the model's layers have "
                                                                     f"{kind.describe()})") from None
    return kinds


def attention_topology(config: TrainConfig, dims: ParallelDims, world: int) -> Topology | None:
    """The nodes of a stage's dp ranks (each a tp group, inside one node), ``ranks_per_node`` to a node (0:
    torchrun's LOCAL_WORLD_SIZE, else all on one), counted on the first stage's ranks (every stage's plans
    alike); None where they are all on one node."""
    per_node = ranks_per_node(config, world)
    if world % per_node or per_node % dims.tp:
        raise ConfigError("ranks_per_node", per_node, f"must divide the {world} ranks, and be a multiple of "
                                                      f"tp={dims.tp} (a tp group stays inside a node)")
    topology = Topology(tuple(i * dims.tp // per_node for i in range(dims.dp)),
                        inter_node_byte_cost(given_rate(config.attention.exchange_gibps),
                                             given_rate(config.parallel.inter_node_gibps)),
                        relays=config.parallel.hierarchical_exchange)
    if config.parallel.hierarchical_exchange:
        if config.attention.strategy not in KV_EXCHANGING:
            raise ConfigError("hierarchical_exchange", True, f"attention {config.attention.strategy} exchanges "
                                                             "heads, not KV rows, so nothing would be relayed (it "
                                                             f"applies to {', '.join(KV_EXCHANGING)})")
        if topology.num_nodes == 1:
            raise ConfigError("hierarchical_exchange", True, f"the attention's {dims.dp} ranks are on one node "
                                                             f"(ranks_per_node={per_node}): nothing crosses between nodes")
        if dims.pp > 1 and (dims.dp * dims.tp) % per_node:
            raise ConfigError("hierarchical_exchange", True, f"a pipeline stage's {dims.dp * dims.tp} ranks do not fill "
                                                             f"whole nodes of {per_node}: later stages' ranks would "
                                                             "not be on the nodes the first stage's are counted on")
        if dims.pp > 1 and config.parallel.pp_schedule == POOLED:
            raise ConfigError("hierarchical_exchange", True, "the pooled pipeline's attention spans every stage's "
                                                             "ranks and exchanges flat; use pp_schedule 1f1b")
    return topology if topology.num_nodes > 1 else None


def given_rate(gibps: float | str | None) -> float | None:
    """A link's rate as the planner takes it: the number given, None where unset or not yet measured (auto)."""
    return None if gibps == MEASURED else gibps


def measures_links(config: TrainConfig) -> bool:
    """Whether the run leaves a link's rate to its start (exchange_gibps or inter_node_gibps auto)."""
    return MEASURED in (config.attention.exchange_gibps, config.parallel.inter_node_gibps)


def links_to_measure(spec: RunSpec) -> tuple[bool, bool]:
    """(the link inside a node, the link between nodes): which rates left to measurement (auto) the run's plans
    would use, so that its start measures them. cad prices bytes, and needs two servers to move any (dp ranks, or
    every stage's under the pooled schedule); a byte between nodes is priced where its dp ranks span nodes, which
    the pooled schedule's flat exchange does not (attention_topology). An auto a run would not use is unset."""
    config = spec.config
    servers = spec.dims.dp * (spec.dims.pp if spec.pooled else 1)
    cad = config.attention.strategy == "cad" and servers > 1
    return (cad and config.attention.exchange_gibps == MEASURED,
            cad and config.parallel.inter_node_gibps == MEASURED and spec.topology is not None and not spec.pooled)


def with_measured_links(spec: RunSpec, world: int, inside_gibps: float | None,
                        between_gibps: float | None) -> RunSpec:
    """``spec`` with the rates its config leaves to measurement (auto) set to the measured ones, GiB/s per GPU of
    the link inside a node and between nodes (None: not measured, unset), and its topology priced by them."""
    changed = {key: rate for key, setting, rate in (
        ("exchange_gibps", spec.config.attention.exchange_gibps, inside_gibps),
        ("inter_node_gibps", spec.config.parallel.inter_node_gibps, between_gibps)) if setting == MEASURED}
    if not changed:
        return spec
    config = spec.config.replace(**changed)
    return dataclasses.replace(spec, config=config, topology=attention_topology(config, spec.dims, world))


def link_rates(config: TrainConfig, spec: RunSpec) -> dict:
    """The links' rates cad's planner priced its bytes at (GiB/s per GPU, or None) as ``spec`` runs ``config``, and
    whether each was measured at the run's start (auto): what the run's summary and bench records keep."""
    used = spec.config
    return {"exchange_gibps": used.attention.exchange_gibps,
            "exchange_gibps_measured": config.attention.exchange_gibps == MEASURED
            and used.attention.exchange_gibps is not None,
            "inter_node_gibps": used.parallel.inter_node_gibps,
            "inter_node_gibps_measured": config.parallel.inter_node_gibps == MEASURED
            and used.parallel.inter_node_gibps is not None}


def ranks_per_node(config: TrainConfig, world: int) -> int:
    """The ranks of one node: ``ranks_per_node``, else torchrun's LOCAL_WORLD_SIZE, else all ``world`` on one."""
    return config.parallel.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))


def check_model_shape(config: TrainConfig, m: ModelConfig) -> None:
    """Refuse the parallel layout where the model's shape cannot take it: heads tp must divide, layers for
    pipeline stages, what the pooled schedule needs."""
    p = config.parallel
    problem = tensor_parallel_problem(m, p.tp)
    if problem is not None:
        raise ConfigError("tp", p.tp, problem)
    problem = pipeline_problem(m, p.pp, p.pp_schedule, p.microbatches)
    if problem is not None:
        raise ConfigError(*problem)
    if p.pp > 1 and p.pp_schedule == POOLED:
        problem = pooled_problem(config.memory.activation_checkpointing, config.sparse.mode != "none")
        if problem is not None:
            raise ConfigError(*problem)


def attention_backend(config: TrainConfig, device: torch.device | None = None, device_type: str | None = None) -> str:
    """The kernel backend (attnpool.kernels) of this run's core attention, refused with a ConfigError naming
    attention_backend where it cannot run: fa4 without flash_attn.cute or on a GPU older than sm90, fa4 or
    flash on the CPU or in float32. ``device``: the rank's; None in a launcher, which must not touch its GPUs
    and only refuses what the device kind and precision decide ("auto" then stays "auto"). ``device_type``:
    the kind, where no device is given (default: the configured one, or this machine's)."""
    name = config.attention.backend
    device_type = device_kind(config, device, device_type)
    bf16 = uses_bf16(config, device_type)
    if name in ("fa4", "flash") and device_type == "cuda" and not bf16:
        raise ConfigError("attention_backend", name, f"the {name} kernels take bf16, and this run computes in float32 "
                                                     f"(precision={config.model.precision}); use reference, or bf16")
    if device is None and device_type == "cuda":
        return name
    # Attention inputs are bf16 on CUDA (autocast) unless precision is fp32; float32 on the CPU.
    dtype = torch.bfloat16 if bf16 and device_type == "cuda" else torch.float32
    resolved = resolve_backend_name(name, device if device is not None else torch.device(device_type), dtype,
                                    field="attention_backend")
    if config.run.deterministic and resolved == "fa4":
        problem = fa4.deterministic_problem(device if device is not None else torch.device(device_type))
        if problem is not None and name == "auto":
            return "flash"  # (FlashAttention-2's backward is deterministic under torch's deterministic algorithms)
        if problem is not None:
            raise ConfigError("deterministic", True, f"{problem}; use attention_backend flash")
    return resolved


def same_attention_backend(backend: str, requested: str) -> None:
    """Refuse, on every rank, a run whose ranks resolved attention_backend to different kernels ("auto" on
    GPUs where fa4 runs on some only): their cost tables, and so their plans, would differ."""
    backends = [None] * dist.get_world_size()
    dist.all_gather_object(backends, backend)
    if len(set(backends)) > 1:
        found = ", ".join(f"rank {r}: {b}" for r, b in enumerate(backends))
        raise ConfigError("attention_backend", requested, f"the ranks run different kernels ({found}); name one "
                                                          "that runs on every rank")


def check_sparse(config: TrainConfig, model_cfg: ModelConfig, device: torch.device | None = None,
                 device_type: str = "cpu", here: bool = True) -> SparseConfig | None:
    """The sparse options (None for dense attention), refused where this model or device cannot run them
    (the CPU twin runs anything); the GPU's kind only when ``device`` is given (see prepare), Triton's presence
    only where the run is ``here`` (not planned for another machine)."""
    sparse = config.sparse.sparse_config()
    if sparse is None:
        return None
    if sparse.dense_layers >= model_cfg.n_layers:
        raise ConfigError("dense_layers", sparse.dense_layers, f"the model has {model_cfg.n_layers} layers, so none "
                                                               "would be sparse; use --sparse none for dense attention")
    if device_type == "cuda":
        if here and importlib.util.find_spec("triton") is None:
            raise ConfigError("sparse", sparse.mode, "the sparse kernels need Triton on CUDA, and it is not installed")
        problem = sparse_device_problem(device) if device is not None and device.type == "cuda" else None
        if problem is not None:
            raise ConfigError("sparse", sparse.mode, str(problem))
        # Attention runs in bf16 on CUDA unless --precision fp32 (see uses_bf16).
        problem = sparse_launch_problem(model_cfg.head_dim, 4 if config.model.precision == "fp32" else 2, sparse.block,
                                        sparse.vertical_chunk)
        if problem is not None:
            raise ConfigError("sparse", sparse.mode, str(problem))
    return sparse


def device_kind(config: TrainConfig, device: torch.device | None, device_type: str | None) -> str:
    """The kind of device a run computes on: the rank's device's, else ``device_type``, else the configured one."""
    return device.type if device is not None else device_type or configured_device_type(config)


def uses_bf16(config: TrainConfig, device_type: str) -> bool:
    """bf16 compute (FSDP2 mixed precision, autocast): asked for, or by default on CUDA."""
    return config.model.precision == "bf16" or (config.model.precision == "auto" and device_type == "cuda")


def configured_device_type(config: TrainConfig) -> str:
    """The configured device kind; for "auto", this machine's (CUDA where a GPU is visible)."""
    if config.run.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda", "no CUDA device is available")
    return config.run.device


def rank_device(config: TrainConfig) -> torch.device:
    """This rank's device: its local GPU (LOCAL_RANK), or the CPU."""
    if configured_device_type(config) == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
