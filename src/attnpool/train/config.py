"""Training configuration in sections, read from one YAML file, every key overridable on the command line.

A run's settings are ten sections, each a frozen dataclass that checks its own values::

    model       model, model_impl, model_args, precision, compile, float8, float8_recipe, float8_all_gather,
                loss_kernel
    data        data, data_path, data_args, tokenizer, tokens_per_rank, max_doc_len, seed
    attention   attention, layout, cost_model, min_shard, eps, memory_cap, attention_backend, pingpong,
                head_chunks, exchange_gibps
    sparse      sparse, sparse_coverage, sparse_min_doc_len, dense_layers, sparse_args
    optim       steps, lr, min_lr_ratio, warmup_steps, weight_decay, beta1, beta2, grad_clip
    parallel    tp, pp, pp_schedule, microbatches, ranks_per_node, hierarchical_exchange, inter_node_gibps
    memory      activation_checkpointing, activation_offload, optimizer_offload, memory_check, auto_headroom
    checkpoint  checkpoint_every, keep_checkpoints, resume, stop_at, allow_unverified, allow_config_change,
                hf_export, hf_export_checkpoints
    faults      max_nonfinite_steps, max_restarts, collective_timeout_s
    run         out, overwrite, nproc, device, progress, logger, deterministic

Every setting has one key (the names above: ``--model-args``, ``model_args:``), unique across sections. In
code a section names its settings shortly: ``config.attention.strategy`` is the key ``attention``,
``config.model.args`` is ``model_args`` (``Section.keys()`` maps them; attnpool.train.sections
defines the sections). A YAML file holds either the flat keys
(as ``configs/demo-cpu.yaml``) or sections of short names::

    model: {name: llama3-8b, args: {n_layers: 4}}
    attention: {strategy: cad, backend: fa4}
    parallel: {tp: 2}

(``model: tiny``, a string, is the key; ``model:`` with a mapping is the section.) ``attnpool train --config
FILE --steps 50 --attention cad`` reads the file, then applies the flags; an unknown key is an error. Checks
that span sections are :meth:`TrainConfig.check_across_sections`; those that need the model's shape (heads
that tp must divide, layers for pipeline stages) come when the run is resolved (attnpool.train.spec). All of
it happens before any process starts, so a bad value is refused on every rank alike. No torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, fields

import yaml

from attnpool.errors import ConfigError
from attnpool.model.families import family_cannot
from attnpool.model.float8_options import float8_problem
from attnpool.model.spec import HF_PREFIX
from attnpool.train.sections import (SECTIONS, AttentionSection, CheckpointSection, DataSection, FaultsSection,
                                     MemorySection, ModelSection, OptimSection, ParallelSection, RunSection, Section,
                                     SparseSection)

# Keys read under another name: (old key -> key, what an unset old value means). ``kernel`` is the
# earlier name of attention_backend; run directories' config.yaml files still hold it.
ALIASES = {"kernel": ("attention_backend", "auto")}

# key -> (section, field name), in the order of the sections (the order of `attnpool train --help` and config.yaml)
KEYS = {key: (section, name) for section, cls in SECTIONS.items() for key, name in cls.keys().items()}
# Every key's dataclass field (its type and help), as the command line reads them.
FIELDS = {f.metadata["key"]: f for cls in SECTIONS.values() for f in fields(cls)}
# What the run computes: a resume that changes one of these asks for allow_config_change. The rest may
# change freely: attention strategy, kernels and memory settings compute the same function, and a
# resume on another parallel layout (nproc, tp, pp) is what DCP's resharding is for (another dp changes the
# global batch from there on, as any resume on more or fewer data-parallel ranks does).
RUN_FIELDS = ("model", "model_impl", "model_args", "data", "data_path", "data_args", "tokenizer", "tokens_per_rank", "max_doc_len",
              "seed", "sparse", "sparse_coverage", "sparse_min_doc_len", "dense_layers", "sparse_args", "steps", "lr",
              "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "precision", "float8",
              "float8_recipe", "microbatches")


@dataclass(frozen=True, init=False)
class TrainConfig:
    """A run's settings, section by section (see the module docstring).

    ``TrainConfig(steps=50, attention="cad")`` takes keys; ``TrainConfig(optim={"steps": 50})`` or
    ``TrainConfig(optim=OptimSection(steps=50))`` takes sections; both may be mixed. Unset settings keep their
    defaults."""

    model: ModelSection
    data: DataSection
    attention: AttentionSection
    sparse: SparseSection
    optim: OptimSection
    parallel: ParallelSection
    memory: MemorySection
    checkpoint: CheckpointSection
    faults: FaultsSection
    run: RunSection

    def __init__(self, **values):
        given = _by_section(values)
        for section, cls in SECTIONS.items():
            value = given[section]
            object.__setattr__(self, section, value if isinstance(value, cls) else cls(**value))
        self.check_across_sections()

    def check_across_sections(self) -> None:
        """What two sections' values make impossible together (each section has checked its own)."""
        refused = {"model_args": ("model_args", bool(self.model.args)), "tp": ("tp", self.parallel.tp != 1),
                   "pp": ("pp", self.parallel.pp != 1), "pingpong": ("pingpong", self.attention.pingpong),
                   "keep_attention": ("activation_checkpointing",
                                      self.memory.activation_checkpointing == "keep_attention"),
                   "compile": ("compile", self.model.compile)}
        cannot = family_cannot(self.model.name, self.model.impl)
        for feature, (key, asked) in refused.items():
            if asked and feature in cannot:
                raise ConfigError(key, self.value(key), f"not available where transformers' modules run an hf: model "
                                                        f"(model_impl: {self.model.impl}): {cannot[feature]}")
        if self.model.compile and self.parallel.tp > 1:
            # Measured on CPU (torch 2.13, gloo): tp=2 with the DTensor projections inside the compiled graphs
            # trains 5e-3 away from one process after three steps (forward equal, gradients not).
            raise ConfigError("compile", True, f"not with tensor parallelism (tp={self.parallel.tp}): the compiled "
                                               "backward of the tensor-parallel projections is not exact; use tp=1")
        if self.model.float8 and self.run.device == "cpu":
            raise ConfigError("float8", True, float8_problem(self.run.device))
        if self.model.float8_all_gather and not (self.model.float8 and self.model.float8_recipe == "tensorwise"):
            raise ConfigError("float8_all_gather", True, "needs float8 with float8_recipe tensorwise (torchao gathers "
                                                         "weights in float8 with one scale per tensor)")
        if self.model.float8_all_gather and self.memory.optimizer_offload:
            raise ConfigError("float8_all_gather", True, "not with optimizer_offload: FSDP2's host-resident shards "
                                                         "with float8 gathers are not checked here")
        if self.model.loss_kernel == "liger" and (self.parallel.tp > 1 or self.run.device == "cpu"):
            raise ConfigError("loss_kernel", "liger", f"not with tp={self.parallel.tp}: the head's weight is split by "
                                                      "vocabulary; use chunked" if self.parallel.tp > 1 else
                                                      "Liger-Kernel runs on CUDA GPUs, and device is cpu")
        if self.checkpoint.hf_exports and not self.model.name.startswith(HF_PREFIX):
            raise ConfigError("hf_export_checkpoints", True, f"exports {HF_PREFIX}DIR models; for attnpool's own, "
                                                             "`attnpool export --checkpoint PATH` writes any checkpoint")
        if self.checkpoint.stop_at is not None and not 1 <= self.checkpoint.stop_at <= self.optim.steps:
            raise ConfigError("stop_at", self.checkpoint.stop_at, f"must be in [1, steps={self.optim.steps}]")
        if self.parallel.pp > 1 and self.attention.strategy == "wlb":
            raise ConfigError("attention", "wlb", "pipeline stages exchange hidden states of one shape, and wlb gives "
                                                  "ranks different numbers of tokens; use local, percp or cad with pp > 1")
        if self.attention.strategy == "ulysses":
            # Ulysses' exchanges are whole-batch all-to-alls around one kernel call: nothing of CAD's task layout
            # (ping-pong's phases, the sparse serving, the pooled pipeline's idle servers) applies to them.
            refused = {"pingpong": self.attention.pingpong, "sparse": self.sparse.mode != "none",
                       "pp_schedule": self.parallel.pp > 1 and self.parallel.pp_schedule == "pooled",
                       "head_chunks": self.attention.head_chunks > 1}
            for key, asked in refused.items():
                if asked:
                    raise ConfigError(key, self.value(key), "not with ulysses attention, which runs every document "
                                                            "on a share of the heads; use cad or percp for it")
        if self.run.deterministic and self.sparse.mode != "none":
            raise ConfigError("sparse", self.sparse.mode, "not with deterministic: sparse attention's backward adds "
                                                          "dK and dV with atomics, in no fixed order")
        if self.attention.strategy == "wlb" and self.attention.pingpong:
            raise ConfigError("pingpong", True, "not with wlb, which packs whole documents on ranks and exchanges only "
                                                "for those it splits; use it with cad, local or percp")
        if self.attention.head_chunks > 1 and self.sparse.mode != "none":
            raise ConfigError("head_chunks", self.attention.head_chunks, "not with sparse attention, whose patterns "
                                                                         "are estimated over every head of a layer")
        if self.parallel.pp > 1 and self.attention.pingpong:
            raise ConfigError("pingpong", True, "ping-pong's nano-batches differ in size, and pipeline stages exchange "
                                                "hidden states of one shape; the pipeline's micro-batches overlap instead")

    @property
    def last_step(self) -> int:
        """The step this run stops after: stop_at, else the schedule's end."""
        return self.checkpoint.stop_at or self.optim.steps

    def value(self, key: str):
        """The value of setting ``key`` (a flat key, e.g. ``tokens_per_rank``)."""
        section, name = KEYS[key]
        return getattr(getattr(self, section), name)

    def replace(self, **values) -> "TrainConfig":
        """A copy with the given keys (or sections' settings) changed, checked again."""
        sections = self.to_sections()
        for section, changed in _as_sections(values).items():
            sections[section].update(changed)
        return TrainConfig(**sections)

    def to_dict(self) -> dict:
        """Every setting by its key, flat (what checkpoints' manifests keep and resumes compare)."""
        return {key: _plain(self.value(key)) for key in KEYS}

    def to_sections(self) -> dict:
        """Every setting by section and short name (what config.yaml holds)."""
        return {section: {name: _plain(getattr(getattr(self, section), name)) for name in cls.keys().values()}
                for section, cls in SECTIONS.items()}

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.to_dict().items() if v != _plain(_default(k))}
        return f"TrainConfig({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


