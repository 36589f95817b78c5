"""The model family of a ``model`` setting, and its spec. attnpool's own Llama-family model
(attnpool.model.llama_spec) runs the presets and ``hf:DIR`` of a family it expresses (``OWN_MODEL_TYPES``: the
checkpoint read into it); transformers' own model of the directory behind the adapter
(attnpool.model.hf_causal_lm) runs ``hf:DIR`` with ``model_impl: transformers``. Each family's module is imported
only when its spec is asked for; what a family cannot run is known without (the config checks it before anything
imports torch: config.json's model_type is read as JSON).
"""

from __future__ import annotations

from typing import Mapping

from attnpool.errors import ConfigError
from attnpool.model.hf_config import OWN_MODEL_TYPES, model_type_of
from attnpool.model.spec import ADAPTER_CANNOT, ModelSpec, hf_model_dir

# family -> feature -> why the family cannot run it: its specs' ``cannot``, known before any is built
CANNOT = {"llama": {}, "hf": ADAPTER_CANNOT}


def family(model: str, impl: str = "auto") -> str:
    """The family of a ``model`` setting run as ``impl`` (``model_impl``): "llama" (attnpool's own model: a
    preset, or hf:DIR of a family it expresses) or "hf" (transformers' modules behind the adapter)."""
    path = hf_model_dir(model)
    if path is None:
        return "llama"
    if impl == "transformers":
        return "hf"
    model_type = model_type_of(path)
    if impl == "attnpool" or model_type is None or model_type in OWN_MODEL_TYPES:
        return "llama"  # (a directory that cannot be read is refused, naming why, when its spec is made)
    return "hf"


def family_cannot(model: str, impl: str = "auto") -> Mapping[str, str]:
    """feature -> why, for what the family of a ``model`` setting cannot run (config.json's model_type at most is
    read)."""
    return CANNOT[family(model, impl)]


def model_spec(model: str, model_args: dict | None = None, max_doc_len: int | None = None,
               impl: str = "auto") -> ModelSpec:
    """The spec of ``model`` with ``model_args`` applied (a preset's fields, or settings of an hf: model's
    config.json), run as ``impl``, checked: a ConfigError names what is wrong (an unknown preset or field; a
    directory transformers cannot read, an architecture or feature core attention cannot run, a checkpoint whose
    tensors do not match its config). ``max_doc_len``: the longest document the run feeds it (a RoPE whose
    frequencies follow the sequence's length is refused where a document may pass the original context)."""
    path = hf_model_dir(model)
    if path is not None:
        from attnpool.model.hf_config import read_hf_config

        hf_config = read_hf_config(path, model_args)
        if family(model, impl) == "hf":
            from attnpool.model.hf_causal_lm import adapter_spec

            return adapter_spec(path, hf_config)
        if hf_config.model_type not in OWN_MODEL_TYPES:  # (model_impl: attnpool)
            raise ConfigError("model_impl", impl, f"attnpool's model expresses {', '.join(OWN_MODEL_TYPES)}, not "
                                                  f"{hf_config.model_type}: use auto or transformers")
        from attnpool.model.llama_spec import load_checkpoint_spec

        return load_checkpoint_spec(path, max_doc_len, hf_config=hf_config)
    from attnpool.model.config import model_config
    from attnpool.model.llama_spec import LlamaSpec

    return LlamaSpec(model, model_config(model, **(model_args or {})))
