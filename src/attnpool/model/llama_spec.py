"""The model specs of attnpool's Llama-family decoder: the presets (attnpool.model.config.MODEL_PRESETS), and a
Hugging Face checkpoint of a family it expresses (``hf:DIR``: Llama, Mistral, Qwen2, Qwen3, Gemma 1-3).

Every feature runs on it. A model small enough is built whole on the compute device, so that its initial
weights do not depend on how it is cut; a larger one is built on the meta device and gets storage shard by
shard once parallelized. Either way its weights are then drawn by name and seed (Transformer.init_weights),
so every layout starts from the one-process model's weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnpool.errors import ConfigError
from attnpool.model.config import ModelConfig
from attnpool.model.hf import (check_hf_weights, config_from_hf, hf_config_dtype, load_hf_weights, save_hf_checkpoint,
                              save_tokenizer)
from attnpool.model.hf_config import has_safetensors, read_hf_config
from attnpool.model.llama import Transformer
from attnpool.model.spec import HF_PREFIX, ModelSpec

# Models above this many weights are built on the meta device and initialised shard by shard.
META_INIT_PARAMS = 1_000_000_000


@dataclass(frozen=True)
class LlamaSpec(ModelSpec):
    name: str
    config: ModelConfig

    @property
    def builds_on_meta(self) -> bool:
        return self.config.num_params() > META_INIT_PARAMS

    def build(self, device: torch.device | str) -> Transformer:
        return self._transformer("meta" if self.builds_on_meta else device)

    def build_empty(self, device: torch.device | str) -> Transformer:
        return self._transformer("meta").to_empty(device=device)

    def _transformer(self, device: torch.device | str) -> Transformer:
        with torch.device(device):
            return Transformer(self.config)

    def materialize(self, model: nn.Module, device: torch.device, seed: int, storage: torch.device | None = None):
        """Drawn per weight by name and seed, whole, each rank keeping its part (Transformer.init_weights). Built
        on the meta device, the weights first get storage on ``storage`` (default ``device``; the host, where
        FSDP2 offloads the optimizer)."""
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device=storage or device)
        model.init_weights(seed=seed, device=device)

    def num_params(self, model: nn.Module | None = None) -> int:
        return self.config.num_params()

    def state_shapes(self) -> dict[str, tuple]:
        return {name: tuple(t.shape) for name, t in self._transformer("meta").state_dict().items()}

    def save_hf(self, model: nn.Module, state: dict, directory: str, dtype: torch.dtype | None = None,
                tokenizer_dir: str | None = None) -> None:
        save_hf_checkpoint(state, self.config, directory, dtype=dtype or torch.bfloat16)


@dataclass(frozen=True, eq=False)
class HFCheckpointSpec(LlamaSpec):
    """A Hugging Face model directory of a family attnpool's model expresses, as that model: built on the meta
    device from config.json, each rank reading only its shards of the safetensors weights once every
    parallelism has cut it (attnpool.model.hf.load_hf_weights), in the run's dtype. A directory without weights
    (a config alone) starts from weights drawn as a preset's. Written back with the checkpoint's own config."""

    path: str = ""
    hf_config: object = None  # transformers.PretrainedConfig, with the run's model_args in it
    has_weights: bool = False
    writes_hf_export = True

    @property
    def tokenizer_dir(self) -> str:
        return self.path

    @property
    def builds_on_meta(self) -> bool:
        return self.has_weights or super().builds_on_meta

    def materialize(self, model: nn.Module, device: torch.device, seed: int, storage: torch.device | None = None):
        """Read from the directory's safetensors, each rank its own slices (every rank calls it), or, without
        weights, drawn as a preset's."""
        if not self.has_weights:
            return super().materialize(model, device, seed, storage)
        model.to_empty(device=storage or device)
        load_hf_weights(model, self.path, self.config)

    def save_hf(self, model: nn.Module, state: dict, directory: str, dtype: torch.dtype | None = None,
                tokenizer_dir: str | None = None) -> None:
        """``dtype`` None: the one config.json names (what the user brought), else float32."""
        save_hf_checkpoint(state, self.config, directory, dtype=dtype or hf_config_dtype(self.hf_config),
                           hf_config=self.hf_config)
        if tokenizer_dir is not None:
            save_tokenizer(tokenizer_dir, directory)


def load_checkpoint_spec(path: str, max_doc_len: int | None = None, model_args: dict | None = None,
                         hf_config=None) -> HFCheckpointSpec:
    """The spec of the checkpoint in ``path`` as attnpool's model: its config.json read and checked
    (attnpool.model.hf_config.read_hf_config, or ``hf_config`` already read so), its tensors' names and shapes
    checked against it (headers only; a ConfigError names a missing, surplus or misshapen tensor)."""
    hf_config = hf_config if hf_config is not None else read_hf_config(path, model_args)
    try:
        config = config_from_hf(hf_config, max_doc_len)
    except ConfigError as exc:
        raise ConfigError("model", HF_PREFIX + path, f"{exc.field}={exc.value!r}: {exc.problem}") from None
    weights = has_safetensors(path)
    if weights:
        check_hf_weights(path, config)
    return HFCheckpointSpec(HF_PREFIX + path, config, path=path, hf_config=hf_config, has_weights=weights)