def _plain(value):
    return dict(value) if isinstance(value, dict) else value


def _default(key: str):
    f = FIELDS[key]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _is_section(name: str, value) -> bool:
    """Whether ``name: value`` gives a section (a mapping, or the section itself) rather than a key."""
    cls = SECTIONS.get(name)
    return cls is not None and (isinstance(value, (dict, cls)) or name not in KEYS)


def _by_section(values: dict, where: str = "") -> dict:
    """section -> a section object, or a mapping of field names to values, from keys and sections mixed. An
    unknown key is refused (the first in sorted order), ``where`` saying where it was given ("in FILE")."""
    unknown = sorted(name for name in values if name not in KEYS and name not in SECTIONS)
    if unknown:
        name = unknown[0]
        hint = _did_you_mean(name, [*KEYS, *SECTIONS])
        raise ConfigError(name, values[name], f"unknown key{' ' + where if where else ''}{hint}; known keys: "
                                              f"{', '.join(KEYS)} (or the sections {', '.join(SECTIONS)})")
    given: dict = {section: {} for section in SECTIONS}
    for name, value in values.items():
        if _is_section(name, value):
            if isinstance(value, SECTIONS[name]):
                if given[name]:
                    raise ConfigError(name, type(value).__name__, "given as a section and by its keys; give one")
                given[name] = value
                continue
            if not isinstance(value, dict):
                raise ConfigError(name, value, "a section takes a mapping of its settings")
            fields_of = SECTIONS[name].keys()
            for short, item in value.items():
                if short not in fields_of.values():
                    known = list(fields_of.values())
                    raise ConfigError(f"{name}.{short}", item, f"unknown setting of section {name}"
                                                               f"{_did_you_mean(short, known)}; its settings: "
                                                               f"{', '.join(known)}")
                _put(given, name, short, item, f"{name}.{short}")
        else:
            section, short = KEYS[name]
            _put(given, section, short, value, name)
    return given


