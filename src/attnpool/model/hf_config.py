"""A Hugging Face model directory's config.json, read and checked: what both ways of running it share (attnpool's own
model built from it, attnpool.model.hf; transformers' modules behind the adapter, attnpool.model.hf_causal_lm).

transformers reads the file (its config classes fill in each architecture's defaults and check the values), the
run's ``--model-args`` are changed in it, and what core attention cannot compute is refused, naming the
architecture and the feature: architectures whose forward attnpool has not checked, non-causal attention and
attention dropout. Sliding windows, per-layer attention types and soft-capped logits are read as the model's attention
kinds (:func:`attention_settings`, attnpool.kinds), which core attention computes. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os

from attnpool.errors import ConfigError
from attnpool.model.spec import HF_PREFIX
from attnpool.sizes import with_token_counts

# model_type -> its family. Each was read in transformers 5.24's modeling code: between the embedding and
# the output projection tokens mix only in attention, the attention function gets q, k and v after RoPE
# (and any q/k norm), and the output projection is a plain linear map (no bias, no scaling) of the final
# norm's output, so the chunked loss may compute the logits itself.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma": "Gemma",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
}
# Those attnpool's own model expresses (attnpool.model.hf reads their checkpoints into it): every feature runs.
OWN_MODEL_TYPES = tuple(SUPPORTED_MODEL_TYPES)


def architecture(hf_config) -> str:
    """The architecture's name (LlamaForCausalLM, ...) as config.json gives it."""
    architectures = getattr(hf_config, "architectures", None) or []
    return architectures[0] if architectures else hf_config.__class__.__name__.replace("Config", "")


