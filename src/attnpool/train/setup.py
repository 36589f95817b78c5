"""A run's setup: everything checked and resolved before its first step, with no process group needed.

``prepare`` resolves the run spec (attnpool.train.spec), builds the document source, finds the checkpoint a
resume continues from, and (on a rank, with ``memory_check``) refuses a configuration whose predicted peak
does not fit the device. A launcher calls it before starting any process, so bad input is refused once; each
rank calls it again on its own device, and the ranks agree on the outcome (attnpool.comm.agree) before any
collective that depends on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from attnpool.data import make_source
from attnpool.errors import ConfigError
from attnpool.model import ModelSpec
from attnpool.model.spec import HF_PREFIX
from attnpool.train.config import TrainConfig
from attnpool.train.sections import DATA_PATH_OPTION
from attnpool.train.memory import MemoryEstimate
from attnpool.train.memory_check import check_memory
from attnpool.train.metrics import logger_problem
from attnpool.train.resume import resume_candidate
from attnpool.train.spec import RunSpec, resolve_run_spec


@dataclass
class Setup:
    spec: RunSpec
    source: object  # a DocumentSource
    resume_from: str | None  # the checkpoint directory a resume continues from
    memory: MemoryEstimate | None = None  # the predicted peak, where a rank's device was checked


def prepare(config: TrainConfig, world: int, device: torch.device | None = None,
            device_type: str | None = None) -> Setup:
    """Check and resolve everything that needs no process group (see the module docstring) for ``world`` ranks.

    ``device``: the rank's, whose kind the kernels must support and whose memory must hold the run; None in a
    launcher, which must not touch its GPUs (asking one initialises CUDA and would hold a context on it for the
    whole run), and in ``attnpool memory``, which resolves for ``device_type``."""
    problem = logger_problem(config.run.logger)
    if problem is not None:
        raise ConfigError("logger", config.run.logger, problem)
    spec = resolve_run_spec(config, world, device, device_type)
    source = build_source(config, spec.model)
    resume_from = resume_candidate(config, spec.model)
    memory = check_memory(spec, source) if device is not None and config.memory.memory_check else None
    return Setup(spec, source, resume_from, memory)


def tokenizer_path(config: TrainConfig, model: ModelSpec) -> str | None:
    """The tokenizer of hf: and jsonl data: ``tokenizer``, else the one that comes with the model."""
    return config.data.tokenizer or model.tokenizer_dir


def _main_process() -> bool:
    """The launcher, or rank 0 (of torchrun's or of the built-in launcher's ranks)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


def build_source(config: TrainConfig, model: ModelSpec):
    """The document source the data settings name, checked against the model's vocabulary. A ConfigError names
    what the user typed: data, data_path, or data_args.KEY."""
    d = config.data
    options, kind = dict(d.args), d.source
    if d.path is not None:
        options[DATA_PATH_OPTION[d.source]] = d.path
    tokenizer = tokenizer_path(config, model)
    vocab_size = model.config.vocab_size
    if d.source.startswith(HF_PREFIX):
        kind, options["name"] = "hf", d.source[len(HF_PREFIX):]
        if tokenizer is None:
            raise ConfigError("tokenizer", None, f"--data {d.source} needs a tokenizer: set tokenizer: DIR (an hf: "
                                                 "model's directory is the default)")
        options["tokenizer"] = tokenizer
        options.setdefault("progress", config.run.progress and _main_process())
        options["model_vocab_size"] = vocab_size  # a tokenizer too large is refused before the data is read
    if d.source == "jsonl" and tokenizer is not None:
        options.setdefault("tokenizer_path", tokenizer)
    if d.source == "synthetic":
        options.setdefault("dist", "pretrain")
        options.setdefault("vocab_size", vocab_size)
        options.setdefault("seed", d.seed)
    if d.source == "npy":
        options.setdefault("vocab_size", vocab_size)  # token ids are then checked against the model
    try:
        source = make_source(kind, **options)
    except ConfigError as exc:  # name what the user typed: --data-path, or --data-args KEY
        path_option = DATA_PATH_OPTION.get(d.source)
        if exc.field == path_option and d.path is not None:
            raise ConfigError("data_path", exc.value, exc.problem) from None
        if exc.field in d.args:
            raise ConfigError(f"data_args.{exc.field}", exc.value, exc.problem) from None
        raise
    if source.vocab_size is not None and source.vocab_size > vocab_size:
        raise ConfigError("data", d.source, f"has {source.vocab_size} token ids but the model's vocab_size is "
                                            f"{vocab_size}; raise it with --model-args vocab_size=N")
    return source