def _did_you_mean(name: str, known: list[str]) -> str:
    """``" (did you mean steps?)"`` for the known name closest to a misspelled one, or nothing where none is close."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _put(given: dict, section: str, name: str, value, said: str) -> None:
    if not isinstance(given[section], dict):
        raise ConfigError(said, value, f"section {section} is also given whole; give one")
    if name in given[section] and given[section][name] != value:
        raise ConfigError(said, value, f"given twice ({given[section][name]!r} and {value!r})")
    given[section][name] = value


def _as_sections(values: dict, where: str = "") -> dict:
    """Keys and sections, each as a section mapping of short names."""
    out: dict = {}
    for section, value in _by_section(values, where).items():
        if isinstance(value, Section):
            value = {name: getattr(value, name) for name in type(value).keys().values()}
        if value:
            out[section] = value
    return out


class _RefusingDuplicateKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently: a file with
    ``steps: 5`` and later ``steps: 6`` would train 6 steps with no word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike) -> dict:
    """The mapping in a YAML config file (refused with ConfigError if missing or malformed, or a key given twice)."""
    path = str(path)
    if not os.path.isfile(path):
        raise ConfigError("config", path, "no such file")
    try:
        with open(path) as fh:
            data = yaml.load(fh, Loader=_RefusingDuplicateKeys)
    except yaml.YAMLError as exc:
        lines = str(exc).splitlines()
        said = "; ".join(line.strip() for line in lines[:3] if line.strip() and not line.strip().startswith("^"))
        raise ConfigError("config", path, f"not valid YAML ({said})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", path, f"must hold a mapping of keys to values, not a {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike | None = None, overrides: dict | None = None) -> TrainConfig:
    """The config in ``path`` (defaults if None) with ``overrides`` (keys, as the command line gives them)
    applied on top.

    Dict-valued keys (``model_args``, ``data_args``, ``sparse_args``) are merged key by key, so
    ``--model-args n_layers=2`` keeps the file's other model arguments.
    """
    where = f"in {path}" if path is not None else ""
    values = _as_sections(_renamed_aliases(read_yaml(path) if path is not None else {}, where), where)
    for section, mapping in _as_sections(_renamed_aliases(overrides or {}, "")).items():
        merged = values.setdefault(section, {})
        for name, value in mapping.items():
            old = merged.get(name)
            merged[name] = {**old, **value} if isinstance(value, dict) and isinstance(old, dict) else value
    return TrainConfig(**values)


def _renamed_aliases(mapping: dict, where: str) -> dict:
    """``mapping`` with every alias key (ALIASES) under its current name; refused where both are given."""
    out = dict(mapping)
    for alias, (key, unset) in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        value = unset if value is None or (isinstance(value, str) and value.lower() in ("none", "null")) else value
        if key in out and out[key] != value:
            given = f"given {where}" if where else "given"
            raise ConfigError(alias, value, f"is the old name of {key}, which is also {given} ({key}={out[key]!r}); "
                                            f"give {key} only")
        out[key] = value
    return out


def save_config(config: TrainConfig, path: str | os.PathLike) -> None:
    """``path``: the config in sections (load_config reads it back)."""
    with open(path, "w") as fh:
        yaml.safe_dump(config.to_sections(), fh, sort_keys=False)
