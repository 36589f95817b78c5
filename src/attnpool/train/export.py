"""Models as Hugging Face directories: a run's trained model at its end (``OUT/hf``, and one per checkpoint with
hf_export_checkpoints), and any checkpoint afterwards (``attnpool export``).

Checkpoints keep the whole model's weight names under any layout (attnpool.train.checkpoint), so DCP reads
every shard into one process's whole model, with no process group, whatever the ranks, tensor or pipeline
stages that wrote it; the model's settings come from the checkpoint's manifest. The model's spec
(attnpool.model.spec) writes it, under the names and in the config.json its family uses.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from attnpool.errors import ConfigError
from attnpool.model import ModelSpec, model_spec
from attnpool.model.spec import hf_model_dir
from attnpool.train.checkpoint import checkpoint_config, checkpoint_path, select_checkpoint, verify_checkpoint
from attnpool.train.config import TrainConfig
from attnpool.train.data_source import tokenizer_path

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Under the run directory: the model at the end of the run, as transformers reads it (where its spec writes one).
HF_EXPORT_DIR = "hf"  # the end's export
HF_CHECKPOINT_EXPORTS_DIR = "hf-exports"  # one per checkpoint (hf_export_checkpoints), named as the checkpoint


def checkpoint_export_dir(out: str, step: int) -> str:
    """Where hf_export_checkpoints puts the export of step ``step``'s checkpoint."""
    return os.path.join(out, HF_CHECKPOINT_EXPORTS_DIR, os.path.basename(checkpoint_path(out, step)))


def full_model_state(model: torch.nn.Module, pp: int) -> dict[str, torch.Tensor] | None:
    """Every weight of the run's model whole, on the host of rank 0 (None on the others; a collective). A stage's
    ranks gather its FSDP2 and tensor-parallel shards; with pipeline stages, each stage's first rank then sends its
    stage's weights to rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    if pp == 1:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    stage = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
             for name, t in model.state_dict().items()}
    world, rank = dist.get_world_size(), dist.get_rank()
    stages = [None] * world if rank == 0 else None
    dist.gather_object(stage if rank % (world // pp) == 0 else {}, stages, dst=0)
    return {name: t for part in stages for name, t in part.items()} if rank == 0 else None


def export_run_model(model: torch.nn.Module, spec: ModelSpec, config: TrainConfig, directory: str | None = None) -> str:
    """``directory`` (default OUT/hf): the trained weights (gathered from every rank's shards; a collective) as
    the model's spec writes them, with the tokenizer where there is one. Written beside it and renamed into
    place, so a reader never finds half an export; per-checkpoint exports beyond the newest
    ``keep_checkpoints`` are deleted, as their checkpoints are."""
    directory = directory or os.path.join(config.run.out, HF_EXPORT_DIR)
    full = full_model_state(model, config.parallel.pp)
    if dist.get_rank() == 0:
        tokenizer = tokenizer_path(config, spec)
        has_tokenizer = tokenizer is not None and any(
            os.path.isfile(os.path.join(tokenizer, name)) for name in ("tokenizer.json", "tokenizer_config.json"))
        partial, replaced = directory + ".partial", directory + ".replaced"
        for stale in (partial, replaced):
            shutil.rmtree(stale, ignore_errors=True)
        spec.save_hf(model, full, partial, tokenizer_dir=tokenizer if has_tokenizer else None)
        if os.path.isdir(directory):  # a resumed run's export of the same step, or the end's again
            os.replace(directory, replaced)
        os.replace(partial, directory)
        shutil.rmtree(replaced, ignore_errors=True)
        exports = os.path.dirname(directory)
        keep = config.checkpoint.keep
        if keep > 0 and os.path.basename(exports) == HF_CHECKPOINT_EXPORTS_DIR:
            finished = sorted(name for name in os.listdir(exports) if re.fullmatch(r"step-\d+", name))
            for name in finished[:-keep]:
                shutil.rmtree(os.path.join(exports, name), ignore_errors=True)
        print(f"hf export: {directory} (transformers: AutoModelForCausalLM.from_pretrained)", flush=True)
    dist.barrier()
    return directory


def read_checkpoint_model(*, run_dir: str | None = None, checkpoint: str | None = None):
    """``(model, model spec, the run's settings, checkpoint path, skipped)``: the whole model on the CPU in
    float32 from ``checkpoint``, or from the newest valid checkpoint of ``run_dir`` (``skipped``: (path,
    problem) of newer damaged ones). Every file is checked against the manifest first."""
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
    # Runs from before model_impl ran every hf: model through transformers' modules (their weights' names).
    impl = settings.get("model_impl") or ("transformers" if hf_model_dir(settings["model"]) else "auto")
    spec = model_spec(settings["model"], settings.get("model_args", {}), settings.get("max_doc_len"), impl)
    model = spec.build_empty("cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process on purpose: DCP's warning that it assumes so is noise here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=path)  # only the model's entries: the optimizer's stay on disk
    model.load_state_dict(state["model"])
    return model, spec, settings, path, skipped


def export_hf(*, run_dir: str | None = None, checkpoint: str | None = None, out: str,
              dtype: str = "bf16") -> tuple[str, list[tuple[str, str]]]:
    """Write the checkpoint (``checkpoint``, or the newest valid one of ``run_dir``) to ``out`` as
    config.json and model.safetensors. Returns the checkpoint's path and the (path, problem) of newer ones
    skipped as damaged. Every file is checked against the manifest first."""
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, f"choose one of {', '.join(DTYPES)}")
    model, spec, _, path, skipped = read_checkpoint_model(run_dir=run_dir, checkpoint=checkpoint)
    spec.save_hf(model, model.state_dict(), out, DTYPES[dtype])
    return path, skipped
