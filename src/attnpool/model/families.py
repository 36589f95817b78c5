"""The model family of a ``model`` setting, and its spec: a preset's name is attnpool's Llama family
(attnpool.model.llama_spec), ``hf:DIR`` transformers' own model of that directory behind the adapter
(attnpool.model.hf_causal_lm). Each family's module is imported only when its spec is asked for; what a family
cannot run is known without (the config checks it before anything imports torch)."""

from __future__ import annotations

from typing import Mapping

from attnpool.model.spec import ADAPTER_CANNOT, ModelSpec, hf_model_dir

# family -> feature -> why the family cannot run it: its specs' ``cannot``, known before any is built
CANNOT = {"llama": {}, "hf": ADAPTER_CANNOT}


def family(model: str) -> str:
    """The family of a ``model`` setting: "hf" for hf:DIR, else "llama" (a preset)."""
    return "hf" if hf_model_dir(model) is not None else "llama"


def family_cannot(model: str) -> Mapping[str, str]:
    """feature -> why, for what the family of a ``model`` setting cannot run (nothing read: it is in the name)."""
    return CANNOT[family(model)]


def model_spec(model: str, model_args: dict | None = None, max_doc_len: int | None = None) -> ModelSpec:
    """The spec of ``model`` with ``model_args`` applied (a preset's fields, or settings of an hf: model's
    config.json), checked: a ConfigError names what is wrong (an unknown preset or field; a directory transformers cannot read, or an architecture or feature
    core attention cannot run). ``max_doc_len``: the longest document the run feeds it (a sliding window
    never reaching past it is plain causal attention)."""
    if family(model) == "hf":
        from attnpool.model.hf_causal_lm import load_hf_spec

        return load_hf_spec(hf_model_dir(model), max_doc_len, model_args)
    from attnpool.model.config import model_config
    from attnpool.model.llama_spec import LlamaSpec

    return LlamaSpec(model, model_config(model, **(model_args or {})))
