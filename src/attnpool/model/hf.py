"""Hugging Face checkpoints as attnpool's own model, both ways: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2 and
Gemma 3 (text) read from ``config.json`` and ``*.safetensors`` into attnpool's Transformer, and written back.

A checkpoint is a directory with ``config.json`` and safetensors weights (one file, or shards listed in
``model.safetensors.index.json``). transformers reads the config (its classes fill in each architecture's
defaults, and compute the RoPE variants it defines); the weights are read with ``safetensors`` alone, by
PyTorch's distributed checkpoint reader for Hugging Face files, so that each rank reads only the slices of the
tensors it holds once FSDP2, tensor and pipeline parallelism have cut the model (:func:`load_hf_weights`).

Tensor names map one to one, and no weight is changed on the way (both sides rotate q and k in the same
"rotate half" layout; Gemma's norms keep w of their 1 + w, as attnpool's norms with ``norm_offset`` 1 do):

    embed.weight                         model.embed_tokens.weight
    layers.N.attention_norm.weight       model.layers.N.input_layernorm.weight
    layers.N.attention.{q,k,v,o}_proj.*  model.layers.N.self_attn.{q,k,v,o}_proj.*
    layers.N.attention.{q,k}_norm.*      model.layers.N.self_attn.{q,k}_norm.*            (Qwen3, Gemma 3)
    layers.N.attention_out_norm.weight   model.layers.N.post_attention_layernorm.weight   (Gemma 2, 3)
    layers.N.mlp_norm.weight             model.layers.N.post_attention_layernorm.weight
                                         (Gemma 2, 3: model.layers.N.pre_feedforward_layernorm.weight)
    layers.N.mlp_out_norm.weight         model.layers.N.post_feedforward_layernorm.weight (Gemma 2, 3)
    layers.N.mlp.{gate,up,down}_proj.*   model.layers.N.mlp.{gate,up,down}_proj.*
    norm.weight                          model.norm.weight
    lm_head.weight                       lm_head.weight   (absent when tied)
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from attnpool.errors import ConfigError
from attnpool.model.config import ModelConfig, Rope, RopeScaling
from attnpool.model.hf_config import OWN_MODEL_TYPES, architecture, attention_settings, hf_model_problem
from attnpool.model.llama import Transformer, default_inv_freq

LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
MISTRAL = "MistralForCausalLM"
_ARCHITECTURE_TYPES = {LLAMA: "llama", QWEN2: "qwen2", MISTRAL: "mistral",
                       "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                       "Gemma3ForCausalLM": "gemma3_text"}
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
SANDWICH_NORM_TYPES = ("gemma2", "gemma3_text")  # norms after attention and after the MLP too
QK_NORM_TYPES = ("qwen3", "gemma3_text")
# transformers' activation names -> the gated MLP's (attnpool.model.config.ACTIVATIONS)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# RoPE types whose frequencies change with the length of the sequence at hand: the same as the default RoPE
# while no document is longer than the model's original context (transformers' own dynamic update), refused past.
_LENGTH_DEPENDENT_ROPE = ("dynamic",)

# RoPE types attnpool's model computes (their frequencies as transformers computes them; dynamic: see above).
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "dynamic")

# Tensors some checkpoints carry that a model does not need.
_IGNORED_TENSORS = {"model.rotary_emb.inv_freq"}
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024 ** 3  # what transformers' save_pretrained writes per file by default

_TOP_LEVEL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_MODULE_NAMES = {"attention_norm": "input_layernorm", "attention": "self_attn", "mlp": "mlp",
                       "mlp_norm": "post_attention_layernorm"}
_SANDWICH_LAYER_MODULE_NAMES = {**_LAYER_MODULE_NAMES, "attention_out_norm": "post_attention_layernorm",
                                "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}


def hf_name(name: str, config: ModelConfig) -> str:
    """The Hugging Face name of an entry of the state dict of attnpool's Transformer with ``config``."""
    modules = _SANDWICH_LAYER_MODULE_NAMES if config.sandwich_norms else _LAYER_MODULE_NAMES
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in modules:
        _, index, module, rest = parts
        return f"model.layers.{index}.{modules[module]}.{rest}"
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    raise ConfigError("tensor", name, "is not a tensor of attnpool's Transformer")


