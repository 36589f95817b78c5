"""Model configuration: one dataclass, and presets by name.

The presets copy the published configs (Hugging Face ``config.json``) of the
models they are named after; ``llama-34b`` is the 34B Llama of the DistCA
paper's evaluation tables.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from attnpool.errors import ConfigError
from attnpool.kinds import AttentionKind, expand_layer_types, layer_kinds
from attnpool.sizes import with_token_counts


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's remap of the RoPE frequencies for a longer context.

    Wavelengths shorter than ``original_max_position / high_freq_factor`` are
    kept, those longer than ``original_max_position / low_freq_factor`` are
    stretched by ``factor``, and the band between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if not self.factor > 0:
            raise ConfigError("rope_scaling.factor", self.factor, "must be positive")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                "rope_scaling.low_freq_factor",
                self.low_freq_factor,
                f"must be positive and below high_freq_factor={self.high_freq_factor}",
            )
        if not self.original_max_position > 0:
            raise ConfigError(
                "rope_scaling.original_max_position", self.original_max_position, "must be positive"
            )


@dataclass(frozen=True)
class Rope:
    """The RoPE of one kind of layer given whole, as a checkpoint's config defines it (transformers computes it
    for every RoPE type it knows: linear, YaRN, Llama 3's, ...): the inverse frequencies of the head's D/2
    rotated pairs, and the factor on cos and sin (YaRN's attention factor; 1 for the others)."""

    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0


ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's activation: SwiGLU (Llama, Qwen, Mistral), GeGLU (Gemma)


@dataclass
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, grouped-query attention, a gated MLP; and the variations of the
    families a Hugging Face checkpoint may come from (attnpool.model.hf): Qwen's biases and q/k norms, Gemma's
    scaled embedding, (1 + w) norms, GeGLU, norms after attention and MLP, and its attention scale."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on the q, k and v projections
    # The longest document the model is meant for. Nothing is sized from it (cos
    # and sin are computed from each step's positions); it is written to
    # Hugging Face's max_position_embeddings.
    max_position: int | None = None
    # RoPE given whole, one per kind of layer (a checkpoint's RoPE settings); None: from rope_theta and
    # rope_scaling. layer_ropes: each layer's index into ropes (None: every layer uses ropes[0]).
    ropes: tuple[Rope, ...] | None = None
    layer_ropes: tuple[int, ...] | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each query and key head before RoPE
    sandwich_norms: bool = False  # Gemma 2 and 3: attention's and the MLP's outputs normed before the residual
    norm_offset: float = 0.0  # the norms scale by norm_offset + weight (Gemma: 1, its weights start at 0)
    activation: str = "silu"  # the gated MLP's (ACTIVATIONS)
    scale_embeddings: bool = False  # Gemma: the embedding times sqrt(dim)
    query_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5 (Gemma 2, 3: their own)
    # Attention kinds (attnpool.kinds): a sliding window of this many keys in the layers ``layer_types``
    # marks "sliding_attention" (None: in every layer; Mistral), the others "full_attention" (Gemma 2 and 3;
    # a pattern "S/F" repeats S sliding layers and F full ones: Gemma 3 is "5/1");
    # scores soft-capped at attn_softcap in every layer, the output logits at final_softcap (Gemma 2).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            _check_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(
                    "dim", self.dim, f"is not divisible by n_heads={self.n_heads}; give head_dim"
                )
            self.head_dim = self.dim // self.n_heads
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ConfigError("head_dim", self.head_dim, "must be even: RoPE rotates pairs of dims")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "n_kv_heads",
                self.n_kv_heads,
                f"must divide n_heads={self.n_heads}: each KV head serves a whole group of query heads",
            )
        if not self.norm_eps > 0:
            raise ConfigError("norm_eps", self.norm_eps, "must be positive")
        if not self.rope_theta > 0:
            raise ConfigError("rope_theta", self.rope_theta, "must be positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError("rope_scaling", self.rope_scaling, "must be a RopeScaling or None")
        if self.max_position is not None:
            _check_positive_int("max_position", self.max_position)
        if self.activation not in ACTIVATIONS:
            raise ConfigError("activation", self.activation, f"choose one of {', '.join(ACTIVATIONS)}")
        if self.query_scale is not None and not self.query_scale > 0:
            raise ConfigError("query_scale", self.query_scale, "must be positive")
        self._check_ropes()
        if self.layer_types is not None:
            self.layer_types = expand_layer_types(self.n_layers, self.layer_types)
        if self.final_softcap is not None and not self.final_softcap > 0:
            raise ConfigError("final_softcap", self.final_softcap, "must be positive")
        self.layer_kinds()  # checked here: a window, the layer types and the soft-cap

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        """Each layer's attention kind (causal, windowed, soft-capped: attnpool.kinds)."""
        return layer_kinds(self.n_layers, self.sliding_window, self.layer_types, self.attn_softcap)

    def _check_ropes(self):
        if self.ropes is None:
            if self.layer_ropes is not None:
                raise ConfigError("layer_ropes", self.layer_ropes, "needs ropes")
            return
        for rope in self.ropes:
            if not isinstance(rope, Rope) or len(rope.inv_freq) != self.head_dim // 2:
                raise ConfigError("ropes", rope, f"each must be a Rope of head_dim / 2 = {self.head_dim // 2} "
                                                 "frequencies")
        if self.layer_ropes is not None and (
                len(self.layer_ropes) != self.n_layers or not all(0 <= i < len(self.ropes) for i in self.layer_ropes)):
            raise ConfigError("layer_ropes", self.layer_ropes, f"must give each of the {self.n_layers} layers an "
                                                               f"index into the {len(self.ropes)} ropes")

    def layer_rope(self, layer: int) -> int:
        """Which of the RoPE tables (:func:`attnpool.model.llama.rope_cos_sin`'s) layer ``layer`` uses."""
        return 0 if self.layer_ropes is None else self.layer_ropes[layer]

    def layer_params(self) -> int:
        """Weights of one decoder layer: attention projections (and biases, q/k norms), the gated MLP, the norms."""
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.qkv_bias:
            attention += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            attention += 2 * self.head_dim
        norms = (4 if self.sandwich_norms else 2) * self.dim
        return attention + 3 * self.dim * self.ffn_dim + norms

    def num_params(self, include_embeddings: bool = True) -> int:
        """Number of weights (embedding and output counted once each; once if tied)."""
        total = self.n_layers * self.layer_params() + self.dim
        if include_embeddings:
            total += self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return total


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, value, "must be a positive integer")


