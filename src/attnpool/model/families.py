"""The model spec of a ``model`` setting: a preset's name is attnpool's Llama family
(attnpool.model.llama_spec), ``hf:DIR`` transformers' own model of that directory behind the adapter
(attnpool.model.hf_causal_lm). Each family's module is imported only when it is asked for."""

from __future__ import annotations

from attnpool.model.spec import ModelSpec, hf_model_dir


def model_spec(model: str, model_args: dict | None = None, max_doc_len: int | None = None) -> ModelSpec:
    """The spec of ``model`` with ``model_args`` applied (a preset's fields), checked: a ConfigError names what
    is wrong (an unknown preset or field; a directory transformers cannot read, or an architecture or feature
    core attention cannot run). ``max_doc_len``: the longest document the run feeds it (a sliding window
    never reaching past it is plain causal attention)."""
    directory = hf_model_dir(model)
    if directory is not None:
        from attnpool.model.hf_causal_lm import load_hf_spec

        return load_hf_spec(directory, max_doc_len)
    from attnpool.model.config import model_config
    from attnpool.model.llama_spec import LlamaSpec

    return LlamaSpec(model, model_config(model, **(model_args or {})))
