"""Peak GPU memory per rank of a training configuration, predicted before anything is allocated.

The prediction adds up what the training step holds, term by term, from the model's dimensions and the
code's own choices (what autograd saves under each ``activation_checkpointing`` mode, the loss's chunk,
FSDP2's copies), then takes the largest of the moments a step's memory can peak:

- the loss's backward (every layer's saved activations still held, plus one chunk of logits and their
  gradient; with several micro-batches, the gradients accumulated so far);
- the backward of each layer (the activations of the layers before it, plus that layer's recompute and core
  attention's backward buffers, and the sharded gradients of the layers after it with the float32 copy of the
  next one's); under pipeline stages, those of a stage's last and first layer;
- the optimizer step (parameters, gradients and AdamW's two moments).

Persistent state: FSDP2 keeps each parameter sharded over the ``dp`` ranks in float32, its gradient
likewise, and AdamW two float32 moments: 16 bytes per parameter / dp; ``optimizer_offload`` moves all
three to host memory (FSDP2's ``CPUOffloadPolicy``). For compute, FSDP2 gathers a layer's parameters in
the compute dtype (bf16 under mixed precision) while it runs, the next one prefetched, and the root's
(embedding, output projection, final norm) for the whole forward and backward. Tensor and pipeline
parallelism enter as mesh sizes: ``tp`` divides every layer's parameters and, with sequence
parallelism, every per-token activation but the norms' gathered outputs; ``pp`` splits the layers into
stages, the first of which holds the most layers (``rank_layers``) and ``in_flight`` micro-batches'
activations (1F1B: up to pp). With several micro-batches per step FSDP2 reduces gradients once, after the
last: until then each rank keeps its layers' whole float32 gradients. These follow the standard
arithmetic; the 4 x H200 runs in bench/results/2026-11-26-h200x4-parallel.md check them (tp 2 and 4,
pp 2 x tp 2, 1F1B and pooled at pp 2 x dp 2: within 9% of the measured peaks).

Core attention's buffers depend on the plan: a server holds the Q rows it serves, the unique KV rows
they need and, for backward, the outputs it returned to other ranks. :class:`RowRatios` gives these per
home token for the busiest rank, from plans of sampled batches (``train.memory_check.sample_row_ratios``).

What the hand count misses (autograd's and the kernels' workspaces, allocator rounding) is a fitted
residual per checkpointing mode, ``per_token * tokens + constant``, and the caching allocator's
fragmentation a fitted ratio of reserved to allocated bytes; both come from a calibration measured on
one GPU by varying layers and tokens (``bench/gpu_memory.py``; the packaged one is an H200's,
``resources/memory_calibration.json``). ``peak_bytes`` is what the device must hold: the allocator's
reserved peak plus the CUDA context, which lives outside the allocator.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from itertools import accumulate

from attnpool.errors import ConfigError
from attnpool.model.config import ModelConfig, model_config
from attnpool.model.llama import loss_chunk_tokens
from attnpool.parallel.checkpointing import LINEAR_CHUNK_TOKENS
from attnpool.parallel.checkpointing import MODES as CHECKPOINTING_MODES
from attnpool.runtime.dispatch import BACKWARD_GROUP_KEYS

GiB = 1 << 30
# activation_checkpointing: auto, each layer's mode chosen by the memory model (memory_fit.auto_checkpointing)
AUTO = "auto"
# The checkpointing modes each kind of layer module runs (keep_attention recomputes attnpool's own linear parts).
LAYER_CHECKPOINTING = {"attnpool": CHECKPOINTING_MODES, "transformers": ("none", "full")}
CALIBRATION_RESOURCE = "memory_calibration.json"
# A CPU rank's own memory before any tensor: Python, torch, gloo (407-530 MiB resident per rank of the tiny model)
CPU_PROCESS_BYTES = 400 << 20
# The model the packaged calibration was fitted on (bench/gpu_memory.py: its dimensions, 2 layers)
CALIBRATION_MODEL = model_config("llama3-8b")
# Bytes a parameter costs on its owner: float32 master weight, float32 gradient, AdamW's two moments.
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8


@dataclass(frozen=True)
class RowRatios:
    """Core attention's rows on a rank, per token of ``tokens_per_rank``: tokens held (wlb holds up to
    memory_cap), query rows served, of them served for other ranks, unique and expanded KV rows
    (plan.metrics.AttentionRows). Sampled (``train.memory_check.sample_row_ratios``): one rank's in one plan, or each
    count's largest over the ranks and plans, a bound."""

    home: float = 1.0
    query: float = 1.0
    returned: float = 0.0
    unique_kv: float = 1.0
    expanded_kv: float = 1.0
    batches: int = 0  # plans they were taken from; 0: not sampled, the fewest rows any plan holds

    def counts(self) -> tuple[float, ...]:
        return self.home, self.query, self.returned, self.unique_kv, self.expanded_kv


