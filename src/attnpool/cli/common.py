"""Helpers shared by the CLI commands."""

from __future__ import annotations

import argparse

from attnpool import sizes


def parse_size(text: str) -> int:
    """argparse type for sizes like 512K (see attnpool.sizes); a bad one is a usage error (exit 2)."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
