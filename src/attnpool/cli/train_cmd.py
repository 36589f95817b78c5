"""``attnpool train``: train a model with planned core attention; config from YAML, every key a flag.

    attnpool train --config configs/demo-cpu.yaml --steps 50 --attention local --out runs/local
    torchrun --nproc-per-node 8 -m attnpool.cli.main train --config run.yaml
"""

from __future__ import annotations

import argparse
import dataclasses

import yaml

from attnpool.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model with FSDP2 and planned core attention",
                       description="Train a Llama-family model on packed documents. Settings come from --config "
                                   "(YAML), then from the flags below, which override the file's keys.")
    add_config_arguments(p)
    p.set_defaults(func=run)


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--config and one flag per TrainConfig key, grouped by the config's sections (what ``attnpool train``
    takes; ``attnpool memory`` too)."""
    from attnpool.train.config import ALIASES
    from attnpool.train.sections import SECTIONS, field_kind

    p.add_argument("--config", metavar="FILE.yaml", help="run config: a YAML mapping of the keys below, flat or in "
                                                         "sections (section: {setting: value})")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(cls.TITLE if cls.TITLE == section else f"{cls.TITLE} (section {section})")
        for f in dataclasses.fields(cls):
            _add_key(group, f, ALIASES, field_kind(f))


def _add_key(group, f, aliases: dict, kind: str) -> None:
    name = f.metadata["key"]
    flags = ["--" + key.replace("_", "-") for key in (name, *(a for a, (k, _) in aliases.items() if k == name))]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    help_text = f.metadata.get("help", "")
    if "(default:" not in help_text:  # some fields say what their None default means
        help_text += f" (default: {default})"
    if kind == "bool":
        # --x, --x false (as YAML writes it) and --no-x
        group.add_argument(*flags, dest=name, nargs="?", const=True, type=parse_bool, metavar="BOOL", default=None,
                           help=help_text + f"; {flags[0]} alone: true, --no-{flags[0][2:]}: false")
        group.add_argument(*("--no-" + flag[2:] for flag in flags), dest=name, action="store_false", default=None,
                           help=argparse.SUPPRESS)
    elif kind == "dict":
        # (given twice, --model-args a=1 --model-args b=2: both, as one --model-args a=1 b=2; a key given again
        # takes its later value, as any flag given twice does)
        group.add_argument(*flags, dest=name, nargs="+", action="extend", metavar="KEY=VALUE", default=None,
                           help=help_text)
    else:
        # Kept as text: the config reads numbers (3e-4, 4K) and 'none' itself.
        group.add_argument(*flags, dest=name, metavar=f.metadata.get("metavar", kind.upper()), default=None,
                           help=help_text)


def parse_bool(text: str) -> bool:
    """A boolean flag's value as a YAML config writes it: true/false, yes/no, on/off, 1/0."""
    value = BOOLEAN_VALUES.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"takes true or false (or nothing), not {text!r}")
    return value


BOOLEAN_VALUES = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _key_values(field: str, items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(field, item, "expected KEY=VALUE")
        try:
            out[key] = yaml.safe_load(text)
        except yaml.YAMLError:
            out[key] = text
    return out


def config_from_args(args: argparse.Namespace):
    """The TrainConfig of --config with the flags applied on top."""
    from attnpool.train.config import FIELDS, load_config
    from attnpool.train.sections import field_kind

    overrides = {}
    for name, f in FIELDS.items():
        value = getattr(args, name)
        if value is None:
            continue
        overrides[name] = _key_values(name, value) if field_kind(f) == "dict" else value
    return load_config(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    from attnpool.train.launch import run as run_training

    # Under torchrun every rank holds the same (agreed) error and says it: torchrun stops the other
    # ranks as soon as one exits, so a rank that stayed silent could cut rank 0 off before it spoke.
    return run_training(config_from_args(args))