def hf_tensors(config: ModelConfig) -> dict[str, tuple[str, torch.Size]]:
    """HF name -> (attnpool name, shape) of every tensor a model with ``config`` has (nothing allocated)."""
    with torch.device("meta"):
        model = Transformer(config)
    return {hf_name(name, config): (name, t.shape) for name, t in model.state_dict().items()}


# --- config.json --------------------------------------------------------------


def as_transformers_config(hf):
    """``hf`` as transformers' config object: a mapping is config.json's content (its model_type, or the
    architecture it names, picks the class, which fills in the architecture's defaults)."""
    if not isinstance(hf, Mapping):
        return hf
    from transformers import AutoConfig

    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type") or _ARCHITECTURE_TYPES.get(architectures[0] if architectures else None)
    if model_type not in OWN_MODEL_TYPES:
        raise ConfigError("architectures", architectures, f"attnpool's model reads {', '.join(_ARCHITECTURE_TYPES)}")
    settings = {k: v for k, v in hf.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **settings)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError("config.json", model_type, f"transformers refuses it ({str(exc).splitlines()[0]})") from None


def config_from_hf(hf, max_doc_len: int | None = None) -> ModelConfig:
    """attnpool's ModelConfig of a checkpoint's config (transformers' object, or config.json's content) of one of
    the families attnpool's model expresses (``OWN_MODEL_TYPES``).

    Refuses, naming the field, what core attention cannot compute (attnpool.model.hf_config.hf_model_problem:
    non-causal attention, attention dropout, ...), and what this model does not
    implement: other activations, MLP or output-projection biases, partial rotary embeddings, RoPE types other
    than default, linear, yarn and llama3, and RoPE whose frequencies follow the sequence's length (``dynamic``)
    where a document (``max_doc_len``; None: any) may be longer than the model's original context.
    """
    hf = as_transformers_config(hf)
    model_type = hf.model_type
    problem = hf_model_problem(hf)
    if problem is not None:
        raise ConfigError("config.json", architecture(hf), problem)
    if model_type not in OWN_MODEL_TYPES:
        raise ConfigError("model_type", model_type, f"attnpool's model expresses {', '.join(OWN_MODEL_TYPES)}; "
                                                    "transformers' modules run others (model_impl: transformers)")
    activation_key = "hidden_activation" if model_type in SANDWICH_NORM_TYPES else "hidden_act"
    activation = getattr(hf, activation_key, None)
    if activation not in _ACTIVATIONS:
        raise ConfigError(activation_key, activation, f"attnpool's gated MLP implements {', '.join(_ACTIVATIONS)}")
    for bias in ("mlp_bias", "attention_bias"):
        if getattr(hf, bias, False):
            raise ConfigError(bias, True, f"{architecture(hf)}'s {bias.split('_')[0]} biases are not implemented "
                                          "in attnpool's model (model_impl: transformers runs them)")
    n_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
    pre_attn_scalar = getattr(hf, "query_pre_attn_scalar", None) if model_type in SANDWICH_NORM_TYPES else None
    gemma = model_type in GEMMA_TYPES
    return ModelConfig(
        vocab_size=hf.vocab_size,
        dim=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(hf, "num_key_value_heads", None) or n_heads,
        ffn_dim=hf.intermediate_size,
        head_dim=head_dim,
        norm_eps=hf.rms_norm_eps,
        **_ropes_from_hf(hf, head_dim, max_doc_len),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases, never an o_proj bias
        qk_norm=model_type in QK_NORM_TYPES,
        sandwich_norms=model_type in SANDWICH_NORM_TYPES,
        norm_offset=1.0 if gemma else 0.0,
        activation=_ACTIVATIONS[activation],
        scale_embeddings=gemma,
        query_scale=None if pre_attn_scalar is None else pre_attn_scalar ** -0.5,
        max_position=getattr(hf, "max_position_embeddings", None),
        **attention_settings(hf),
    )


