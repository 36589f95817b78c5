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

from attnpool.errors import ConfigError, TrainingError, check_checkpoint_source, check_output_directory
from attnpool.model import ModelSpec, model_spec
from attnpool.parallel import RankMesh
from attnpool.train.checkpoint import (MANIFEST, ReadFailure, checkpoint_config, checkpoint_path, fsync_dir,
                                       read_dcp, select_checkpoint, verify_checkpoint)
from attnpool.train.config import TrainConfig
from attnpool.train.data_source import tokenizer_path

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Under the run directory: the model at the end of the run, as transformers reads it (where its spec writes one).
HF_EXPORT_DIR = "hf"  # the end's export
HF_CHECKPOINT_EXPORTS_DIR = "hf-exports"  # one per checkpoint (hf_export_checkpoints), named as the checkpoint


def checkpoint_export_dir(out: str, step: int) -> str:
    """Where hf_export_checkpoints puts the export of step ``step``'s checkpoint."""
    return os.path.join(out, HF_CHECKPOINT_EXPORTS_DIR, os.path.basename(checkpoint_path(out, step)))


def tokenizer_files(directory: str | None) -> str | None:
    """``directory`` where it holds a tokenizer transformers reads (written beside an export), else None."""
    if directory is None:
        return None
    names = ("tokenizer.json", "tokenizer_config.json")
    return directory if any(os.path.isfile(os.path.join(directory, name)) for name in names) else None


