"""Resuming a run: which checkpoint it continues from, whether that checkpoint fits the model and the settings,
and the run directory's config.yaml.

A resume takes the newest checkpoint whose every file matches its manifest (attnpool.train.checkpoint),
skipping newer damaged ones; it is refused where none is valid, where the checkpoint is of another model
shape, or where a setting that changes what the run computes (config.RUN_FIELDS) differs from the
checkpoint's, unless allow_config_change.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from attnpool.comm import agree
from attnpool.errors import ConfigError
from attnpool.model import ModelSpec
from attnpool.model.config import TOKEN_COUNT_FIELDS
from attnpool.model.hf_config import HF_TOKEN_COUNT_SETTINGS
from attnpool.sizes import with_token_counts
from attnpool.train.checkpoint import (check_compatible, checkpoint_config, checkpoint_root, finished_checkpoints,
                                       select_checkpoint)
from attnpool.train.config import RUN_FIELDS, TrainConfig, load_config, save_config
from attnpool.train.metrics import METRICS_FILE


def config_changes(config: TrainConfig, checkpoint: str) -> list[tuple[str, object, object]]:
    """(key, the checkpoint's value, this config's) of every setting that changes what the run computes
    (config.RUN_FIELDS); refused unless ``allow_config_change``."""
    saved = checkpoint_config(checkpoint, config.run.out)
    if saved is None:
        return []
    now = config.to_dict()
    changes = [(k, saved[k], now[k]) for k in RUN_FIELDS if k in saved and not _same_setting(k, saved[k], now[k])]
    if changes and not config.checkpoint.allow_config_change:
        key, before, after = changes[0]
        also = f" (also {', '.join(k for k, _, _ in changes[1:])})" if len(changes) > 1 else ""
        raise ConfigError(key, after, f"the checkpoint's run has {key}={before!r}{also}: resuming with another value "
                                      "changes the run; pass --allow-config-change to continue with it")
    return changes


# model_args keys that hold a token count, which a user may write as a size ('4K') or a number (4096), for either
# kind of model (attnpool's presets, a Hugging Face config)
TOKEN_COUNT_MODEL_ARGS = tuple(dict.fromkeys(TOKEN_COUNT_FIELDS + HF_TOKEN_COUNT_SETTINGS))


def _same_setting(key: str, saved, now) -> bool:
    """Whether a setting is unchanged; model_args' token counts compared as counts, so '4K' is 4096."""
    if key == "model_args" and isinstance(saved, dict) and isinstance(now, dict):
        try:
            return with_token_counts(saved, TOKEN_COUNT_MODEL_ARGS) == with_token_counts(now, TOKEN_COUNT_MODEL_ARGS)
        except ConfigError:  # not a count either way: compared as written
            pass
    return saved == now


# The settings that choose the documents a run reads: changed with allow_config_change, the data at a checkpoint's
# place is another by intent (attnpool.data.DocumentStream's fingerprint is then not compared).
DATA_FIELDS = frozenset({"data", "data_path", "data_args", "tokenizer"})


def changes_data(config: TrainConfig, checkpoint: str) -> bool:
    """Whether resuming ``config`` from ``checkpoint`` changes the data on purpose (allowed config changes)."""
    return any(key in DATA_FIELDS for key, _, _ in config_changes(config, checkpoint))


def refuse_damaged(out: str, skipped: list[tuple[str, str]]) -> None:
    """Refuse a resume whose every checkpoint is damaged, naming the newest one's problem."""
    if skipped:
        more = f" (and {len(skipped) - 1} older checkpoints are damaged too)" if len(skipped) > 1 else ""
        raise ConfigError("resume", out, f"no valid checkpoint: {skipped[0][1]}{more}")


def refuse_earlier_run(config: TrainConfig) -> None:
    """Refuse a run without ``resume`` into a run directory that holds checkpoints: they are another run's."""
    if finished_checkpoints(config.run.out):
        raise ConfigError("out", config.run.out, "holds checkpoints of an earlier run: pass --resume to continue "
                                                 "it, or choose another --out")


def refuse_overwriting_a_run(config: TrainConfig) -> None:
    """Refuse a new run (not resumed, not ``overwrite``) into a run directory that holds an earlier run's metrics:
    they would be replaced. (With checkpoints, setup's refuse_earlier_run says so; a launcher asks this once,
    before its first attempt: a restart's workers find the metrics of the attempt before.)"""
    out = config.run.out
    metrics = os.path.join(out, METRICS_FILE)
    # (an empty one is a run that stopped before its first step: nothing of it to lose)
    if config.checkpoint.resume or config.run.overwrite or not os.path.isfile(metrics) \
            or os.path.getsize(metrics) == 0 or finished_checkpoints(out):
        return
    raise ConfigError("out", out, "holds an earlier run's metrics.jsonl: pass --overwrite to replace them, or "
                                  "choose another --out")


def resume_candidate(config: TrainConfig, model: ModelSpec) -> str:
    """Before any process group: the checkpoint a resume continues from (sizes and manifests only; every file's
    hash is checked once the ranks can share the work), checked against the model and the settings."""
    out = config.run.out
    found, skipped = select_checkpoint(out, checksum=False, distributed=False,
                                       allow_unverified=config.checkpoint.allow_unverified)
    if found is None:
        refuse_damaged(out, skipped)
        raise ConfigError("resume", out, f"no finished checkpoint in {checkpoint_root(out)}")
    check_compatible(found, model.state_shapes())
    config_changes(config, found)
    return found


def verified_checkpoint(config: TrainConfig, model: ModelSpec, candidate: str) -> str:
    """The newest checkpoint whose every file matches its manifest's hash (the ranks share the hashing and
    agree); rank 0 says which newer ones it skipped. Refused on every rank alike where none is valid; one
    other than ``candidate`` (which was checked before) is checked against the model and the settings."""
    path, skipped = select_checkpoint(config.run.out, allow_unverified=config.checkpoint.allow_unverified)
    if dist.get_rank() == 0:
        for bad, problem in skipped:
            print(f"skipping {bad}: {problem}", flush=True)
    if path is None:
        refuse_damaged(config.run.out, skipped)
    if path != candidate:
        agree(lambda: (check_compatible(path, model.state_shapes()), config_changes(config, path)))
    return path


def write_config(config: TrainConfig, resume_from: str | None, step: int) -> None:
    """OUT/config.yaml: this run's settings. A resume that changes them (--allow-config-change) keeps the
    earlier file as config.step-NNNNNN.yaml and says what changed; one that changes nothing keeps it."""
    path = os.path.join(config.run.out, "config.yaml")
    if resume_from is not None and os.path.isfile(path):
        changes = config_changes(config, resume_from)
        if changes:
            print("resuming with changed settings: " + ", ".join(f"{k}: {a} -> {b}" for k, a, b in changes), flush=True)
            kept = os.path.join(config.run.out, f"config.step-{step:06d}.yaml")
            if os.path.exists(kept):  # a resume from this step before (a restart): that copy is the original
                os.remove(path)
            else:
                os.replace(path, kept)
        elif load_config(path).to_dict() == config.to_dict():
            return
    save_config(config, path)