def _ropes_from_hf(hf, head_dim: int, max_doc_len: int | None) -> dict:
    """The RoPE fields of attnpool's ModelConfig: the default RoPE of one base stays a base and Llama 3.1's its
    RopeScaling (as the presets have them); any other RoPE type, and RoPE per kind of layer (Gemma 3), are given
    whole as transformers computes them (``ropes``)."""
    params = getattr(hf, "rope_parameters", None) or {}
    layer_types = getattr(hf, "layer_types", None)
    if params and all(isinstance(p, Mapping) for p in params.values()):  # one RoPE per kind of layer
        if layer_types is None:
            raise ConfigError("rope_parameters", params, "gives RoPE per layer type, but the config has no layer_types")
        kinds = sorted(set(layer_types))
        return dict(rope_theta=params[kinds[0]].get("rope_theta", 10000.0),
                    ropes=tuple(_rope(hf, head_dim, params[kind], kind, max_doc_len) for kind in kinds),
                    layer_ropes=tuple(kinds.index(t) for t in layer_types))
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        raise ConfigError("partial_rotary_factor", partial, "only full rotary embeddings are implemented")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default")
    if rope_type == "default" or _as_default(hf, params, max_doc_len):
        return dict(rope_theta=theta)
    if rope_type == "llama3":
        return dict(rope_theta=theta, rope_scaling=RopeScaling(
            factor=params["factor"], low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position=params.get("original_max_position_embeddings") or hf.max_position_embeddings))
    return dict(rope_theta=theta, ropes=(_rope(hf, head_dim, params, None, max_doc_len),))


