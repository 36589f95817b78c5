"""Model configuration: one dataclass, and presets by name.

The presets copy the published configs (Hugging Face ``config.json``) of the
models they are named after; ``llama-34b`` is the 34B Llama of the DistCA
paper's evaluation tables.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from attnpool.errors import ConfigError


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


@dataclass
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

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

    def layer_params(self) -> int:
        """Weights of one decoder layer: attention projections (and biases), SwiGLU, two norms."""
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.qkv_bias:
            attention += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        return attention + 3 * self.dim * self.ffn_dim + 2 * self.dim

    def num_params(self, include_embeddings: bool = True) -> int:
        """Number of weights (embedding and output counted once each; once if tied)."""
        total = self.n_layers * self.layer_params() + self.dim
        if include_embeddings:
            total += self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return total


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, value, "must be a positive integer")


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
    for key in overrides:
        if key not in known_fields:
            raise ConfigError(key, overrides[key], f"is not a model field; fields: {', '.join(sorted(known_fields))}")
    return ModelConfig(**{**MODEL_PRESETS[name], **overrides})
