"""A run's setup: everything checked and resolved before its first step, with no process group needed.

``prepare`` resolves the run spec (attnpool.train.spec) and ``pp_schedule: auto`` (attnpool.train.schedule_choice),
builds the document source (attnpool.train.data_source), finds the checkpoint a resume continues from
(attnpool.train.resume), and (on a rank) resolves ``activation_checkpointing: auto`` for the rank's device, gives
up auto's pooled schedule where that device's memory cannot hold it, and, with ``memory_check``, refuses a
configuration whose predicted peak does not fit the device. A launcher calls it before starting any process, so
bad input is refused once; each rank calls it again on its own device, and the ranks agree on the outcome
(attnpool.comm.agree) before any collective that depends on it. ``auto`` chooses for the smallest capacity of any
rank (given by the caller, which gathers it before: a collective cannot run in here, where a rank may refuse).
"""

from __future__ import annotations

import os

from dataclasses import dataclass

import torch

from attnpool.errors import ConfigError, check_output_directory
from attnpool.train.config import TrainConfig
from attnpool.train.data_source import build_source, check_documents_fit
from attnpool.train.memory import MemoryEstimate
from attnpool.train.memory_check import check_memory, rank_capacity, ranks_on_this_machine, resolve_auto_checkpointing
from attnpool.train.memory_fit import Capacity
from attnpool.train.metrics import logger_problem
from attnpool.train.resume import refuse_earlier_run, resume_candidate
from attnpool.train.schedule_choice import keep_pooled_if_it_fits, resolve_pp_schedule
from attnpool.train.spec import RunSpec, resolve_run_spec


@dataclass
class Setup:
    spec: RunSpec
    source: object  # a DocumentSource
    resume_from: str | None  # the checkpoint directory a resume continues from
    memory: MemoryEstimate | None = None  # the predicted peak, where a rank's device was checked


# ``out`` of a run resolved only to be planned (attnpool memory): no run directory is checked or read
NO_RUN_DIRECTORY = os.devnull


def prepare(config: TrainConfig, world: int, device: torch.device | None = None,
            device_type: str | None = None, auto_capacity: Capacity | None = None) -> Setup:
    """Check and resolve everything that needs no process group (see the module docstring) for ``world`` ranks.

    ``device``: the rank's, whose kind the kernels must support and whose memory must hold the run; None in a
    launcher, which must not touch its GPUs (asking one initialises CUDA and would hold a context on it for the
    whole run), and in ``attnpool memory``, which resolves for ``device_type``. ``auto_capacity``: what
    ``activation_checkpointing: auto`` chooses for on a rank (the smallest over the ranks, so that all choose alike:
    memory_check.smallest_capacity); default: the rank's own."""
    problem = logger_problem(config.run.logger)
    if problem is not None:
        raise ConfigError("logger", config.run.logger, problem)
    spec = resolve_run_spec(config, world, device, device_type)
    source = build_source(config, spec.model)
    check_documents_fit(config, source, spec.dims.dp)
    resume_from = None
    if config.run.out != NO_RUN_DIRECTORY:
        check_output_directory("out", config.run.out)
        resume_from = resume_candidate(config, spec.model) if config.checkpoint.resume else refuse_earlier_run(config)
    spec = resolve_pp_schedule(spec, source)
    memory = None
    if device is not None:
        capacity, calibration = rank_capacity(device, ranks_on_this_machine(config, world))
        spec = keep_pooled_if_it_fits(spec, source, auto_capacity or capacity, calibration)
        spec, sampled = resolve_auto_checkpointing(spec, source, auto_capacity or capacity, calibration)
        memory = check_memory(spec, source, sampled) if config.memory.memory_check else None
    return Setup(spec, source, resume_from, memory)