def _as_default(hf, params: Mapping, max_doc_len: int | None) -> bool:
    """Whether a length-dependent RoPE is the default one for every document of the run, else refused."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in _LENGTH_DEPENDENT_ROPE:
        return False
    original = params.get("original_max_position_embeddings") or hf.max_position_embeddings
    if max_doc_len is None or max_doc_len > original:
        have = "no max_doc_len" if max_doc_len is None else f"max_doc_len={max_doc_len}"
        raise ConfigError("rope_parameters.rope_type", rope_type,
                          f"changes every frequency with the length of the sequence past {original} positions, "
                          f"which a packed document's tokens do not know; give --max-doc-len {original} or less "
                          f"({have} now), or a RoPE type that stretches the context once (linear, yarn, llama3)")
    return True


def _rope(hf, head_dim: int, params: Mapping, layer_type: str | None, max_doc_len: int | None) -> Rope:
    rope_type = params.get("rope_type", "default")
    if rope_type == "default" or _as_default(hf, params, max_doc_len):
        inv_freq, factor = default_inv_freq(params.get("rope_theta", 10000.0), head_dim), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_TYPES:
            raise ConfigError("rope_parameters.rope_type", rope_type,
                              f"attnpool's model implements {', '.join(ROPE_TYPES)} RoPE (model_impl: transformers "
                              "runs the others)")
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", layer_type=layer_type)
    return Rope(tuple(inv_freq.float().tolist()), float(factor))


def hf_config_dtype(hf_config) -> torch.dtype:
    """The dtype a checkpoint's config names (what the user brought: an export writes it back so), else float32."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` for transformers of one of attnpool's presets: Qwen2ForCausalLM when q/k/v have biases,
    MistralForCausalLM when every layer slides a window, else LlamaForCausalLM. (A model read from a checkpoint writes
    the checkpoint's own config back: save_hf_checkpoint.) Other attention kinds (some layers windowed, soft-caps)
    have no transformers architecture with a preset's weights, and are refused.

    Written in transformers 4.x's form (``rope_theta`` and ``rope_scaling``),
    which 5.x reads as well.
    """
    if config.ropes is not None or config.qk_norm or config.sandwich_norms or config.norm_offset \
            or config.activation != "silu" or config.scale_embeddings or config.query_scale is not None:
        raise ConfigError("config", "a checkpoint's family", "give the checkpoint's config (save_hf_checkpoint's "
                                                             "hf_config): only the presets' is written from scratch")
    kinds = set(config.layer_kinds())
    windowed = len(kinds) == 1 and next(iter(kinds)).window is not None and next(iter(kinds)).softcap is None
    if any(not kind.causal for kind in kinds) and not (windowed and not config.qkv_bias):
        raise ConfigError("attention kinds", "; ".join(sorted(kind.describe() for kind in kinds)),
                          "no transformers architecture holds a preset's weights with these layers (a window in every "
                          "layer is MistralForCausalLM's; mixed layers and soft-caps are Gemma's, with other weights)")
    arch = QWEN2 if config.qkv_bias else MISTRAL if windowed else LLAMA
    hf = {
        "architectures": [arch],
        "model_type": _ARCHITECTURE_TYPES[arch],
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
    elif arch == MISTRAL:
        hf.update(sliding_window=config.sliding_window)
    else:
        hf.update(use_sliding_window=False)
    return hf


# --- weights ------------------------------------------------------------------


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: those its index lists, else every ``*.safetensors``."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError("model", str(index), f"is not a safetensors index ({type(exc).__name__}: {exc})") from None
        absent = [path.name for path in files if not path.is_file()]
        if absent:
            raise ConfigError("model", str(directory), f"{INDEX_FILE} lists {absent[0]}, which is not there "
                                                       f"({len(absent)} of {len(files)} files missing: an interrupted "
                                                       "download?)")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError("directory", str(directory), "has no *.safetensors files")
    return files


def safetensors_headers(directory) -> dict[str, tuple[tuple, Path]]:
    """Every tensor of the checkpoint in ``directory``: its shape and file, from the files' headers only. A file
    that does not read as safetensors, one its index lists that is not there and one it does not list are refused
    with a ConfigError naming it."""
    directory = Path(directory)
    files = safetensors_files(directory)
    unlisted = sorted(set(directory.glob("*.safetensors")) - set(files))
    if unlisted:  # the reader reads every file of the directory: one the index does not list could shadow a tensor
        raise ConfigError(str(unlisted[0]), None, f"is not listed in {INDEX_FILE}; move it out of the model directory")
    headers: dict[str, tuple[tuple, Path]] = {}
    for path in files:
        try:
            opened = safe_open(path, framework="pt")
        except Exception as exc:  # (safetensors' own error for a damaged header, an OSError)
            raise ConfigError("model", str(path), f"does not read as safetensors ({str(exc).splitlines()[0]})") from None
        with opened as f:
            for name in f.keys():
                headers[name] = (tuple(f.get_slice(name).get_shape()), path)
    return headers


def check_hf_weights(directory, config: ModelConfig) -> dict[str, Path]:
    """Check the checkpoint's tensors against a model with ``config``, reading the files' headers only
    (:func:`safetensors_headers`): a missing, surplus or misshapen tensor is refused with a ConfigError naming it.
    Layers past ``config.n_layers`` are left unread (a run may take fewer layers than the checkpoint has), and so is
    ``lm_head.weight`` where the model ties it to the embedding. Returns the file of each tensor the model reads."""
    expected = hf_tensors(config)
    found: dict[str, Path] = {}
    for name, (shape, path) in safetensors_headers(directory).items():
        if name in _IGNORED_TENSORS or (name == "lm_head.weight" and config.tie_embeddings) \
                or _layer_index(name) >= config.n_layers:
            continue
        if name not in expected:
            raise ConfigError(name, shape, f"is in {path.name} but not in a model with this config.json")
        if shape != tuple(expected[name][1]):
            raise ConfigError(name, shape, f"expected shape {tuple(expected[name][1])} from config.json")
        found[name] = path
    missing = [name for name in expected if name not in found]
    if missing:
        raise ConfigError(missing[0], None, f"missing from the checkpoint ({len(missing)} tensors missing in all)")
    return found


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def load_hf_weights(model: nn.Module, directory, config: ModelConfig) -> None:
    """Fill the weights ``model`` holds (attnpool's Transformer with ``config``, whole, or a pipeline stage of it,
    cut by FSDP2 and tensor parallelism or not) from the checkpoint in ``directory``, converted to their dtype.

    Each rank reads only the slices of the tensors it holds: PyTorch's distributed checkpoint loads a state dict
    of this rank's shards (DTensors) from the safetensors files, each read item a slice of one tensor
    (``safe_open`` + ``get_slice``), copied into its shard. Every rank of the default process group calls it (the
    reader plans the load together). Check the files first (:func:`check_hf_weights`): this reads, it does not
    say what is missing."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = {hf_name(name, config): tensor for name, tensor in model.state_dict().items()}
    reader = dcp.HuggingFaceStorageReader(str(directory))
    one_process = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # DCP's note that it assumes one process, where it is one on purpose
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=reader, no_dist=one_process)


