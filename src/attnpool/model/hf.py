"""Hugging Face checkpoints of LlamaForCausalLM and Qwen2ForCausalLM, both ways.

A checkpoint is a directory with ``config.json`` and ``*.safetensors`` (one
file, or shards listed in ``model.safetensors.index.json``). Only the
``safetensors`` package is needed; ``transformers`` is not imported.

Tensor names map one to one:

    embed.weight                         model.embed_tokens.weight
    layers.N.attention_norm.weight       model.layers.N.input_layernorm.weight
    layers.N.attention.{q,k,v,o}_proj.*  model.layers.N.self_attn.{q,k,v,o}_proj.*
    layers.N.mlp_norm.weight             model.layers.N.post_attention_layernorm.weight
    layers.N.mlp.{gate,up,down}_proj.*   model.layers.N.mlp.{gate,up,down}_proj.*
    norm.weight                          model.norm.weight
    lm_head.weight                       lm_head.weight   (absent when tied)

Both sides rotate q and k in the same "rotate half" layout, so no weight is
permuted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from attnpool.errors import ConfigError
from attnpool.model.config import ModelConfig, RopeScaling
from attnpool.model.llama import Transformer

LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
_MODEL_TYPE = {LLAMA: "llama", QWEN2: "qwen2"}

# Tensors some checkpoints carry that a model does not need.
_IGNORED_TENSORS = {"model.rotary_emb.inv_freq"}

_TOP_LEVEL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_MODULE_NAMES = {
    "attention_norm": "input_layernorm",
    "attention": "self_attn",
    "mlp_norm": "post_attention_layernorm",
    "mlp": "mlp",
}


def hf_name(name: str) -> str:
    """The Hugging Face name of an attnpool state-dict entry."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in _LAYER_MODULE_NAMES:
        _, index, module, rest = parts
        return f"model.layers.{index}.{_LAYER_MODULE_NAMES[module]}.{rest}"
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    raise ConfigError("tensor", name, "is not a tensor of attnpool's Transformer")


def _expected_tensors(config: ModelConfig) -> dict[str, tuple[str, torch.Size]]:
    """HF name -> (attnpool name, shape) of every tensor a model with ``config`` has."""
    with torch.device("meta"):
        model = Transformer(config)
    return {hf_name(name): (name, t.shape) for name, t in model.state_dict().items()}


# --- config.json --------------------------------------------------------------


