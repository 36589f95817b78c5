"""A Llama-family decoder for a packed sequence of documents.

There is no batch dimension. One rank's input is a flat sequence of T tokens
cut from several documents, and ``positions[t]`` is token t's position inside
its own document. A document may be split across ranks, so the first token a
rank holds can sit at any position: RoPE is applied at that absolute position
and nothing here assumes positions start at 0.

Every part of a layer costs time linear in the tokens except core attention,
softmax(Q K^T / sqrt(d)) V, whose cost is quadratic in each document's length.
So core attention is not in this file: ``Transformer.forward`` takes it as a
callable ``(q, k, v, *, layer) -> out`` with q (T, H_q, D), k and v (T, H_kv, D)
after RoPE and ``layer`` the block's 0-based index (so a caller can treat layers
differently, e.g. keep the first ones dense under sparse attention), returning
(T, H_q, D), causal within each document with scale ``D ** -0.5``. The model
does not know who computes it, or where.

Parallelisms and schedules are applied from outside (TorchTitan style,
attnpool.parallel.parallelize): ``model.layers`` maps each block's index (as a
string) to the block, so FSDP2's ``fully_shard`` can wrap each block; a block's two
linear parts around core attention are methods of their own
(``TransformerBlock.before_attention`` and ``after_attention``), which activation
checkpointing recomputes, compile compiles and ping-pong interleaves
(attnpool.parallel.pingpong) without this file knowing; ``prepare`` and ``head`` are
the model's parts before and after its layers. A pipeline stage is this model with
the blocks, embedding or head it does not run deleted (attnpool.parallel.pipeline):
a later stage takes hidden states as its input (``embeds_tokens`` false), one without
a final norm returns them, and every weight keeps its name.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from attnpool.errors import ConfigError
from attnpool.model.config import ModelConfig
from attnpool.kinds import check_layer_kind

CoreAttention = Callable[..., Tensor]  # (q, k, v, *, layer: int) -> out


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight), computed in float32 (float64 for float64 inputs) and rounded once.

    ``offset`` is Gemma's 1: its norms keep w and scale by 1 + w (their weights start at 0), and a checkpoint's
    values load as they are. PyTorch's ``rms_norm`` runs as one fused kernel forward and backward on CUDA, where
    the expression it replaces took about eight elementwise kernels and fp32 copies of x (bench/gpu_rmsnorm.py);
    on CPU it is the same math, composed.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: Tensor) -> Tensor:
        if self.offset:  # as Gemma computes it: in float32, offset + weight not rounded to a bf16 weight's steps
            weight = self.weight.float() + self.offset
            return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    @torch.no_grad()
    def reset_parameters(self):
        self.weight.fill_(1.0 - self.offset)  # the identity scale


# --- Rotary position embedding ------------------------------------------------


def default_inv_freq(theta: float, head_dim: int, device=None) -> Tensor:
    """RoPE's base frequencies, theta^(-2i/D) for the D/2 rotated pairs, in float32 as checkpoints were trained."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_frequencies(config: ModelConfig, device=None) -> Tensor:
    """theta^(-2i/D) for the D/2 rotated pairs, in float32, as the checkpoints were trained.

    With ``config.rope_scaling`` (Llama 3.1), long wavelengths are stretched by
    ``factor``, short ones kept, and the band between interpolated smoothly.
    (``config.ropes``, RoPE given whole, is not computed here: see :func:`rope_cos_sin`.)
    """
    inv_freq = default_inv_freq(config.rope_theta, config.head_dim, device)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    keep_below = s.original_max_position / s.high_freq_factor  # shorter wavelengths are kept
    stretch_above = s.original_max_position / s.low_freq_factor  # longer ones are divided by factor
    smooth = (s.original_max_position / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return torch.where(
        wavelength < keep_below,
        inv_freq,
        torch.where(wavelength > stretch_above, inv_freq / s.factor, interpolated),
    )


def rope_cos_sin(positions: Tensor, config: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos and sin of every token's rotation angles, each (T, D/2) float32; with several RoPE tables
    (``config.ropes``: one per kind of layer, Gemma 3's) (T, R, D/2), table r for the layers of
    ``config.layer_rope(layer) == r``. Tokens come first, so whatever cuts a sequence (sequence parallelism,
    chunked recompute) cuts these alike.

    The angle position * frequency is formed in float64: in float32 a position
    near 500K is off by up to 0.03 rad, and long documents are the point here.
    """
    if config.ropes is None:
        tables = [(rope_frequencies(config, positions.device).double(), 1.0)]
    else:
        tables = [(torch.tensor(rope.inv_freq, dtype=torch.float32, device=positions.device).double(),
                   rope.attention_factor) for rope in config.ropes]
    cos, sin = [], []
    for inv_freq, factor in tables:
        angles = positions.double()[:, None] * inv_freq[None, :]
        cos.append(angles.cos().float() * factor if factor != 1.0 else angles.cos().float())
        sin.append(angles.sin().float() * factor if factor != 1.0 else angles.sin().float())
    if len(tables) == 1:
        return cos[0], sin[0]
    return torch.stack(cos, dim=1), torch.stack(sin, dim=1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (T, H, D) by each token's angles.

    Dim i is paired with dim i + D/2 (the "rotate half" layout of Hugging Face
    Llama and Qwen2), not with its neighbour i + 1.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# --- The layer ----------------------------------------------------------------


class Attention(nn.Module):
    """The projections around core attention; n_heads query heads share n_kv_heads KV heads.

    ``forward`` is the way in (q, k, v), ``o_proj`` the way out. Heads are counted from the
    projections' outputs, so a tensor-parallel split of them (attnpool.parallel.tensor) gives
    each rank its own share without this class knowing. Core attention scales scores by D^-1/2;
    a model with a scale of its own (``config.query_scale``) has it folded into q."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset) if config.qk_norm else None
        scale = config.query_scale
        self.query_factor = None if scale is None or scale == self.head_dim ** -0.5 else scale * self.head_dim ** 0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (T, H_q, D), k and v (T, H_kv, D), with q and k rotated to each token's position."""
        # (unflatten, not view(T, -1, D): a rank may hold no tokens, e.g. under wlb's packing, and a view of no
        # elements cannot infer the head count)
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.query_factor is not None:
            q = q * self.query_factor
        return q, k, v


ACTIVATION_FUNCTIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class FeedForward(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_tanh."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.act = ACTIVATION_FUNCTIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """x + attention(norm(x)), then h + mlp(norm(h)), with core attention passed in (with sandwich norms,
    Gemma 2's and 3's, each branch's output is normed too before it joins the residual).

    ``forward`` is the plain order of the block's parts; whatever runs them otherwise (recomputed,
    compiled, interleaved with another nano-batch's) calls the parts themselves."""

    def __init__(self, config: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.kind = config.layer_kinds()[layer_id]  # what core attention must compute for this layer
        self.rope_index = config.layer_rope(layer_id)
        norm = functools.partial(RMSNorm, config.dim, config.norm_eps, config.norm_offset)
        self.attention_norm = norm()
        self.attention = Attention(config)
        self.attention_out_norm = norm() if config.sandwich_norms else None
        self.mlp_norm = norm()
        self.mlp = FeedForward(config)
        self.mlp_out_norm = norm() if config.sandwich_norms else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, core_attention: CoreAttention) -> Tensor:
        q, k, v = self.before_attention(x, cos, sin)  # linear in tokens: stays on this rank
        check_layer_kind(core_attention, self.layer_id, self.kind)
        out = core_attention(q, k, v, layer=self.layer_id)  # quadratic in document length: runs wherever the plan says
        return self.after_attention(x, out)  # linear again

    def before_attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The linear part before core attention: norm, Q/K/V projections (q/k norms), RoPE."""
        if cos.dim() == 3:  # one table per kind of layer (rope_cos_sin): this layer's
            cos, sin = cos[:, self.rope_index], sin[:, self.rope_index]
        return self.attention(self.attention_norm(x), cos, sin)

    def after_attention(self, x: Tensor, attention_out: Tensor) -> Tensor:
        """The linear part after core attention: output projection, residual, norm, gated MLP, residual."""
        out = self.attention.o_proj(attention_out.flatten(1))
        h = x + (out if self.attention_out_norm is None else self.attention_out_norm(out))
        out = self.mlp(self.mlp_norm(h))
        return h + (out if self.mlp_out_norm is None else self.mlp_out_norm(out))


def _normal_by_name_(param: Tensor, name: str, std: float, *, seed: int, device) -> None:
    """Fill ``param`` with N(0, std) drawn whole from a generator seeded by (seed, name), keeping a sharded
    parameter's own part, so that every way of cutting the model draws the same weights (see init_weights)."""
    if param.device.type == "meta":
        return
    local = param.to_local() if isinstance(param, DTensor) else param
    device = torch.device(device) if device is not None else local.device
    generator = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    whole = torch.empty(param.shape, dtype=param.dtype, device=device).normal_(0.0, std, generator=generator)
    if isinstance(param, DTensor):  # this rank's part, as the placements cut it (no communication)
        whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(whole)


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm, output projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        # Tied: the output projection is embed.weight itself, so there is one
        # parameter and no lm_head entry in the state dict (keep embed in the
        # root FSDP unit, since the root's forward uses it twice).
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        # False: a later pipeline stage, which takes hidden states (it may still hold ``embed``: tied, the last
        # stage's output projection is its own copy of the embedding, attnpool.parallel.pipeline)
        self.embeds_tokens = True
        # The loss of ``labels``: (h, weight, labels) -> summed cross-entropy (model.fused_loss picks it).
        self.cross_entropy = chunked_cross_entropy
        self.init_weights()

    @property
    def output_weight(self) -> Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, device: torch.device | str | None = None):
        """Weights ~ N(0, 0.02); norms the identity scale, biases 0.

        The two projections that write into the residual stream (o_proj,
        down_proj) get std 0.02 / sqrt(2 * n_layers), as in GPT-2, so the
        residual's variance does not grow with depth.

        Each weight is drawn whole from a generator of its own, seeded by
        ``seed`` (default ``torch.initial_seed()``, what the last
        ``torch.manual_seed`` set) and the weight's name, on ``device`` (default:
        the parameter's); a sharded parameter (a DTensor: FSDP2, tensor
        parallelism) keeps its part of it. So the values do not depend on how
        the model is cut: one process, a pipeline stage and a tensor- or
        data-parallel shard start from the same weights (on one kind of device:
        CPU and CUDA generators draw different numbers). A model built on the
        meta device gets storage from ``to_empty()`` and then its values here;
        its parameters are skipped while still on the meta device.
        """
        seed = torch.initial_seed() if seed is None else seed
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        normal = dict(seed=seed, device=device)
        if self.embed is not None:
            _normal_by_name_(self.embed.weight, "embed.weight", std, **normal)
        if self.lm_head is not None:
            _normal_by_name_(self.lm_head.weight, "lm_head.weight", std, **normal)
        for key, layer in self.layers.items():
            attention, mlp = layer.attention, layer.mlp
            for part, module, proj_std in (("attention.q_proj", attention.q_proj, std),
                                           ("attention.k_proj", attention.k_proj, std),
                                           ("attention.v_proj", attention.v_proj, std),
                                           ("attention.o_proj", attention.o_proj, out_std),
                                           ("mlp.gate_proj", mlp.gate_proj, std), ("mlp.up_proj", mlp.up_proj, std),
                                           ("mlp.down_proj", mlp.down_proj, out_std)):
                _normal_by_name_(module.weight, f"layers.{key}.{part}.weight", proj_std, **normal)
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
                if proj.bias is not None:
                    nn.init.zeros_(proj.bias)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        attention: CoreAttention,
        *,
        return_hidden: bool = False,
        labels: Tensor | None = None,
    ) -> Tensor:
        """Logits (T, vocab_size) for tokens (T,) at in-document positions (T,).

        ``attention(q, k, v)`` is core attention for this rank's tokens (see the
        module docstring). With ``labels`` the summed token loss comes back instead, computed
        by ``cross_entropy`` against ``output_weight`` (in chunks: never all T x vocab
        logits at once); with ``return_hidden=True`` the final normed hidden states (T, dim).
        On a later pipeline stage (``embeds_tokens`` false) ``tokens`` are hidden
        states; without a final norm (an earlier one) the hidden states come back.
        """
        h, cos, sin = self.prepare(tokens, positions)
        for layer in self.layers.values():
            h = layer(h, cos, sin, attention)
        return self.head(h, labels=labels, return_hidden=return_hidden)

    def prepare(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What the layers take: the embedded tokens (hidden states as they are, on a later pipeline stage) and
        every token's RoPE cos and sin, computed once per step and shared by every layer."""
        if isinstance(tokens, (list, tuple)):
            raise ConfigError("tokens", f"a list of {len(tokens)}", "must be one flat sequence (T,); a model takes "
                                                                   "nano-batches once attnpool.parallel.pingpong."
                                                                   "apply_pingpong has been applied to it")
        if self.embeds_tokens and tokens.dim() != 1:
            raise ConfigError("tokens", tuple(tokens.shape), "must be one flat sequence (T,)")
        if positions.dim() != 1 or (self.embeds_tokens and positions.shape != tokens.shape):
            raise ConfigError("positions", tuple(positions.shape), f"must match tokens' shape {tuple(tokens.shape)}")
        if positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ConfigError("positions", positions.dtype, "must be integer positions within each document")
        cos, sin = rope_cos_sin(positions, self.config)
        if not self.embeds_tokens:
            return tokens, cos, sin
        h = self.embed(tokens)
        if self.config.scale_embeddings:  # Gemma: times sqrt(dim), rounded to the embedding's dtype as it does
            h = h * torch.tensor(self.config.dim ** 0.5, dtype=h.dtype)
        return h, cos, sin

    def head(self, h: Tensor, *, labels: Tensor | None = None, return_hidden: bool = False) -> Tensor:
        """After the layers: the final norm, then the summed loss of ``labels``, the normed hidden states, or the
        logits (without a final norm, an earlier pipeline stage's, the hidden states as they are)."""
        if self.norm is None:
            return h
        h = self.norm(h)
        if labels is not None:
            return summed_loss(self.cross_entropy, h, self.output_weight, labels, self.config.final_softcap)
        if return_hidden:
            return h
        return soft_capped(F.linear(h, self.output_weight), self.config.final_softcap)


# The loss computes one chunk of logits at a time; a chunk's float32 logits take at most this many
# bytes (its backward holds a few such buffers at once).
LOSS_CHUNK_LOGIT_BYTES = 1 << 30

IGNORE_INDEX = -100  # labels of tokens without a next token (PyTorch's default; attnpool.data uses it too)


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per loss chunk: the largest power of two whose float32 logits fit LOSS_CHUNK_LOGIT_BYTES
    (2048 for Llama 3's vocabulary of 128256; at least 256)."""
    fits = LOSS_CHUNK_LOGIT_BYTES // (4 * vocab_size)
    return max(256, 1 << (fits.bit_length() - 1)) if fits else 256


def summed_loss(cross_entropy, h: Tensor, weight: Tensor, labels: Tensor, softcap: float | None) -> Tensor:
    """``cross_entropy`` (a model's loss-kernel slot: attnpool.model.fused_loss) of the head's logits, soft-capped
    where the model caps them (the slot's functions take ``softcap``; one that a user sets need not, unless the
    model caps)."""
    if softcap is None:
        return cross_entropy(h, weight, labels)
    return cross_entropy(h, weight, labels, softcap=softcap)


def soft_capped(logits: Tensor, softcap: float | None) -> Tensor:
    """``softcap * tanh(logits / softcap)`` (Gemma 2's final logits), or the logits as they are."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _cross_entropy_sum(h: Tensor, weight: Tensor, labels: Tensor, softcap: float | None = None) -> Tensor:
    logits = F.linear(h, weight)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()  # softmax over a large vocabulary in float32
    return F.cross_entropy(soft_capped(logits, softcap), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, chunk: int | None = None,
                          softcap: float | None = None) -> Tensor:
    """Summed cross-entropy of ``h @ weight.T`` (soft-capped at ``softcap`` where given) against ``labels``
    (-100 ignored), ``chunk`` tokens at a time (default :func:`loss_chunk_tokens`), each chunk's logits
    recomputed in backward: never more than one chunk's (chunk x vocab) logits in memory, where full logits
    of a long sequence would not fit."""
    chunk = chunk or loss_chunk_tokens(weight.shape[0])
    return sum(checkpoint(_cross_entropy_sum, h_chunk, weight, labels_chunk, softcap, use_reentrant=False)
               for h_chunk, labels_chunk in zip(h.split(chunk), labels.split(chunk)))
