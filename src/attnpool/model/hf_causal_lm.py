"""Any Hugging Face causal LM of a supported architecture, trained with attnpool's core attention.

``--model hf:DIR``: transformers builds the model from ``DIR/config.json`` (and its safetensors
weights, if any) with its own modules, so embedding scaling, norms, RoPE variants, q/k norms and MLPs
are the architecture's own. attnpool provides one thing: the attention function, registered with
``transformers.AttentionInterface`` under the name ``attnpool``. Every layer's attention module calls
it with q, k and v after RoPE, and it hands them to the core attention that came with the forward's
keyword arguments (``core_attention``: the same callable ``(q, k, v, *, layer) -> out`` attnpool's own
Transformer takes), so the plan travels with the call and the model never learns which scheduler made
it. Tokens are one packed sequence (batch 1); ``position_ids`` restart at each document, so RoPE sees
positions within the document, and no attention mask is built: core attention is causal within each
document by construction.

The families attnpool's own model expresses (attnpool.model.hf) run there by default, with every feature; this
adapter runs them with ``model_impl: transformers``, including what attnpool's model does not implement (attention
or MLP biases, partial rotary embeddings, other RoPE types). What core attention cannot express is
refused before anything is built (attnpool.model.hf_config.hf_model_problem).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnpool.errors import ConfigError
from attnpool.model.config import ModelConfig
from attnpool.model.hf import (GEMMA_TYPES, QK_NORM_TYPES, SANDWICH_NORM_TYPES, hf_config_dtype, safetensors_headers,
                               save_tokenizer)
from attnpool.model.hf_config import architecture, attention_settings, has_safetensors, read_hf_config
from attnpool.model.llama import chunked_cross_entropy, soft_capped, summed_loss
from attnpool.model.spec import ADAPTER_CANNOT, HF_PREFIX, ModelSpec
from attnpool.kinds import AttentionKind
from attnpool.kinds import check_layer_kind

ATTENTION_NAME = "attnpool"

@dataclass(frozen=True, eq=False)
class HFAdapterSpec(ModelSpec):
    """A Hugging Face model directory, checked, as the model spec of transformers' own model behind attnpool's
    core attention: its config, and attnpool's view of its shape."""

    path: str
    hf_config: object  # transformers.PretrainedConfig
    # The shape the planner, the cost model and the memory model see (heads, head_dim, layers, widths):
    # a Llama-shaped approximation of the architecture, exact in the attention's shape.
    config: ModelConfig
    has_weights: bool  # *.safetensors in the directory: from_pretrained; else random weights from the config
    cannot = ADAPTER_CANNOT
    layer_modules = "transformers"
    writes_hf_export = True

    @property
    def name(self) -> str:
        return HF_PREFIX + self.path

    @property
    def tokenizer_dir(self) -> str:
        return self.path

    @property
    def architecture(self) -> str:
        return architecture(self.hf_config)

    def build(self, device: torch.device | str) -> "HFCausalLM":
        """Built whole on every rank from the directory's weights (or, without any, from the config with the
        global RNG: seed before calling, and every rank starts from the same weights)."""
        return build_hf_model(self, device)

    def build_empty(self, device: torch.device | str) -> "HFCausalLM":
        return build_hf_model(self, device)  # (its rotary embedding's buffers need their values)

    def materialize(self, model: nn.Module, device: torch.device, seed: int, storage: torch.device | None = None):
        """Nothing: the weights came with the build."""

    def num_params(self, model: nn.Module | None = None) -> int:
        return sum(p.numel() for p in (model if model is not None else meta_model(self)).parameters())

    def state_shapes(self) -> dict[str, tuple]:
        return hf_state_shapes(self)

    def save_hf(self, model: "HFCausalLM", state: dict, directory: str, dtype: torch.dtype | None = None,
                tokenizer_dir: str | None = None) -> None:
        """``dtype`` None: the one config.json names (what the user brought), else float32."""
        save_hf_export(model, state, directory, dtype or hf_config_dtype(self.hf_config), tokenizer_dir)