def config_from_hf(hf: Mapping) -> ModelConfig:
    """A ModelConfig from a LlamaForCausalLM or Qwen2ForCausalLM ``config.json``.

    Refuses, naming the field, what this model does not implement: other
    activations, MLP or output-projection biases, sliding windows, RoPE scaling
    other than Llama 3.1's.
    """
    architectures = hf.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in _MODEL_TYPE:
        raise ConfigError("architectures", architectures, f"supported: {', '.join(_MODEL_TYPE)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError("hidden_act", hf["hidden_act"], "only silu (SwiGLU) is implemented")
    if hf.get("mlp_bias", False):
        raise ConfigError("mlp_bias", hf["mlp_bias"], "MLP biases are not implemented")
    if arch == LLAMA and hf.get("attention_bias", False):
        raise ConfigError("attention_bias", hf["attention_bias"], "Llama's q/k/v/o biases are not implemented")
    if arch == QWEN2 and hf.get("use_sliding_window", False):
        raise ConfigError("use_sliding_window", hf["use_sliding_window"], "sliding-window attention is not implemented")

    def required(key):
        if hf.get(key) is None:
            raise ConfigError(key, None, "missing from config.json")
        return hf[key]

    rope_theta, rope_scaling = _rope_from_hf(hf)
    n_heads = required("num_attention_heads")
    return ModelConfig(
        vocab_size=required("vocab_size"),
        dim=required("hidden_size"),
        n_layers=required("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_dim=required("intermediate_size"),
        head_dim=hf.get("head_dim"),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == QWEN2,  # Qwen2 always has q/k/v biases, never an o_proj bias
        max_position=hf.get("max_position_embeddings"),
    )


def _rope_from_hf(hf: Mapping) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes one "rope_parameters" dict; 4.x wrote "rope_theta"
    # and an optional "rope_scaling" dict ("type" in older files).
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError("partial_rotary_factor", partial, "only full rotary embeddings are implemented")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, RopeScaling(
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position=params.get("original_max_position_embeddings")
            or hf["max_position_embeddings"],
        )
    raise ConfigError("rope_scaling.rope_type", rope_type, "only 'default' and 'llama3' RoPE are implemented")


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` for transformers: Qwen2ForCausalLM when q/k/v have biases, else LlamaForCausalLM.

    Written in transformers 4.x's form (``rope_theta`` and ``rope_scaling``),
    which 5.x reads as well.
    """
    arch = QWEN2 if config.qkv_bias else LLAMA
    hf = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE[arch],
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        # transformers needs a number; for these RoPE types it sizes nothing.
        "max_position_embeddings": config.max_position or 131072,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    if arch == LLAMA:
        hf.update(attention_bias=False, mlp_bias=False)
    else:
        hf.update(use_sliding_window=False)
    return hf


# --- weights ------------------------------------------------------------------


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError("directory", str(directory), "has no *.safetensors files")
    return files


def load_hf_checkpoint(
    directory, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[Transformer, ModelConfig]:
    """Read a Hugging Face checkpoint into a Transformer.

    Every tensor's shape is checked against ``config.json`` before any is read,
    and a checkpoint with a missing, surplus or misshapen tensor is refused with
    a ConfigError naming that tensor. ``dtype=None`` keeps the checkpoint's
    dtype (that of its embedding).
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ConfigError("directory", str(directory), "has no config.json")
    config = config_from_hf(json.loads(config_path.read_text()))
    expected = _expected_tensors(config)

    # Pass 1: names and shapes only (headers), so a bad checkpoint is refused cheaply.
    found: dict[str, Path] = {}
    for path in _safetensors_files(directory):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in _IGNORED_TENSORS or (name == "lm_head.weight" and config.tie_embeddings):
                    continue  # tied: the output projection is the embedding
                shape = tuple(f.get_slice(name).get_shape())
                if name not in expected:
                    raise ConfigError(name, shape, f"is in {path.name} but not in a model with this config.json")
                if shape != tuple(expected[name][1]):
                    raise ConfigError(name, shape, f"expected shape {tuple(expected[name][1])} from config.json")
                found[name] = path
    missing = [name for name in expected if name not in found]
    if missing:
        raise ConfigError(missing[0], None, f"missing from the checkpoint ({len(missing)} tensors missing in all)")

    # Pass 2: the data.
    state: dict[str, Tensor] = {}
    for path in sorted(set(found.values())):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if found.get(name) == path:
                    state[expected[name][0]] = f.get_tensor(name)
    dtype = dtype or state["embed.weight"].dtype
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}

    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model, config


def save_hf_checkpoint(
    model: nn.Module | Mapping[str, Tensor],
    config: ModelConfig,
    directory,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers can load.

    ``model`` is a Transformer or its state dict with whole tensors. An FSDP
    model's shards must be gathered first, e.g. with
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
    options=StateDictOptions(full_state_dict=True, cpu_offload=True))``.
    ``dtype=None`` keeps the weights' dtype.
    """
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    expected = _expected_tensors(config)
    tensors = {}
    for name, tensor in state.items():
        if hasattr(tensor, "full_tensor"):
            raise ConfigError(name, type(tensor).__name__, "is sharded; gather a full state dict first")
        key = hf_name(name)
        if key not in expected or tensor.shape != expected[key][1]:
            raise ConfigError(name, tuple(tensor.shape), "does not fit the given config")
        tensors[key] = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
    missing = [key for key in expected if key not in tensors]
    if missing:
        raise ConfigError(missing[0], None, "missing from the model's state dict")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_dtype = dtype or tensors["model.embed_tokens.weight"].dtype
    (directory / "config.json").write_text(json.dumps(config_to_hf(config, save_dtype), indent=2) + "\n")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
