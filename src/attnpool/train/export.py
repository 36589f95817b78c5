"""A checkpoint of ``attnpool train`` as a Hugging Face model directory (``attnpool export``).

Checkpoints keep the whole model's weight names under any layout (attnpool.train.checkpoint), so DCP
reads every shard into one process's whole model, with no process group, whatever the ranks, tensor
or pipeline stages that wrote it; the model's settings come from the checkpoint's manifest.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp

from attnpool.errors import ConfigError
from attnpool.model import Transformer, model_config, save_hf_checkpoint
from attnpool.model.hf_causal_lm import build_hf_model, hf_model_dir, load_hf_spec, save_hf_export
from attnpool.train.checkpoint import checkpoint_config, select_checkpoint, verify_checkpoint

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def read_checkpoint_model(*, run_dir: str | None = None, checkpoint: str | None = None):
    """``(model, model config, the run's settings, checkpoint path, skipped)``: the whole model on the CPU in
    float32 from ``checkpoint``, or from the newest valid checkpoint of ``run_dir`` (``skipped``: (path,
    problem) of newer damaged ones). Every file is checked against the manifest first. An ``hf:`` model is
    transformers' own class, from the run's model directory, and its config None."""
    skipped: list[tuple[str, str]] = []
    if checkpoint is not None:
        if not os.path.isdir(checkpoint):
            raise ConfigError("checkpoint", checkpoint, "no such directory")
        problem = verify_checkpoint(checkpoint, distributed=False)
        if problem is not None:
            raise ConfigError("checkpoint", checkpoint, problem)
        path, run_dir = checkpoint, os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
    else:
        if run_dir is None or not os.path.isdir(run_dir):
            raise ConfigError("run", run_dir, "no such run directory")
        path, skipped = select_checkpoint(run_dir, distributed=False)
        if path is None:
            why = f"no valid checkpoint: {skipped[0][1]}" if skipped else "holds no checkpoint"
            raise ConfigError("run", run_dir, why)
    settings = checkpoint_config(path, run_dir)
    if settings is None:
        raise ConfigError("checkpoint", path, "has no manifest and its run directory no config.yaml: the model's "
                                              "settings are unknown")
    hf_dir = hf_model_dir(settings["model"])
    if hf_dir is not None:  # an hf: model: transformers' own classes, from the run's model directory
        model, model_cfg = build_hf_model(load_hf_spec(hf_dir, settings.get("max_doc_len"))), None
    else:
        model_cfg = model_config(settings["model"], **settings.get("model_args", {}))
        with torch.device("meta"):
            model = Transformer(model_cfg)
        model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process on purpose: DCP's warning that it assumes so is noise here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=path)  # only the model's entries: the optimizer's stay on disk
    model.load_state_dict(state["model"])
    return model, model_cfg, settings, path, skipped


def export_hf(*, run_dir: str | None = None, checkpoint: str | None = None, out: str,
              dtype: str = "bf16") -> tuple[str, list[tuple[str, str]]]:
    """Write the checkpoint (``checkpoint``, or the newest valid one of ``run_dir``) to ``out`` as
    config.json and model.safetensors. Returns the checkpoint's path and the (path, problem) of newer ones
    skipped as damaged. Every file is checked against the manifest first."""
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"choose one of {', '.join(DTYPES)}")
    model, model_cfg, _, path, skipped = read_checkpoint_model(run_dir=run_dir, checkpoint=checkpoint)
    if model_cfg is None:  # an hf: model
        save_hf_export(model, model.state_dict(), out, DTYPES[dtype])
    else:
        save_hf_checkpoint(model.state_dict(), model_cfg, out, dtype=DTYPES[dtype])
    return path, skipped