def load_hf_spec(path: str, model_args: dict | None = None) -> HFAdapterSpec:
    """The adapter's spec of ``path`` (its config.json read and checked: attnpool.model.hf_config.read_hf_config)."""
    return adapter_spec(path, read_hf_config(path, model_args))


def adapter_spec(path: str, hf_config) -> HFAdapterSpec:
    """The adapter's spec of ``path`` with its config read and checked, its weight files' headers read (a file
    that does not read is refused here, not in every rank's from_pretrained)."""
    weights = has_safetensors(path)
    if weights:
        safetensors_headers(path)
    return HFAdapterSpec(path, hf_config, planning_config(hf_config), weights)


def planning_config(hf_config) -> ModelConfig:
    """attnpool's ModelConfig of the same shape (heads, head_dim, layers, widths, vocabulary, which norms), for the
    planner's per-head costs and the memory model."""
    n_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        dim=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        ffn_dim=hf_config.intermediate_size,
        head_dim=head_dim,
        norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)) or hf_config.model_type == "qwen2",
        qk_norm=hf_config.model_type in QK_NORM_TYPES,
        sandwich_norms=hf_config.model_type in SANDWICH_NORM_TYPES,
        norm_offset=1.0 if hf_config.model_type in GEMMA_TYPES else 0.0,
        max_position=getattr(hf_config, "max_position_embeddings", None),
        **attention_settings(hf_config),
    )


# --- The attention function ----------------------------------------------------------------------


def attnpool_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                       scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query (1, H_q, T, D), key and value (1, H_kv, T, D) ->
    ((1, T, H_q, D), no weights). Runs the ``core_attention`` the model's forward was given."""
    core_attention = kwargs.get("core_attention")
    if core_attention is None:
        raise ConfigError("attn_implementation", ATTENTION_NAME,
                          "the model was called without core_attention; call it through HFCausalLM")
    if query.shape[0] != 1:
        raise ConfigError("batch", query.shape[0], "attnpool packs documents into one sequence: batch size 1")
    # Checked at start too (hf_config.hf_model_problem); here for a config changed after that.
    if not getattr(module, "is_causal", True):
        raise ConfigError("is_causal", False, f"{type(module).__name__} is non-causal; core attention is causal")
    # what the module asks for (a window, a soft-cap) must be what core attention computes for its layer
    check_layer_kind(core_attention, module.layer_idx, AttentionKind(kwargs.get("sliding_window"), kwargs.get("softcap")))
    if dropout:
        raise ConfigError("attention_dropout", dropout, "core attention does not apply attention dropout")
    # (T, H, D), attnpool's layout, in one dtype: under autocast v comes from a linear layer in the compute
    # dtype, while q and k may have been promoted to float32 by RoPE's or a q/k norm's float32 factors (as
    # transformers' sdpa casts them back under autocast).
    q, k, v = (x[0].transpose(0, 1).to(value.dtype).contiguous() for x in (query, key, value))
    head_dim = q.shape[-1]
    if scaling is not None and scaling != head_dim ** -0.5:
        # Core attention scales scores by D^-1/2; the model's scale (Gemma's query_pre_attn_scalar) goes into q.
        q = q * (scaling * head_dim ** 0.5)
    out = core_attention(q, k, v, layer=module.layer_idx)
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Make ``attn_implementation="attnpool"`` known to transformers (idempotent). No attention-mask
    function is registered for it, so transformers builds no mask (none is needed)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attnpool_attention)


