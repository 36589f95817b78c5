"""Helpers shared by the CLI commands: sizes like 512K, and turning ConfigError into exit code 2."""

from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_MULT = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text: str) -> int:
    """'512K' -> 524288, '1M' -> 1048576, '4096' -> 4096 (binary multiples, as context lengths are)."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 128K, 1M)")
    value = float(m.group(1)) * _MULT[m.group(2).lower()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)