def model_type_of(path: str) -> str | None:
    """config.json's model_type, read without transformers (None where the file cannot be read: reading the
    config properly says why)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


# Weights in formats attnpool does not read: a directory with only these is refused, not trained from random weights.
# By name as well as suffix: a trainer's checkpoint directory also holds training_args.bin, optimizer.pt and
# rng_state.pth, which are not weights.
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
OTHER_WEIGHT_PREFIXES = ("pytorch_model", "model", "tf_model", "flax_model", "consolidated")


def _other_weights(name: str) -> bool:
    return name.endswith(".gguf") or (name.startswith(OTHER_WEIGHT_PREFIXES) and name.endswith(OTHER_WEIGHT_SUFFIXES))


def has_safetensors(path: str) -> bool:
    """Whether the directory holds safetensors weights, or an index of them (their files then checked, a missing
    one named); else a model is initialised from its config. A directory whose only weights are in another format
    (pytorch_model.bin, ...) is refused: training it from random weights would be silently wrong."""
    names = os.listdir(path)
    if any(name.endswith((".safetensors", ".safetensors.index.json")) for name in names):
        return True
    others = sorted(name for name in names if _other_weights(name))
    if others:
        raise ConfigError("model", HF_PREFIX + path, f"holds weights as {others[0]}, which attnpool does not read: save "
                                                     "them as safetensors (transformers: model.save_pretrained(DIR)), "
                                                     "or move them out to train from random weights")
    return False


def read_hf_config(path: str, model_args: dict | None = None):
    """``path``'s config.json as transformers reads it, with ``model_args`` changed in it (:func:`config_with_args`),
    checked (:func:`hf_model_problem`): a ConfigError names the model, the architecture and what attnpool cannot
    run."""
    field = "model"
    value = HF_PREFIX + path
    if not os.path.isdir(path):
        raise ConfigError(field, value, "no such directory (hf: takes a local model directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(field, value, f"{path} has no config.json")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(field, value, "hf: models need transformers: pip install 'attnpool[hf]'") from None
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(field, value, f"config.json is not a config transformers reads "
                                        f"({str(exc).splitlines()[0]})") from None
    if model_args:
        hf_config = config_with_args(hf_config, model_args, has_safetensors(path))
    problem = hf_model_problem(hf_config)
    if problem is not None:
        raise ConfigError(field, value, problem)
    return hf_config


# Settings that count tokens, which model_args may give as sizes ('4K', '128K')
HF_TOKEN_COUNT_SETTINGS = ("max_position_embeddings", "sliding_window")
# Settings a checkpoint's weights fix: changed, its tensors would not load.
WEIGHT_SHAPE_SETTINGS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                         "head_dim")


def config_with_args(hf_config, model_args: dict, has_weights: bool):
    """``hf_config`` with ``model_args`` (``--model-args``) changed in it, and checked again as transformers checks
    a config.json: any setting the config has (``max_position_embeddings``, ``num_hidden_layers``: fewer layers of a
    checkpoint are taken, more are refused); ``rope_theta``, and ``rope_scaling`` (a mapping with ``rope_type`` and
    its parameters: RoPE's base and scaling, which transformers keeps in ``rope_parameters``, what context extension
    changes). Settings that fix the weights' shapes are refused where the directory has weights. The export writes
    the changed config (what the run trained)."""
    arch = architecture(hf_config)
    values = hf_config.to_dict()
    rope = values.get("rope_parameters")
    model_args = with_token_counts(model_args, HF_TOKEN_COUNT_SETTINGS, "model_args.")
    for key, value in model_args.items():
        field = f"model_args.{key}"
        if key in ("rope_theta", "rope_scaling"):
            if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
                raise ConfigError(field, value, f"{arch} sets RoPE per layer type ({', '.join(rope or {})}): give "
                                                "rope_parameters, the whole mapping, instead")
            if key == "rope_scaling" and not (isinstance(value, dict) and ("rope_type" in value or "type" in value)):
                raise ConfigError(field, value, "a mapping with rope_type (linear, dynamic, yarn, llama3, ...) and its "
                                                "parameters, e.g. {rope_type: yarn, factor: 4.0}")
            rope = {**rope, "rope_theta": value} if key == "rope_theta" else {"rope_theta": rope.get("rope_theta"),
                                                                               **value}
            values["rope_parameters"] = rope
        elif key not in values:
            raise ConfigError(field, value, f"is not a setting of {arch}'s config.json")
        elif has_weights and key in WEIGHT_SHAPE_SETTINGS and value != values[key]:
            raise ConfigError(field, value, f"changes the shape of the checkpoint's weights ({key}={values[key]} in "
                                            "config.json)")
        elif has_weights and key == "num_hidden_layers" and value > values[key]:
            raise ConfigError(field, value, f"the checkpoint has {values[key]} layers: fewer can be taken, not more")
        else:
            values[key] = value
            if key == "num_hidden_layers" and isinstance(values.get("layer_types"), list):
                # each layer's kind (sliding or full attention): the first layers' kept; more layers than
                # listed (a config without weights) take the architecture's default pattern
                kinds = values.pop("layer_types")
                if value <= len(kinds):
                    values["layer_types"] = kinds[:value]
    try:
        return type(hf_config)(**values)
    except Exception as exc:  # noqa: BLE001 - transformers' checks raise ValueError, TypeError and errors of its own
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("model_args", model_args,
                          f"transformers refuses {arch}'s config with them ({first})") from None


def hf_model_problem(hf_config) -> str | None:
    """Why attnpool cannot train this model with its core attention, naming architecture and feature; None
    where it can."""
    model_type = getattr(hf_config, "model_type", None)
    arch = architecture(hf_config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"architecture {arch} (model_type {model_type!r}) is not supported; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(hf_config, "use_bidirectional_attention", False) or getattr(hf_config, "is_causal", True) is False:
        return f"{arch} is configured for non-causal (bidirectional) attention; core attention is causal"
    if getattr(hf_config, "attention_dropout", 0.0):
        return (f"{arch} has attention dropout (attention_dropout={hf_config.attention_dropout}), which core "
                "attention does not apply; set it to 0.0 in config.json")
    return None


def attention_settings(hf_config) -> dict:
    """The attention kinds of a checkpoint's config as attnpool's ModelConfig fields (attnpool.kinds): its
    sliding window and which layers use it, and its attention and output logits' soft-caps (Gemma 2)."""
    window = sliding_window(hf_config)
    layer_types = getattr(hf_config, "layer_types", None)
    return dict(sliding_window=window, layer_types=None if window is None or layer_types is None else tuple(layer_types),
                attn_softcap=getattr(hf_config, "attn_logit_softcapping", None),
                final_softcap=getattr(hf_config, "final_logit_softcapping", None))


def sliding_window(hf_config) -> int | None:
    """The window of the model's sliding-window layers, or None where every layer attends to the whole prefix."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None  # a window in the config that no layer uses (Qwen's max_window_layers)
    return int(window)


