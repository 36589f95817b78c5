"""Training: config (one YAML per run), the FSDP2 loop with planned core attention, DCP checkpoints, metrics."""

from attnpool.train.config import TrainConfig, load_config

__all__ = ["TrainConfig", "TrainResult", "load_config", "run", "train"]


def __getattr__(name: str):  # the loop (and torch) on first use: the command line starts without them
    if name in ("TrainResult", "run", "train"):
        from attnpool.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'attnpool.train' has no attribute {name!r}")
