"""Training: config (sections, one YAML per run), the run spec, step runners over FSDP2 and planned core
attention, DCP checkpoints, metrics, launching. docs/ARCHITECTURE.md draws how they fit together."""

from attnpool.train.config import TrainConfig, load_config

__all__ = ["TrainConfig", "TrainResult", "load_config", "run", "train"]


def __getattr__(name: str):  # the loop (and torch) on first use: the command line starts without them
    if name in ("TrainResult", "train"):
        from attnpool.train import loop

        return getattr(loop, name)
    if name == "run":
        from attnpool.train.launch import run

        return run
    raise AttributeError(f"module 'attnpool.train' has no attribute {name!r}")