# --- The model -----------------------------------------------------------------------------------


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the interface of attnpool's Transformer: ``model(tokens, positions,
    core_attention, labels=...)`` on one packed sequence, ``layers`` (index -> decoder layer, for FSDP2 and
    activation checkpointing) and ``output_weight``. Its weights keep transformers' names under ``hf.``."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.cross_entropy = chunked_cross_entropy  # the loss of ``labels`` (model.fused_loss picks it)

    @property
    def config(self):
        return self.hf.config

    @property
    def layers(self) -> dict[str, nn.Module]:
        return {str(i): layer for i, layer in enumerate(self.hf.model.layers)}

    @property
    def output_weight(self) -> Tensor:
        return self.hf.get_output_embeddings().weight

    def forward(self, tokens: Tensor, positions: Tensor, attention, *, return_hidden: bool = False,
                labels: Tensor | None = None) -> Tensor:
        """Logits (T, vocab) of tokens (T,) at in-document positions (T,); the summed token loss with
        ``labels`` (computed in chunks, as Transformer's); the final normed hidden states with
        ``return_hidden``."""
        if isinstance(tokens, (list, tuple)):
            raise ConfigError("pingpong", True, "hf: models run one batch at a time (no interleaved nano-batches)")
        if tokens.dim() != 1 or positions.shape != tokens.shape:
            raise ConfigError("tokens", tuple(tokens.shape), f"must be one flat sequence (T,) with positions of the "
                                                             f"same shape, not {tuple(positions.shape)}")
        hidden = self.hf.model(input_ids=tokens[None], position_ids=positions[None], core_attention=attention,
                               use_cache=False).last_hidden_state[0]
        softcap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 2's
        if labels is not None:
            return summed_loss(self.cross_entropy, hidden, self.output_weight, labels, softcap)
        if return_hidden:
            return hidden
        return soft_capped(self.hf.get_output_embeddings()(hidden), softcap)


def build_hf_model(spec: HFAdapterSpec, device: torch.device | str = "cpu") -> HFCausalLM:
    """The model in float32 (the master weights; compute may run in bf16 under autocast and FSDP2's mixed
    precision), from the directory's safetensors or, without any, initialised from the config by
    transformers (seed before calling: every rank then starts from the same weights)."""
    from transformers import AutoModelForCausalLM

    register_attention()
    options = dict(dtype=torch.float32, attn_implementation=ATTENTION_NAME)
    with _without_progress_bars():
        if spec.has_weights:
            hf_model = AutoModelForCausalLM.from_pretrained(spec.path, config=spec.hf_config, local_files_only=True,
                                                            **options)
        else:
            hf_model = AutoModelForCausalLM.from_config(spec.hf_config, **options)
    return HFCausalLM(hf_model.to(device).train())


@contextlib.contextmanager
def _without_progress_bars():
    """transformers' bars for reading and writing weights: one per rank at every start, noise in a run's log."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def meta_model(spec: HFAdapterSpec) -> HFCausalLM:
    """The model built on the meta device from the config: its names and shapes, nothing allocated or read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return HFCausalLM(AutoModelForCausalLM.from_config(spec.hf_config, dtype=torch.float32))


def hf_state_shapes(spec: HFAdapterSpec) -> dict[str, tuple]:
    """Name -> shape of every entry of the model's state dict, to check a checkpoint against before loading it."""
    return {name: tuple(t.shape) for name, t in meta_model(spec).state_dict().items()}


def save_hf_export(model: HFCausalLM, full_state: dict[str, Tensor], directory: str, dtype: torch.dtype,
                   tokenizer_path: str | None = None) -> None:
    """Write ``full_state`` (whole tensors, names under ``hf.``) in ``dtype`` with ``save_pretrained``:
    config.json and safetensors that transformers loads with its own attention; the tokenizer beside them
    where one is given."""
    prefix = "hf."
    state = {name[len(prefix):]: t.to(dtype) if t.is_floating_point() else t
             for name, t in full_state.items() if name.startswith(prefix)}
    config = model.hf.config
    implementation, model_dtype = config._attn_implementation, config.dtype
    config._attn_implementation = "sdpa"  # what a later reader gets by default (attnpool's is registered here only)
    config.dtype = dtype  # the weights' as written, not the float32 of the master weights
    try:
        with _without_progress_bars():
            model.hf.save_pretrained(directory, state_dict=state, safe_serialization=True)
    finally:
        config._attn_implementation, config.dtype = implementation, model_dtype
    if tokenizer_path is not None:
        save_tokenizer(tokenizer_path, directory)