def undominated(candidates) -> tuple[RowRatios, ...]:
    """The candidates no other one matches or exceeds in every row count (the only ones that can hold a
    rank's largest peak, since every term grows with each count); the first of equal ones kept."""
    kept = []
    for i, r in enumerate(candidates):
        if not any(all(a >= b for a, b in zip(o.counts(), r.counts())) and (o.counts() != r.counts() or j < i)
                   for j, o in enumerate(candidates) if j != i):
            kept.append(r)
    return tuple(kept)


@dataclass(frozen=True)
class MemoryInputs:
    """What a prediction depends on."""

    model: ModelConfig
    tokens_per_rank: int
    activation_checkpointing: str = "none"  # one of CHECKPOINTING_MODES for every layer, or AUTO: layer_modes
    activation_offload: bool = False
    optimizer_offload: bool = False
    bf16: bool = True  # bf16 compute (FSDP2 mixed precision, autocast); False: float32 throughout
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1  # per step, gradients accumulated over them
    in_flight: int = 1  # micro-batches whose activations a pipeline rank holds at once (parallel.pipeline)
    rank_layers: int = 0  # layers the busiest pipeline rank holds (parallel.pipeline.rank_layers); 0: n_layers / pp
    stage_layers: int = 0  # layers of its largest stage, what one in-flight unit holds; 0: rank_layers
    rows: RowRatios = field(default_factory=RowRatios)
    # Each sampled plan's rank rows (undominated ones); when given, the estimate is the largest over them,
    # and ``rows`` (their elementwise bound, which may combine two ranks' worst counts) is only shown.
    row_candidates: tuple[RowRatios, ...] = ()
    # What a rank holds at once when its in-flight units' rows differ (a pooled pipeline: every tick's,
    # summed, its idle ticks holding only the rows they served); None: ``in_flight`` units of ``rows``.
    # ``rows`` then stays the bound of one unit, for the transients of one unit's backward.
    held_rows: RowRatios | None = None
    held_candidates: tuple[RowRatios, ...] = ()  # as row_candidates, for held_rows
    loss_kernel: str = "chunked"  # or liger (attnpool.model.fused_loss): the loss's transient memory differs
    layer_modules: str = "attnpool"  # or transformers (the adapter's layers: ModelSpec.layer_modules)
    compiled: bool = False  # the layers' linear parts under torch.compile (attnpool.parallel.compile)
    # Whether core attention's backward runs over all of a rank's keys in one kernel call (ulysses,
    # runtime.ulysses), rather than in groups of at most BACKWARD_GROUP_KEYS (runtime.dispatch)
    backward_in_one_call: bool = False
    # Under pipeline stages (not pooled): the last pipeline rank's layers, largest stage and micro-batches in flight
    # (0 layers: no estimate of the ends apart, the first's activations with the last's loss, as for pooled), and
    # which end of the pipeline an estimate is of ("": both, the larger of the two)
    last_rank_layers: int = 0
    last_stage_layers: int = 0
    last_in_flight: int = 0
    pipeline_end: str = ""
    # Under AUTO, each of the rank's layers' mode in forward order (auto_checkpointing's choice; layers that differ
    # only without pipeline stages). Empty for any other setting, or for AUTO not chosen yet (nothing to estimate).
    layer_modes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.activation_checkpointing not in (*CHECKPOINTING_MODES, AUTO):
            raise ConfigError("activation_checkpointing", self.activation_checkpointing,
                              f"choose one of {', '.join(CHECKPOINTING_MODES)} or {AUTO}")
        if self.layer_modes and self.activation_checkpointing != AUTO:
            raise ValueError(f"layer_modes are {AUTO}'s choice, not {self.activation_checkpointing}'s")
        if any(mode not in LAYER_CHECKPOINTING.get(self.layer_modules, ()) for mode in self.layer_modes):
            raise ValueError(f"layer_modes {self.layer_modes}: {self.layer_modules} layers run "
                             f"{', '.join(LAYER_CHECKPOINTING.get(self.layer_modules, ()))}")
        if len(set(self.layer_modes)) > 1 and self.pp > 1:
            raise ValueError("layers with different checkpointing modes are counted without pipeline stages only")
        if self.layer_modules not in LAYER_CHECKPOINTING:
            raise ConfigError("layer_modules", self.layer_modules,
                              f"the memory model counts {', '.join(LAYER_CHECKPOINTING)} layers")
        if self.loss_kernel not in ("chunked", "liger"):  # (resolved: auto is the run's choice)
            raise ConfigError("loss_kernel", self.loss_kernel, "the memory model counts chunked or liger")
        for name in ("tokens_per_rank", "dp", "tp", "pp", "microbatches", "in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be at least 1")

    @property
    def setting(self) -> str:
        """The memory-relevant choices, as config keys (auto's choice after it)."""
        auto = f" ({describe_layer_modes(self.layer_modes)})" if self.layer_modes else ""
        parts = [f"activation_checkpointing={self.activation_checkpointing}{auto}"]
        parts += [f"{name}=true" for name in ("activation_offload", "optimizer_offload") if getattr(self, name)]
        return " ".join(parts)


