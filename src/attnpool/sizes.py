"""Sizes as people write them: token counts ('4096', '128K', '1M': binary multiples, as context lengths are) and
memory ('141GB', '139.8GiB', '80G')."""

from __future__ import annotations

import math
import re

from attnpool.errors import ConfigError

_SIZE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_MULTIPLIER = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text) -> int:
    """'512K' -> 524288, '1M' -> 1048576, '-1' -> -1. Raises ValueError for anything else
    (callers turn it into their own error: a CLI usage error, a ConfigError)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 4096, 128K, 1M)")
    value = float(m.group(1)) * _MULTIPLIER[m.group(2).lower()]
    if not math.isfinite(value):  # a number of hundreds of digits
        raise ValueError(f"{text!r} is too large a size")
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)


def with_token_counts(values: dict, keys, field_prefix: str = "") -> dict:
    """``values`` with each of ``keys`` given as a size ('4K', '128K') turned into its token count, as a context
    length or a window is written; other values as they are (their own checks follow)."""
    out = dict(values)
    for key in keys:
        if isinstance(out.get(key), str):
            try:
                out[key] = parse_size(out[key])
            except ValueError:
                raise ConfigError(f"{field_prefix}{key}", out[key], "is not a token count (e.g. 4096, 4K, 128K)") \
                    from None
    return out


def format_tokens(tokens: int) -> str:
    """131072 -> '128K', 1572864 -> '1.5M', 1000 -> '1000'."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if tokens >= size and tokens % (size // 4) == 0:
            value = tokens / size
            return f"{value:g}{unit}"
    return str(tokens)


def parse_memory_size(field_name: str, text) -> int:
    """'141GB' (decimal), '139.8GiB' or '139.8G' (binary), '80000MiB', or plain bytes (at least a MiB of them: a
    number without its unit, '80', is refused rather than read as 80 bytes)."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
             "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
    s = str(text).strip().lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(number):].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise ConfigError(field_name, text, "is not a memory size (e.g. 141GB, 139.8GiB, 80G, 81559MiB)") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(field_name, text, "must be a positive size")
    if unit in ("", "b") and value < 1 << 20:  # "80" meant 80 GiB, not 80 bytes: no device or host is that small
        raise ConfigError(field_name, text, f"is {int(value)} bytes; give a unit, e.g. {number}GiB or {number}GB")
    return int(value)


def format_bytes(n: float) -> str:
    """2**31 -> '2.0 GiB', 3 * 2**20 -> '3 MiB'."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"