def load_hf_checkpoint(directory, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                       max_doc_len: int | None = None) -> tuple[Transformer, ModelConfig]:
    """Read a Hugging Face checkpoint whole into a Transformer on one process (a run reads it per shard:
    attnpool.model.llama_spec.HFCheckpointSpec). The tensors are checked against ``config.json`` first
    (:func:`check_hf_weights`). ``dtype=None`` keeps the checkpoint's dtype (that of its embedding)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ConfigError("directory", str(directory), "has no config.json")
    config = config_from_hf(json.loads(config_path.read_text()), max_doc_len)
    files = check_hf_weights(directory, config)
    if dtype is None:
        embedding = "model.embed_tokens.weight"
        with safe_open(files[embedding], framework="pt") as f:
            dtype = f.get_slice(embedding)[:0].dtype  # (an empty slice: its dtype, nothing read)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device).to(dtype)
    load_hf_weights(model, directory, config)
    return model, config


def save_hf_checkpoint(model: nn.Module | Mapping[str, Tensor], config: ModelConfig, directory, *,
                       dtype: torch.dtype | None = None, hf_config=None,
                       max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write ``config.json`` and safetensors weights that transformers loads: one ``model.safetensors``, or shards
    of at most ``max_shard_bytes`` with ``model.safetensors.index.json`` (as ``save_pretrained`` writes them).

    ``model`` is a Transformer or its state dict with whole tensors (an FSDP model's shards gathered first, e.g.
    with ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))``).
    ``hf_config``: the config of the checkpoint the model was read from (transformers' object), written back with
    only the dtype changed; None: one of attnpool's presets (:func:`config_to_hf`). ``dtype=None`` keeps the
    weights' dtype. A tied output projection stays tied (no ``lm_head.weight``).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    expected = hf_tensors(config)
    tensors = {}
    for name, tensor in state.items():
        if hasattr(tensor, "full_tensor"):
            raise ConfigError(name, type(tensor).__name__, "is sharded; gather a full state dict first")
        key = hf_name(name, config)
        if key not in expected or tensor.shape != expected[key][1]:
            raise ConfigError(name, tuple(tensor.shape), "does not fit the given config")
        tensors[key] = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
    missing = [key for key in expected if key not in tensors]
    if missing:
        raise ConfigError(missing[0], None, "missing from the model's state dict")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_dtype = dtype or tensors["model.embed_tokens.weight"].dtype
    if hf_config is None:
        (directory / "config.json").write_text(json.dumps(config_to_hf(config, save_dtype), indent=2) + "\n")
    else:
        hf_config = copy.deepcopy(hf_config)
        hf_config.dtype = str(save_dtype).removeprefix("torch.")
        hf_config.save_pretrained(directory)
    shards = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                                max_shard_size=max_shard_bytes)
    for filename, names in shards.filename_to_tensors.items():
        save_file({name: tensors[name] for name in names}, directory / filename, metadata={"format": "pt"})
    if shards.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": shards.tensor_to_filename}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_tokenizer(tokenizer_dir: str, directory) -> None:
    """Write the tokenizer of ``tokenizer_dir`` beside an exported model, as transformers saves it."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(directory)
