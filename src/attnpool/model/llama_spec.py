"""The model spec of attnpool's Llama-family decoder (the presets: attnpool.model.config.MODEL_PRESETS).

Every feature runs on it. A model small enough is built whole on the compute device, so that its initial
weights do not depend on how it is cut; a larger one is built on the meta device and gets storage shard by
shard once parallelized. Either way its weights are then drawn by name and seed (Transformer.init_weights),
so every layout starts from the one-process model's weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnpool.model.config import ModelConfig
from attnpool.model.hf import save_hf_checkpoint
from attnpool.model.llama import Transformer
from attnpool.model.spec import ModelSpec

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