def full_model_state(model: torch.nn.Module, mesh: RankMesh) -> dict[str, torch.Tensor] | None:
    """Every weight of the run's model whole, on the host of rank 0 (None on the others; a collective). A stage's
    ranks gather its FSDP2 and tensor-parallel shards; under pipeline parallelism one tensor at a time, each later
    stage's first rank (dp and tp index 0) sending each to rank 0 as it is gathered, so that no rank holds more
    than one whole tensor on its device, and only rank 0 the whole model on its host."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    if mesh.dims.pp == 1:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if rank == 0 else None

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    state = model.state_dict()
    if rank == 0:
        full = {name: whole(t).detach().cpu() for name, t in state.items()}
        device = next(iter(state.values())).device
        for peer in mesh.pp_peers()[1:]:  # each later stage's first rank, in stage order
            shapes = [None]
            dist.recv_object_list(shapes, src=peer)
            for name, shape, dtype in shapes[0]:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, src=peer)
                full[name] = buffer.cpu()
        return full
    sender = mesh.pp_rank > 0 and mesh.dp_rank == 0 and mesh.tp_rank == 0
    if sender:
        dist.send_object_list([[(name, tuple(t.shape), t.dtype) for name, t in state.items()]], dst=0)
    for t in state.values():
        tensor = whole(t)  # (every rank of the stage takes part in gathering it)
        if sender:
            dist.send(tensor.detach().contiguous(), dst=0)
    return None


def export_run_model(model: torch.nn.Module, spec: ModelSpec, config: TrainConfig, mesh: RankMesh,
                     directory: str | None = None) -> str:
    """``directory`` (default OUT/hf): the trained weights (gathered from every rank's shards; a collective) as
    the model's spec writes them, with the tokenizer where there is one. Written beside it and renamed into
    place, so a reader never finds half an export; per-checkpoint exports beyond the newest
    ``keep_checkpoints`` are deleted, as their checkpoints are. Rank 0 writes; what stops it stops every rank
    (none is left waiting for it)."""
    directory = directory or os.path.join(config.run.out, HF_EXPORT_DIR)
    full = full_model_state(model, mesh)
    failure = [None]
    if dist.get_rank() == 0:
        try:
            _write_export(model, spec, config, full, directory)
        except Exception as exc:  # noqa: BLE001 (every failure must reach the ranks waiting below: safetensors'
            # I/O errors, a full disk among them, are not OSErrors; a TrainingError, final: a restart would fail alike)
            failure = [f"the Hugging Face export to {directory} failed: {type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise TrainingError(failure[0])
    return directory


def write_directory_aside(directory: str, write) -> None:
    """``write(path)`` a directory beside ``directory``, then rename it into place: what was there (a resumed run's
    export of the same step, the end's again, an export replaced) goes only once the new one is whole, on disk
    (its files and directory synced before the rename, the parent after). A crash between the two renames left the
    previous export aside: it is put back first, not deleted."""
    partial, replaced = directory + ".partial", directory + ".replaced"
    if not os.path.isdir(directory) and os.path.isdir(replaced):
        os.replace(replaced, directory)
    for stale in (partial, replaced):
        shutil.rmtree(stale, ignore_errors=True)
    write(partial)
    # The files as any other file this user writes (safetensors creates its files 0600): others may read a model
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(partial):
        file = os.path.join(partial, name)
        os.chmod(file, 0o666 & ~umask)
        if os.path.isfile(file):
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(partial)
    if os.path.isdir(directory):
        os.replace(directory, replaced)
    os.replace(partial, directory)
    fsync_dir(os.path.dirname(os.path.abspath(directory)))
    shutil.rmtree(replaced, ignore_errors=True)


def _write_export(model: torch.nn.Module, spec: ModelSpec, config: TrainConfig, full: dict, directory: str) -> None:
    tokenizer = tokenizer_files(tokenizer_path(config, spec))
    write_directory_aside(directory, lambda path: spec.save_hf(model, full, path, tokenizer_dir=tokenizer))
    exports = os.path.dirname(directory)
    if config.checkpoint.keep > 0 and os.path.basename(exports) == HF_CHECKPOINT_EXPORTS_DIR:
        prune_exports(exports, config.checkpoint.keep)
    print(f"hf export: {directory} (transformers: AutoModelForCausalLM.from_pretrained)", flush=True)


def prune_exports(exports: str, keep: int) -> None:
    """Delete the per-checkpoint exports (``step-N``) in ``exports`` but the newest ``keep``, newest by step
    (step-1000000 after step-999999, which their names sort before)."""
    steps = sorted((name for name in os.listdir(exports) if re.fullmatch(r"step-\d+", name)),
                   key=lambda name: int(name.removeprefix("step-")))
    for name in steps[:-keep]:
        shutil.rmtree(os.path.join(exports, name), ignore_errors=True)


def read_checkpoint_model(*, run_dir: str | None = None, checkpoint: str | None = None,
                          allow_unverified: bool = False, check=None):
    """``(model, model spec, the run's settings, checkpoint path, skipped)``: the whole model on the CPU in
    float32 from ``checkpoint``, or from the newest valid checkpoint of ``run_dir`` (``skipped``: (path,
    problem) of newer damaged ones). Every file is checked against the manifest first (one without a manifest
    is read only with ``allow_unverified``: attnpool.train.checkpoint.verify_checkpoint). ``check(settings,
    spec)``, where given, runs before the model is built and its weights read: a caller's refusal that depends
    on the run's settings costs no read of a large model."""
    skipped: list[tuple[str, str]] = []
    check_checkpoint_source(run_dir, checkpoint)
    if checkpoint is not None:
        problem = verify_checkpoint(checkpoint, distributed=False, allow_unverified=allow_unverified)
        if isinstance(problem, ReadFailure):  # (the storage's, not bad input)
            raise problem.error(checkpoint)
        if problem is not None:
            raise ConfigError("checkpoint", checkpoint, problem)
        path, run_dir = checkpoint, os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
    else:
        path, skipped = select_checkpoint(run_dir, distributed=False, allow_unverified=allow_unverified)
        if path is None:
            why = f"no valid checkpoint: {skipped[0][1]}" if skipped else "holds no checkpoint"
            raise ConfigError("run", run_dir, why)
    settings = checkpoint_config(path, run_dir)
    if settings is None:
        raise ConfigError("checkpoint", path, "has no manifest and its run directory no config.yaml: the model's "
                                              "settings are unknown")
    spec = model_spec(settings["model"], settings.get("model_args", {}), settings.get("max_doc_len"),
                      settings["model_impl"])
    if check is not None:
        check(settings, spec)
    model = spec.build_empty("cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process on purpose: DCP's warning that it assumes so is noise here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        read_dcp(state, path)  # only the model's entries: the optimizer's stay on disk
    model.load_state_dict(state["model"])
    return model, spec, settings, path, skipped


def export_hf(*, run_dir: str | None = None, checkpoint: str | None = None, out: str,
              dtype: str = "auto", overwrite: bool = False,
              allow_unverified: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """Write the checkpoint (``checkpoint``, or the newest valid one of ``run_dir``) to ``out`` as the run's end
    writes OUT/hf: config.json, safetensors, the tokenizer where the run had one. ``dtype`` auto: the model's own
    (an hf: model's config.json's; bf16 for a preset). A directory ``out`` that holds files is replaced only with
    ``overwrite``, and only once the new export is whole. Returns the checkpoint's path and the (path, problem) of
    newer ones skipped as damaged. Every file is checked against the manifest first."""
    if dtype not in (*DTYPES, "auto"):
        raise ConfigError("dtype", dtype, f"choose one of auto, {', '.join(DTYPES)}")
    check_export_out(out, overwrite, reads=(run_dir, checkpoint))
    model, spec, settings, path, skipped = read_checkpoint_model(run_dir=run_dir, checkpoint=checkpoint,
                                                                 allow_unverified=allow_unverified)
    tokenizer = tokenizer_files(settings.get("tokenizer") or spec.tokenizer_dir)
    write_directory_aside(out, lambda partial: spec.save_hf(model, model.state_dict(), partial, DTYPES.get(dtype),
                                                            tokenizer_dir=tokenizer))
    return path, skipped


def check_export_out(out: str, overwrite: bool, reads: tuple[str | None, ...] = ()) -> None:
    """Refuse an ``out`` the export cannot or should not write: a file; the run or checkpoint it ``reads``, a
    directory holding one, or a place inside a checkpoint (replacing ``out`` would delete what was trained); a
    directory of a run's checkpoints (``checkpoints/`` or a manifest), ``overwrite`` or not; a directory with
    other files in it (an earlier export?) unless ``overwrite``; a place this process may not write."""
    check_output_directory("out", out)
    target = os.path.realpath(out)

    def within(path: str, parent: str) -> bool:
        return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)

    for source in filter(None, reads):
        source = os.path.realpath(source)
        checkpoints = os.path.join(source, "checkpoints") if os.path.isdir(os.path.join(source, "checkpoints")) \
            else source  # (a run's checkpoints, or the checkpoint itself)
        if within(source, target) or within(target, checkpoints):
            raise ConfigError("out", out, f"is or holds {source}, or lies inside its checkpoints, which the export "
                                          "reads: choose an --out outside them")
    if os.path.isdir(out) and os.listdir(out):
        if os.path.isdir(os.path.join(out, "checkpoints")) or os.path.isfile(os.path.join(out, MANIFEST)):
            raise ConfigError("out", out, "holds a run's checkpoints: an export never replaces them; choose another "
                                          "--out")
        if not overwrite:
            raise ConfigError("out", out, "holds files already: pass --overwrite to replace them, or choose another "
                                          "--out")
