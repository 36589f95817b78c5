"""Model specs: what the trainer needs of a model family, so that it never asks which family it trains.

A spec says how to build the model (on the meta device where it is too large to build whole on one device),
how its weights get their values once every parallelism has been applied (drawn, or read from the user's
files), how many weights it has and under which names (a checkpoint is checked against them before it is
loaded), how to write it as a Hugging Face model, and which features it can run. What a family cannot run is
refused by name when the run starts, before any process group exists. A spec is made checked
(attnpool.model.families.model_spec): that core attention computes what every layer's attention needs (causal
attention within each document, under each layer's sliding window and soft-cap: its attention kind).

The families (attnpool.model.families picks one from the ``model`` and ``model_impl`` settings, and says what it
cannot run):

- attnpool's Llama-family decoder (attnpool.model.llama_spec), every feature: the presets, and ``hf:DIR`` of a
  family it expresses (Llama, Mistral, Qwen2, Qwen3, Gemma 1-3: attnpool.model.hf reads the checkpoint into it).
- ``hf:DIR`` with ``model_impl: transformers``: transformers' own model of that directory behind attnpool's core
  attention (attnpool.model.hf_causal_lm): what :data:`ADAPTER_CANNOT` lists is refused.

No torch here: the config checks the families' limits before anything imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch
    from torch import nn

    from attnpool.model.config import ModelConfig

HF_PREFIX = "hf:"  # ``model: hf:DIR`` is a Hugging Face model directory
# How an hf: model runs (``model_impl``): auto (attnpool's own model where it expresses the family, else
# transformers'), attnpool, or transformers (its modules behind the adapter).
MODEL_IMPLS = ("auto", "attnpool", "transformers")

# What transformers' modules behind the adapter cannot run, and why. A feature is a setting that asks for it
# (tp, pp, pingpong, keep_attention, compile; model_args for a family that takes none: train.config maps each to
# its key) or ``eval`` (attnpool eval's retrieval probes).
ADAPTER_CANNOT = {
    "tp": "tensor parallelism splits attnpool's own layers only",
    "pp": "pipeline stages split attnpool's own layers only",
    "pingpong": "ping-pong interleaves attnpool's own layers only",
    "keep_attention": "keep_attention recomputes attnpool's own linear parts only; use full",
    "compile": "it compiles attnpool's own layers' linear parts only",
    "eval": "attnpool eval runs attnpool's own models (--model tiny, llama3-8b, ...)",
}


def hf_model_dir(model: str) -> str | None:
    """DIR of a ``model`` setting ``hf:DIR``; None for attnpool's own presets."""
    return model[len(HF_PREFIX):] if model.startswith(HF_PREFIX) else None


class ModelSpec:
    """One model of a family, as a run configures it. Subclasses set the attributes and implement the methods.

    Build and materialize come in that order around attnpool.parallel.parallelize::

        model = spec.build(device)                      # the meta device where spec.builds_on_meta
        model = parallelize(model, run_spec, mesh)      # tp, compile, checkpointing, loss, FSDP2
        spec.materialize(model, device, seed)           # storage where built on meta, then the weights' values

    The model it builds has attnpool's model interface: ``model(tokens, positions, core_attention,
    labels=...)`` on one packed sequence, ``layers`` (index -> block, the FSDP2 and checkpointing units),
    ``output_weight`` and ``cross_entropy`` (the loss kernel's slot).
    """

    name: str  # the ``model`` setting (a preset's name, or hf:DIR)
    config: "ModelConfig"  # the shape the planner, the cost model and the memory model see
    cannot: Mapping[str, str] = {}  # feature -> why this family cannot run it (see ADAPTER_CANNOT)
    # Whose modules compute the layers: "attnpool" (attnpool.model.llama) or "transformers" (the adapter); they
    # keep different tensors for the backward (attnpool.train.memory.saved_per_layer).
    layer_modules: str = "attnpool"
    builds_on_meta: bool = False  # too large to build whole: built on the meta device, materialized per shard
    tokenizer_dir: str | None = None  # the tokenizer that comes with the model (hf: and jsonl data default to it)
    writes_hf_export: bool = False  # the end of a run (and hf_export_checkpoints) writes it as a Hugging Face model

    def build(self, device: "torch.device | str") -> "nn.Module":
        """The whole model on ``device``, or on the meta device where the family builds it there
        (``builds_on_meta``); :meth:`materialize` gives its weights their values once it is parallelized."""
        raise NotImplementedError

    def build_empty(self, device: "torch.device | str") -> "nn.Module":
        """The whole model on ``device`` with storage for its weights but no values computed for them, where the
        family can skip them: a checkpoint is about to fill them (attnpool export, attnpool eval)."""
        raise NotImplementedError

    def materialize(self, model: "nn.Module", device: "torch.device", seed: int,
                    storage: "torch.device | None" = None) -> None:
        """Give a model built by :meth:`build` and parallelized its weights' values (and, built on the meta
        device, their storage on ``storage``, default ``device``: the host where FSDP2 offloads the optimizer)."""
        raise NotImplementedError

    def num_params(self, model: "nn.Module | None" = None) -> int:
        raise NotImplementedError

    def state_shapes(self) -> dict[str, tuple]:
        """Name -> shape of every entry of the model's state dict (nothing allocated)."""
        raise NotImplementedError

    def save_hf(self, model: "nn.Module", state: dict, directory: str, dtype: "torch.dtype | None" = None,
                tokenizer_dir: str | None = None) -> None:
        """Write ``state`` (the whole tensors of ``model``, the model this spec built, under its names) as a Hugging
        Face model directory transformers loads: config.json and safetensors, the tokenizer beside them where one
        is given; ``dtype`` None: the family's own choice."""
        raise NotImplementedError
