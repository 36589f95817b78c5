"""Llama-family decoder with a pluggable core attention, and Hugging Face checkpoints.

The configurations load without torch; the model and the checkpoints on first use (PEP 562).
"""

from attnpool.model.config import MODEL_PRESETS, ModelConfig, RopeScaling, model_config

__all__ = [
    "MODEL_PRESETS",
    "CoreAttention",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "TransformerBlock",
    "apply_activation_checkpointing",
    "apply_rope",
    "config_from_hf",
    "config_to_hf",
    "load_hf_checkpoint",
    "model_config",
    "rope_cos_sin",
    "rope_frequencies",
    "save_hf_checkpoint",
]

_HF = ("config_from_hf", "config_to_hf", "load_hf_checkpoint", "save_hf_checkpoint")
_LLAMA = ("CoreAttention", "Transformer", "TransformerBlock", "apply_activation_checkpointing", "apply_rope",
          "rope_cos_sin", "rope_frequencies")


def __getattr__(name: str):
    if name in _HF or name in _LLAMA:
        import importlib

        return getattr(importlib.import_module("attnpool.model.hf" if name in _HF else "attnpool.model.llama"), name)
    raise AttributeError(f"module 'attnpool.model' has no attribute {name!r}")
