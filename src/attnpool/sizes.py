"""Token counts written as sizes: '4096', '128K', '1M' (binary multiples, as context lengths are)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_MULTIPLIER = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text) -> int:
    """'512K' -> 524288, '1M' -> 1048576, '-1' -> -1. Raises ValueError for anything else
    (callers turn it into their own error: a CLI usage error, a ConfigError)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 4096, 128K, 1M)")
    value = float(m.group(1)) * _MULTIPLIER[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)
