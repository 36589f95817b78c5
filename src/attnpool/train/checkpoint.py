"""Checkpoints with torch.distributed.checkpoint (DCP): everything a run needs to continue exactly.

One checkpoint is one directory ``OUT/checkpoints/step-NNNNNN`` that DCP writes
from every rank at once: the sharded model and optimizer state (resharded on
load, so the number of ranks may change), the learning-rate schedule, the
position of the document stream, the step, and each rank's RNG state. DCP
writes ``.metadata`` last, so a directory without it is an unfinished save and
is ignored.
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from attnpool.errors import ConfigError
from attnpool.model import ModelConfig, Transformer

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(out: str) -> str:
    return os.path.join(out, "checkpoints")


def checkpoint_path(out: str, step: int) -> str:
    return os.path.join(checkpoint_root(out), f"step-{step:06d}")


def finished_checkpoints(out: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in the run directory, oldest first."""
    root = checkpoint_root(out)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, ".metadata")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(out: str) -> str | None:
    done = finished_checkpoints(out)
    return done[-1][1] if done else None


def _rng_key(rank: int) -> str:
    return f"rng.rank{rank}"


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def check_compatible(path: str, model_config: ModelConfig) -> None:
    """Refuse a checkpoint whose model weights do not fit this model (names and shapes), before loading."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # a corrupt or foreign directory
        raise ConfigError("resume", path, f"not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    saved = {key[len("model."):]: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(meta, "size")}
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(model_config).state_dict().items()}
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    wrong = [k for k in expected if k in saved and saved[k] != expected[k]]
    if not (missing or extra or wrong):
        return
    if wrong:
        k = wrong[0]
        detail = f"{k} is {list(saved[k])} in the checkpoint but {list(expected[k])} in this model"
    elif missing:
        detail = f"{len(missing)} weights of this model are not in the checkpoint (first: {missing[0]})"
    else:
        detail = f"the checkpoint holds {len(extra)} weights this model lacks (first: {extra[0]})"
    raise ConfigError("resume", path, f"the checkpoint is of another model shape: {detail}")


def save_checkpoint(path: str, model, optimizer, scheduler, stream, step: int, extra: dict | None = None,
                    device: torch.device | None = None) -> None:
    """Write a checkpoint from every rank (a collective: call it on all ranks).

    ``extra``: more state by name, each an object with ``state_dict()`` (e.g. the sparse planning prior).
    ``device``: the rank's compute device, whose RNG is saved (default: the parameters', which
    optimizer offload keeps on the CPU)."""
    rank = dist.get_rank()
    model_state, optim_state = get_state_dict(model, optimizer)
    device = device or next(model.parameters()).device
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict(),
             "data": stream.state_dict(), "step": step, _rng_key(rank): _rng_state(device)}
    state.update({name: obj.state_dict() for name, obj in (extra or {}).items()})
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path: str, model, optimizer, scheduler, stream, extra: dict | None = None,
                    device: torch.device | None = None) -> int:
    """Restore everything :func:`save_checkpoint` wrote; returns the step it was taken after.

    Each ``extra`` object the checkpoint holds state for gets ``load_state_dict``; one it
    holds none for (a checkpoint of a run without it) keeps its fresh state."""
    rank = dist.get_rank()
    model_state, optim_state = get_state_dict(model, optimizer)
    device = device or next(model.parameters()).device
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict(),
             "data": stream.state_dict(), "step": 0}
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    # The RNG state is per rank; a run resumed on more ranks than it was saved from
    # keeps its fresh seed on the new ones.
    has_rng = any(k.startswith(_rng_key(rank) + ".") for k in keys)
    if has_rng:
        state[_rng_key(rank)] = _rng_state(device)
    saved_extra = {name: obj for name, obj in (extra or {}).items() if any(k.startswith(name + ".") for k in keys)}
    state.update({name: obj.state_dict() for name, obj in saved_extra.items()})
    dcp.load(state, checkpoint_id=path)
    for name, obj in saved_extra.items():
        obj.load_state_dict(state[name])
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    if has_rng:
        rng = state[_rng_key(rank)]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    return int(state["step"])