# Fields that count tokens, which model_args may give as sizes ('4K')
TOKEN_COUNT_FIELDS = ("max_position", "sliding_window")

MODEL_PRESETS: dict[str, dict] = {
    # A CPU demo on byte-level tokens.
    "tiny": dict(
        vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
        max_position=65536,
    ),
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        norm_eps=1e-5, rope_theta=500000.0, max_position=8192,
    ),
    # The DistCA paper's 34B Llama. rope_theta is CodeLlama-34B's, the one
    # published 34B Llama (it sets no throughput, only the positions' meaning).
    "llama-34b": dict(
        vocab_size=32000, dim=8192, n_layers=48, n_heads=64, n_kv_heads=16, ffn_dim=22016,
        norm_eps=1e-5, rope_theta=1e6, max_position=16384,
    ),
    # Qwen/Qwen2.5-3B
    "qwen2.5-3b": dict(
        vocab_size=151936, dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_dim=11008,
        norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True, qkv_bias=True, max_position=32768,
    ),
}


def model_config(name: str, **overrides) -> ModelConfig:
    """The preset called ``name``, with any field replaced, e.g. ``n_layers=4`` (or ``layers=4``,
    the reduced-depth override benchmarks use)."""
    if name not in MODEL_PRESETS:
        raise ConfigError("model", name, f"unknown preset; known: {', '.join(MODEL_PRESETS)}")
    if "layers" in overrides:
        if "n_layers" in overrides:
            raise ConfigError("layers", overrides["layers"], "give layers or n_layers, not both")
        overrides["n_layers"] = overrides.pop("layers")
    known_fields = {f.name for f in fields(ModelConfig)}
    overrides = with_token_counts(overrides, TOKEN_COUNT_FIELDS)
    for key in overrides:
        if key not in known_fields:
            raise ConfigError(key, overrides[key], f"is not a model field; fields: {', '.join(sorted(known_fields))}")
    return ModelConfig(**{**MODEL_PRESETS[name], **overrides})
