"""The document source a run's data settings name (attnpool.data), and the tokenizer its text is read with."""

from __future__ import annotations

import os

from attnpool.data import make_source
from attnpool.data.registry import source_options
from attnpool.errors import ConfigError
from attnpool.model import ModelSpec
from attnpool.model.spec import HF_PREFIX
from attnpool.train.config import TrainConfig
from attnpool.train.sections import DATA_PATH_OPTION


def tokenizer_path(config: TrainConfig, model: ModelSpec) -> str | None:
    """The tokenizer of hf: and jsonl data: ``tokenizer``, else the one that comes with the model."""
    return config.data.tokenizer or model.tokenizer_dir


def _main_process() -> bool:
    """The launcher, or rank 0 (of torchrun's or of the built-in launcher's ranks)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


# Sources whose token ids are a text's bytes: a model that comes with a tokenizer (hf:) reads ids of its own.
BYTE_SOURCES = ("text", "stdlib")


def build_source(config: TrainConfig, model: ModelSpec):
    """The document source the data settings name, checked against the model's vocabulary. A ConfigError names
    what the user typed: data, data_path, or data_args.KEY."""
    d = config.data
    options, kind = dict(d.args), d.source
    if d.path is not None:
        options[DATA_PATH_OPTION[d.source]] = d.path
    tokenizer = tokenizer_path(config, model)
    vocab_size = model.config.vocab_size
    if d.source in BYTE_SOURCES and model.tokenizer_dir is not None:
        raise ConfigError("data", d.source, f"is text as bytes (ids 0-255), not the tokens {model.name} was trained "
                                            "on: give it as jsonl or hf: data, which its tokenizer reads, or "
                                            "synthetic for lengths alone")
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
    except ConfigError as exc:  # name what the user typed: --data-path, --tokenizer, or --data-args KEY
        if exc.field == DATA_PATH_OPTION.get(d.source):
            raise ConfigError("data_path", exc.value, exc.problem) from None
        if exc.field == "tokenizer_path":
            problem = exc.problem if exc.value is not None else \
                f"{d.source} data needs a tokenizer: --tokenizer DIR (an hf: model's directory is the default)"
            raise ConfigError("tokenizer", exc.value, problem) from None
        if exc.field in d.args or exc.field in source_options(kind):
            raise ConfigError(f"data_args.{exc.field}", exc.value, exc.problem) from None
        raise
    if source.vocab_size is not None and source.vocab_size > vocab_size:
        raise ConfigError("data", d.source, f"has {source.vocab_size} token ids but the model's vocab_size is "
                                            f"{vocab_size}; raise it with --model-args vocab_size=N")
    return source


def check_documents_fit(config: TrainConfig, source, dp: int) -> None:
    """Refuse a batch (``dp`` x ``tokens_per_rank``, one micro-batch) or a ``max_doc_len`` shorter than every
    document of a source whose documents must stay whole: the stream would cut each one, its question apart from
    its key, and the run would train on nothing it could answer."""
    whole = source.whole_documents()
    if whole is None:
        return
    option, value, shortest = whole
    d, batch = config.data, dp * config.data.tokens_per_rank
    if shortest == value:
        tasks, are = f"{d.source}'s tasks ({value} tokens)", "are"
    else:
        tasks, are = f"{d.source}'s shortest task ({shortest} tokens, data_args.{option}={value})", "is"
    if d.max_doc_len is not None and d.max_doc_len < shortest:
        raise ConfigError("max_doc_len", d.max_doc_len, f"shorter than {tasks}: every task would be cut from its "
                                                        "key; raise it or leave it unset")
    if batch < shortest:
        raise ConfigError(f"data_args.{option}", value, f"{tasks} {are} longer than a micro-batch's {batch} tokens (dp "
                                                        f"{dp} x tokens_per_rank {d.tokens_per_rank}): every task "
                                                        "would be cut from its key")
