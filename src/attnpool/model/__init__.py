"""Llama-family decoder with a pluggable core attention, and Hugging Face checkpoints."""

from attnpool.model.config import MODEL_PRESETS, ModelConfig, RopeScaling, model_config
from attnpool.model.hf import config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from attnpool.model.llama import (
    CoreAttention,
    Transformer,
    TransformerBlock,
    apply_activation_checkpointing,
    apply_rope,
    rope_cos_sin,
    rope_frequencies,
)

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
