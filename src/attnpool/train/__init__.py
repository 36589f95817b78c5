"""Training: config (one YAML per run), the FSDP2 loop with planned core attention, DCP checkpoints, metrics."""

from attnpool.train.config import TrainConfig, load_config
from attnpool.train.train import TrainResult, run, train

__all__ = ["TrainConfig", "TrainResult", "load_config", "run", "train"]
