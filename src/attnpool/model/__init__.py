"""Llama-family decoder with a pluggable core attention, Hugging Face checkpoints, and the model specs the
trainer builds models from (``model_spec``).

The configurations and specs load without torch; the model and the checkpoints on first use (PEP 562).
"""

from attnpool.model.config import MODEL_PRESETS, ModelConfig, RopeScaling, model_config
from attnpool.model.families import model_spec
from attnpool.model.spec import ModelSpec

__all__ = [
    "MODEL_PRESETS",
    "CoreAttention",
    "ModelConfig",
    "ModelSpec",
    "RopeScaling",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "config_from_hf",
    "config_to_hf",
    "load_hf_checkpoint",
    "model_config",
    "model_spec",
    "rope_cos_sin",
    "rope_frequencies",
    "save_hf_checkpoint",
]

_HF = ("config_from_hf", "config_to_hf", "load_hf_checkpoint", "save_hf_checkpoint")
_LLAMA = ("CoreAttention", "Transformer", "TransformerBlock", "apply_rope", "rope_cos_sin", "rope_frequencies")


def __getattr__(name: str):
    if name in _HF:
        from attnpool.model import hf

        return getattr(hf, name)
    if name in _LLAMA:
        from attnpool.model import llama

        return getattr(llama, name)
    raise AttributeError(f"module 'attnpool.model' has no attribute {name!r}")