@dataclass(frozen=True)
class Calibration:
    """The measured corrections (see the module docstring)."""

    residual_per_token: dict  # mode -> bytes per home token
    residual_constant: dict  # mode -> bytes
    fragmentation: float  # reserved / allocated at the peak
    cuda_context_bytes: int  # what the device holds outside the allocator (on CPU: the process's own memory)
    source: str = "hand count only"
    context_name: str = "CUDA context"

    @classmethod
    def none(cls) -> "Calibration":
        zero = {mode: 0.0 for mode in CHECKPOINTING_MODES}
        return cls(dict(zero), dict(zero), 1.0, 0)

    @classmethod
    def cpu(cls) -> "Calibration":
        """A CPU rank's: the hand count, and the process's own memory before any tensor (Python, torch, gloo)."""
        return replace(cls.none(), cuda_context_bytes=CPU_PROCESS_BYTES, source="hand count and a CPU process's own",
                       context_name="process (Python, torch, gloo)")

    @classmethod
    def load(cls, path: str | None = None) -> "Calibration":
        """The packaged calibration, or one written by bench/gpu_memory.py."""
        if path is None:
            text = resources.files("attnpool.resources").joinpath(CALIBRATION_RESOURCE).read_text()
            where = CALIBRATION_RESOURCE
        else:
            try:
                with open(path) as fh:
                    text = fh.read()
            except OSError as exc:
                raise ConfigError("memory_calibration", path, f"cannot be read ({exc.strerror})") from None
            where = path
        try:
            data = json.loads(text)
            return cls(residual_per_token={m: float(data["residual_per_token"][m]) for m in CHECKPOINTING_MODES},
                       residual_constant={m: float(data["residual_constant"][m]) for m in CHECKPOINTING_MODES},
                       fragmentation=float(data["fragmentation"]),
                       cuda_context_bytes=int(data["cuda_context_bytes"]),
                       source=str(data.get("source", where)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError("memory_calibration", where, f"is not a memory calibration ({exc!r})") from None


@dataclass
class MemoryEstimate:
    inputs: MemoryInputs
    phase: str  # the moment of the peak
    breakdown: dict  # bytes per term at that moment; sums to peak_bytes
    allocated_bytes: int  # the allocator's peak (torch.cuda.max_memory_allocated)
    peak_bytes: int  # what the GPU must hold: reserved memory at the peak plus the CUDA context
    host_bytes: int  # host memory the offloads hold per rank

    def to_dict(self) -> dict:
        out = asdict(self)
        out["inputs"]["model"] = asdict(self.inputs.model)
        return out


# --- The hand count ------------------------------------------------------------------------------------


def root_params(m: ModelConfig, pp: int = 1) -> tuple[int, int]:
    """(first stage's, last stage's) parameters outside the layers: the embedding; the output
    projection (tied: the embedding itself, or under pipeline stages the last one's copy of it) and final
    norm. With one stage, both on it."""
    head = 0 if m.tie_embeddings and pp == 1 else m.vocab_size * m.dim
    return m.vocab_size * m.dim, head + m.dim


def saved_per_layer(x: MemoryInputs, mode: str | None = None) -> dict[str, float]:
    """Bytes one layer keeps from its forward to its backward, per home token, by what holds them, under checkpointing
    ``mode`` (None: x's, one for every layer).

    keep_attention: the layer's input (the linear parts' checkpoints keep it, as views) and what core
    attention saves: the server's Q rows and float32 LSE, its unique K and V rows, the rank's output,
    and the outputs it returned to other ranks. full: the layer's input alone. none: additionally
    each norm's input and float32 reciprocal RMS, each norm's output (the next projections' input),
    the attention block's sum, and the MLP's four ffn_dim-wide intermediates; where the family has them, the
    q/k norms' and the output norms' inputs and statistics (their outputs feed RoPE and the residual sum).
    Compiled (``compiled``), the MLP keeps three: the gate's and the up projection's outputs and their product,
    the activation recomputed in backward (what Inductor's partition saves, counted by the same hook on CPU;
    on 4 x H200 compile lowered auto's peak by the 7.0 GiB this makes of its two ``none`` layers at 128K tokens).
    transformers' layers (the adapter: ``layer_modules``) keep more in their norms (transformers_norms_kept).

    Per token of the dp rank, before ``estimate`` divides by tp: under tensor parallelism every term is
    split over the tp ranks (by sequence or by heads) but the norms' outputs, which sequence parallelism
    gathers to the whole sequence before the projections that save them (counted tp times here)."""
    m, r = x.model, x.rows
    a = 2 if x.bf16 else 4
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    attention = {
        "attention query": a * q * r.query / r.home,
        "attention lse": 4 * m.n_heads * r.query / r.home,
        "attention key/value": 2 * a * kv * r.unique_kv / r.home,
        "attention output": a * q,
        "attention returned output": a * q * r.returned / r.home,
    }
    mode = mode or x.activation_checkpointing
    if mode == "full":
        return {"layer input": a * m.dim}
    if mode == "keep_attention":
        return {"layer input": a * m.dim, **attention}
    if x.layer_modules == "transformers":
        return {**transformers_norms_kept(x), **attention, "mlp intermediates": 4 * a * m.ffn_dim}
    n = 4 if m.norm_offset else a  # Gemma's norms compute in float32: they keep float32 copies of their inputs
    kept = {"layer input": n * m.dim, "norm statistics": 2 * 4.0, "norm outputs": 2 * a * m.dim * x.tp,
            "attention sum": n * m.dim, **attention, "mlp intermediates": (3 if x.compiled else 4) * a * m.ffn_dim}
    if m.qk_norm:  # (Qwen3, Gemma 3) each head's norm keeps its input and float32 reciprocal RMS
        kept["q/k norm inputs"] = n * (q + kv) + 4.0 * (m.n_heads + m.n_kv_heads)
    if m.sandwich_norms:  # (Gemma 2, 3) the norms of attention's and the MLP's outputs: their inputs, statistics
        kept["output norm inputs"] = 2 * n * m.dim + 2 * 4.0
    return kept


def transformers_norms_kept(x: MemoryInputs) -> dict[str, float]:
    """What transformers' norms keep in one decoder layer (checkpointing none), per token: each RMSNorm computes in
    float32 (x.float() * rsqrt(mean(x^2) + eps)) and keeps its float32 input, its statistic and its normalized
    input, the latter cast back before the weight's product (Llama, Qwen) or still float32 for Gemma's (1 + w);
    the projections keep the two pre-norms' outputs (the sandwich norms' outputs go to the residual sum, which
    keeps nothing), and the q/k norms' outputs go to RoPE, which keeps only its cos and sin (the step's)."""
    m = x.model
    a = 2 if x.bf16 else 4
    normalized = 4 if m.norm_offset else a
    norms = 4 if m.sandwich_norms else 2
    kept = {"norm inputs (float32)": norms * 4 * m.dim, "norm statistics": norms * 4.0,
            "normalized norm inputs": norms * normalized * m.dim, "norm outputs": 2 * a * m.dim}
    if m.qk_norm:
        heads = (m.n_heads + m.n_kv_heads) * m.head_dim
        kept["q/k norm inputs"] = (4 + normalized) * heads + 4.0 * (m.n_heads + m.n_kv_heads)
    return kept


def step_inputs_per_token(x: MemoryInputs, loss: bool = False) -> float:
    """Bytes per home token the step holds outside the layers: RoPE's float32 cos and sin (a table per kind of
    layer), token ids, positions and labels (int64); until the loss's backward (``loss``) also the final norm's
    input, statistics and output (the loss's input)."""
    m = x.model
    a = 2 if x.bf16 else 4
    tables = len(m.ropes) if m.ropes else 1
    if x.layer_modules == "transformers":  # cos and sin (T, head_dim) in the compute dtype; a transformers norm
        final_norm = (4 + (4 if m.norm_offset else a) + a) * m.dim + 4
        return 2 * a * m.head_dim * tables + 3 * 8 + (final_norm if loss else 0)
    return 4 * m.head_dim * tables + 3 * 8 + ((2 * a * m.dim + 4) if loss else 0)


def loss_transient(x: MemoryInputs, tokens: int) -> float:
    """chunked: one loss chunk in backward: its recomputed logits (the product, its float32 copy under bf16,
    log-softmax) and their gradient (float32, and in bf16 for the product's backward). liger (in the
    forward, where it makes the gradients): the head's weight gradient accumulated in float32, and the
    larger of one chunk of logits (overwritten by their gradient) and the weight gradient's final copy in
    the weight's dtype; the output projection's gradient and the hidden states' are counted beside it."""
    m = x.model
    if x.loss_kernel == "liger":
        a = 2 if x.bf16 else 4
        # Liger's chunk: tokens / ceil(vocab / dim), rounded up to a power of two
        per_chunk = max(1, -(-tokens // -(-m.vocab_size // m.dim)))
        chunk = min(tokens, 1 << (per_chunk - 1).bit_length())
        return 4 * m.vocab_size * m.dim + max(a * chunk * m.vocab_size, a * m.vocab_size * m.dim)
    chunk = min(loss_chunk_tokens(m.vocab_size), tokens)
    per_logit = (2 + 4 + 4 + 4 + 2) if x.bf16 else (4 + 4 + 4)
    return per_logit * chunk * m.vocab_size / x.tp


def held_loss_gradients(x: MemoryInputs, home: float) -> dict[str, float]:
    """Liger's loss keeps the gradients it made in its forward (the weight's, the hidden states') until its backward:
    where a pipeline's last rank runs several micro-batches' forwards before their backwards (GPipe, the pooled
    schedule: all of them; 1F1B: one at a time), the earlier ones' are held at the last one's loss."""
    if x.loss_kernel != "liger" or x.pp == 1:
        return {}
    earlier = (x.microbatches if x.held_rows is not None else min(x.in_flight, x.microbatches)) - 1
    a = 2 if x.bf16 else 4
    return {"earlier micro-batches' loss gradients": earlier * a * (x.model.vocab_size + home) * x.model.dim} \
        if earlier > 0 else {}


def attention_backward_transient(x: MemoryInputs, tokens: int) -> float:
    """Core attention's backward at its peak, inside the kernel's backward: the output and its gradient
    in server order (runtime.core_attention._ServerRows), the kernel's dQ, dK and dV over the expanded
    keys (the unique ones where the backend copies no prefixes: plan.metrics.AttentionRows), and
    FlashAttention's workspace over one call of at most BACKWARD_GROUP_KEYS keys (all of them under
    ``backward_in_one_call``): a float32 dQ
    accumulator and, with GQA, dK and dV for every query head."""
    m, r = x.model, x.rows
    a = 2 if x.bf16 else 4
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    query, expanded = tokens * r.query, tokens * r.expanded_kv
    keys = expanded if x.backward_in_one_call else min(expanded, BACKWARD_GROUP_KEYS)
    return 3 * a * q * query + 2 * a * kv * expanded + 4 * q * min(query, keys) + 2 * a * q * keys


def layer_backward_transient(x: MemoryInputs, tokens: int, mode: str | None = None) -> float:
    """What the backward of one layer adds at its peak, besides the activations kept for it: the gradient
    arriving at the layer, the MLP's weight gradients (computed before core attention's backward), and
    the larger of core attention's backward and the MLP's: under keep_attention a chunk of at
    most LINEAR_CHUNK_TOKENS tokens recomputed and differentiated (four ffn_dim-wide intermediates, three
    gradients) plus the attention output's gradient; under none three ffn_dim-wide gradients of the kept
    intermediates; under full the same, on top of the whole layer recomputed (what none keeps, but its
    input). Under tensor parallelism keep_attention's linear parts are recomputed whole, not in chunks
    (parallel.tensor: a sequence shard and the whole sequence's angles do not split alike)."""
    m = x.model
    a, c = (2, 2) if x.bf16 else (4, 4)
    home = tokens * x.rows.home
    q = m.n_heads * m.head_dim
    incoming = a * m.dim * home
    weight_gradients = c * 3 * m.dim * m.ffn_dim
    attention = attention_backward_transient(x, tokens)
    mode = mode or x.activation_checkpointing
    if mode == "keep_attention":
        chunk = home if x.tp > 1 else min(LINEAR_CHUNK_TOKENS, home)  # (then ffn_dim / tp wide)
        mlp = 7 * a * m.ffn_dim * chunk + a * q * home
        recomputed = 0.0
    else:
        mlp = 3 * a * m.ffn_dim * home
        recomputed = 0.0
        if mode == "full":
            recomputed = (sum(saved_per_layer(x, "none").values()) - a * m.dim) * home
    return (incoming + weight_gradients + recomputed + max(attention, mlp)) / x.tp


# --- The estimate --------------------------------------------------------------------------------------


def pipeline_ends(x: MemoryInputs) -> tuple[MemoryInputs, MemoryInputs]:
    """The inputs of the first and the last pipeline rank's estimates (MemoryInputs.last_rank_layers given)."""
    last = replace(x, pipeline_end="last", rank_layers=x.last_rank_layers,
                   stage_layers=x.last_stage_layers or x.last_rank_layers, in_flight=x.last_in_flight or x.in_flight)
    return replace(x, pipeline_end="first"), last


def _worst(each: list[MemoryEstimate]) -> MemoryEstimate:
    """The device's peak of the worst rank, and the host memory of the worst (another rank's, maybe)."""
    return replace(max(each, key=lambda e: e.peak_bytes), host_bytes=max(e.host_bytes for e in each))


def estimate(x: MemoryInputs, calibration: Calibration | None = None) -> MemoryEstimate:
    """The predicted peak of one rank (the busiest: the rank and sampled plan with the largest attention rows;
    under pipeline stages the larger of the first pipeline rank's, which holds the most micro-batches'
    activations, and the last's, which holds the output projection, its gradient and the loss)."""
    if x.row_candidates or x.held_candidates:
        return _worst([estimate(replace(x, rows=rows, row_candidates=()), calibration) for rows in x.row_candidates]
                      or [estimate(replace(x, held_rows=rows, held_candidates=()), calibration)
                          for rows in x.held_candidates])
    if x.activation_checkpointing == AUTO:
        if not x.layer_modes:
            raise ValueError("activation_checkpointing auto: estimate its choice (auto_checkpointing), not the key")
        if len(set(x.layer_modes)) == 1:  # one mode for every layer: that mode's estimate
            return replace(estimate(replace(x, activation_checkpointing=x.layer_modes[0], layer_modes=()),
                                    calibration), inputs=x)
    if x.pp > 1 and not x.pipeline_end and x.last_rank_layers:  # (pooled: both ends' worst at once, below)
        return _worst([estimate(end, calibration) for end in pipeline_ends(x)])
    return _rank_estimate(x, calibration or Calibration.none())


def _after_first_backward(x: MemoryInputs, unit: float, home: float, held: float, held_home: float) -> tuple:
    """(activations, step inputs, step inputs in the loss's backward) a pipeline rank holds while gradients
    accumulate: from its first micro-batch's backward on, one micro-batch fewer is in flight (where all are at once,
    micro-batches <= stages, the two are not both at their most). ``unit``: one micro-batch's activations of the
    stage, ``home`` its tokens; ``held``, ``held_home``: what a pooled rank holds until its backward ticks start
    (every tick's): one busy tick's less."""
    if x.held_rows is None:
        fewer = min(x.in_flight, x.microbatches - 1)
        activations, tokens = unit * fewer, home * fewer
    else:
        activations, tokens = max(held - unit, 0.0), max(held_home - home, 0.0)
    return activations, step_inputs_per_token(x) * tokens / x.tp, step_inputs_per_token(x, loss=True) * tokens / x.tp


def _rank_estimate(x: MemoryInputs, cal: Calibration) -> MemoryEstimate:
    """estimate() of one rank, one row count, one end of a pipeline."""
    m = x.model
    c = 2 if x.bf16 else 4  # compute copies of parameters and their gradients
    tokens = x.tokens_per_rank
    home = tokens * x.rows.home
    layers = x.rank_layers or math.ceil(m.n_layers / x.pp)
    first_root, last_root = root_params(m, x.pp)
    # the ends of a pipeline hold the embedding and the output projection (the pooled schedule: either)
    root = {"": first_root + last_root if x.pp == 1 else max(first_root, last_root), "first": first_root,
            "last": last_root}[x.pipeline_end]
    has_loss = x.pipeline_end != "first"
    layer = m.layer_params() / x.tp
    root /= x.tp
    owned = (layers * layer + root) / x.dp  # this rank's shard

    per_layer = sum(saved_per_layer(x).values()) * home / x.tp  # one unit's
    stage_layers = x.stage_layers or layers
    saved_layers = stage_layers * x.in_flight
    if x.held_rows is None:
        held_home, held_per_layer = home * x.in_flight, per_layer * x.in_flight
    else:
        held_home = tokens * x.held_rows.home
        held_per_layer = sum(saved_per_layer(replace(x, rows=x.held_rows)).values()) * held_home / x.tp
    # Offloaded, a layer's saved tensors are on the GPU while its backward runs, and the next one's
    # arrive ahead of it (ActivationOffload's prefetch is one layer's worth).
    all_layers = min(saved_layers, 2) * per_layer if x.activation_offload else stage_layers * held_per_layer
    step_inputs = step_inputs_per_token(x) * held_home / x.tp
    head_gradient = c * (last_root if x.pp == 1 or x.pipeline_end == "last" else 0) / x.tp

    states = {} if x.optimizer_offload else {"parameters": PARAM_BYTES * owned, "optimizer states": ADAM_BYTES * owned}
    compute = {"root parameters (compute copy)": c * root, "layer parameters (compute copy)": c * layer}
    backward = {"output projection gradient": head_gradient, "layer backward": layer_backward_transient(x, tokens)}
    # Sharded float32 gradients of the layers already differentiated, and the float32 copy of the last
    # one's that the reduce-scatter read, which FSDP2 frees at the next reduce-scatter.
    later_gradients = 0 if x.optimizer_offload else GRAD_BYTES * (layers - 1) * layer / x.dp
    # accumulated unsharded until the step's last micro-batch
    accumulated = {"accumulated gradients": GRAD_BYTES * (layers * layer + root)} if x.microbatches > 1 else {}
    loss_phase = {
        # (Liger's fused loss makes its gradients in the forward, so its peak is there.)
        "loss (gradients in forward)" if x.loss_kernel == "liger" else "loss backward": {
            **states, **compute, "activations": all_layers,
            "step inputs": step_inputs_per_token(x, loss=True) * held_home / x.tp,
            "output projection gradient": head_gradient, "loss chunk": loss_transient(x, tokens),
            "hidden state gradient": (2 if x.bf16 else 4) * m.dim * home / x.tp,
            **held_loss_gradients(x, home),
        },
    }
    optimizer_step = {"optimizer step": {**states, "gradients": 0 if x.optimizer_offload else GRAD_BYTES * owned}}
    host = (PARAM_BYTES + GRAD_BYTES + ADAM_BYTES) * owned if x.optimizer_offload else 0
    modes = _modes_by_layer(x, layers)
    held = {**states, **compute, "step inputs": step_inputs, **accumulated}
    if modes:  # every layer's backward a phase of its own
        saved = [sum(saved_per_layer(x, mode).values()) * home / x.tp for mode in modes]
        for terms in loss_phase.values():  # (a later micro-batch's loss holds the gradients accumulated so far)
            terms.update(activations=max(map(sum, zip(saved, saved[1:] or [0]))) if x.activation_offload
                         else sum(saved), **accumulated)
        layer_phases = _layer_phases(x, modes, saved, held, backward, GRAD_BYTES * layer, layer / x.dp)
        return _peak_phase(x, {**loss_phase, **layer_phases, **optimizer_step}, cal, home,
                           host + (sum(saved) if x.activation_offload else 0))
    phases = {  # pipeline stages: their first and last layer's backward (and below, a later micro-batch's)
        **(loss_phase if has_loss else {}),
        "last layer backward": {**held, "activations": all_layers, **backward},
        "first layer backward": {**held, "activations": per_layer, **backward,
                                 "gradients": later_gradients + (GRAD_BYTES * layer if layers > 1 else 0)},
        **optimizer_step,
    }
    if accumulated and x.pp > 1 and not x.activation_offload:
        phases["last layer backward"]["accumulated gradients"] = 0  # the first micro-batch's backward: none yet
        activations, inputs, loss_inputs = _after_first_backward(x, stage_layers * per_layer, home,
                                                                 stage_layers * held_per_layer, held_home)
        phases["later micro-batches' last layer backward"] = {
            **states, **compute, "activations": activations, "step inputs": inputs, **backward, **accumulated}
        for name, terms in loss_phase.items() if has_loss else ():  # a later micro-batch's loss, gradients held
            phases[f"later micro-batches' {name}"] = {**terms, "activations": activations, "step inputs": loss_inputs,
                                                      **accumulated}
    if x.activation_offload:
        host += stage_layers * held_per_layer
    return _peak_phase(x, phases, cal, home, host)


def _modes_by_layer(x: MemoryInputs, layers: int) -> tuple[str, ...]:
    """Each layer's checkpointing mode where every layer's backward is a phase of its own (_layer_phases): auto's
    choice, or without pipeline stages (one unit in flight, held_rows None) the one mode; else none (the pipeline's
    phases are its first and last layer's)."""
    if x.layer_modes:
        return x.layer_modes
    return (x.activation_checkpointing,) * layers if x.pp == 1 and x.held_rows is None else ()


def _layer_phases(x: MemoryInputs, modes: tuple[str, ...], saved: list[float], held: dict, backward: dict,
                  layer_gradient: float, layer_shard: float) -> dict[str, dict]:
    """The backward phase of each layer (``modes``: each layer's checkpointing mode, ``saved``: its kept bytes,
    forward order): a layer's backward holds the activations of the layers before it (offloaded: its own and the
    one before, prefetched), its mode's transient, and the gradients of the layers after it (sharded; the last
    one's float32 copy besides). Every layer is a phase, one mode or several: activations grow with the index,
    gradients shrink, and the last layer's backward holds no gradient yet, so the peak may lie at any of them (the
    layer before the last, where a layer keeps less than its gradients; offloaded, the second)."""
    last = len(modes) - 1
    transient = {mode: layer_backward_transient(x, x.tokens_per_rank, mode) for mode in set(modes)}
    held_before = list(accumulate(saved))
    phases = {}
    for i in range(last + 1):
        activations = saved[i] + (saved[i - 1] if i else 0) if x.activation_offload else held_before[i]
        later = 0 if x.optimizer_offload else GRAD_BYTES * (last - i) * layer_shard
        terms = {**held, "activations": activations, **backward,
                 "layer backward": transient[modes[i]]}
        if i < last:
            terms["gradients"] = later + layer_gradient
        phases[f"layer {i} backward ({modes[i]})"] = terms
    return phases


def _peak_phase(x: MemoryInputs, phases: dict[str, dict], cal: Calibration, home: float, host: float) -> MemoryEstimate:
    """The estimate at the phase that holds the most, with what the hand count misses (the calibration's
    residual, the allocator's fragmentation, the CUDA context). The residual is fitted per mode on runs of one
    mode; where layers' modes differ, each mode's weighs by its share of the layers (so that a layer recomputed
    more never raises the prediction by a jump of residuals)."""
    totals = {name: sum(terms.values()) for name, terms in phases.items()}
    phase = max(totals, key=totals.get)
    breakdown = dict(phases[phase])
    modes = x.layer_modes or (x.activation_checkpointing,)
    if phase != "optimizer step":
        breakdown["calibrated residual"] = sum((cal.residual_per_token[m] * home + cal.residual_constant[m])
                                               * residual_share(x, m) for m in modes) / len(modes)
    allocated = sum(breakdown.values())
    breakdown["allocator fragmentation"] = (cal.fragmentation - 1.0) * allocated
    breakdown[cal.context_name] = cal.cuda_context_bytes
    breakdown = {name: int(round(value)) for name, value in breakdown.items()}
    return MemoryEstimate(x, phase, breakdown, int(round(allocated)), sum(breakdown.values()), int(host))


def residual_share(x: MemoryInputs, mode: str) -> float:
    """The share of the calibration's residual (fitted on CALIBRATION_MODEL's widths) a model takes under ``mode``:
    what one of its layers keeps per token over the calibration model's, at most 1 (taken whole, a tenth of the 8B's
    widths was predicted below zero: bench/results/2026-11-29-cpu-memory-residual-share.md)."""
    own, calibrated = (sum(saved_per_layer(m, mode).values()) for m in (x, replace(x, model=CALIBRATION_MODEL)))
    return min(1.0, own / calibrated) if calibrated > 0 else 1.0


def saved_bytes_per_layer(x: MemoryInputs) -> int:
    """Bytes one layer keeps for its backward on this rank (its share of the busiest rank's rows; where layers'
    modes differ, the layer that keeps the most)."""
    per_token = max(sum(saved_per_layer(x, mode).values()) for mode in x.layer_modes or (x.activation_checkpointing,))
    return int(per_token * x.tokens_per_rank * x.rows.home / x.tp)


def auto_choice(modes, activation_offload: bool) -> str:
    """What ``activation_checkpointing: auto`` chose, in words."""
    return describe_layer_modes(modes) + (", with activation offload" if activation_offload else "")


def describe_layer_modes(modes) -> str:
    """Layers' checkpointing modes in runs: "layers 0-3 full, 4-31 keep_attention" (one mode: "all 32 layers full")."""
    if len(set(modes)) == 1:
        return f"all {len(modes)} layers {modes[0]}"
    runs, start = [], 0
    for i in range(1, len(modes) + 1):
        if i == len(modes) or modes[i] != modes[start]:
            runs.append(f"{start}-{i - 1} {modes[start]}" if i - 1 > start else f"{start} {modes[start]}")
            start = i
    return "layers " + ", ".join(runs)
