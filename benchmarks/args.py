"""What the benchmarks' options parse: argparse types that say why a value is refused, block
sizes with K/M/G suffixes, and the folder reports go to by default.
"""

from __future__ import annotations

import argparse
import os

# Where `python -m kvcache.benchmarks.NAME` writes its reports: beside this file, wherever it is
# run from (`kvcache bench NAME` writes to benchmarks/results under the current directory).
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'64K' -> 65536; K, M, G suffixes are binary; a trailing 'B' or 'iB' is allowed."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    try:
        n = int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 64K, 1M, 4M)") from None
    if n <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return n


def parse_sizes(text: str) -> list[int]:
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes:
        raise ValueError(f"no block sizes in {text!r} (use e.g. 64K,1M)")
    return sizes


def size_label(n: int) -> str:
    unit = next((u for u in ("G", "M", "K") if n % _UNITS[u] == 0), "")
    return f"{n // _UNITS[unit]}{unit}"


def checked(parse, ok=lambda v: v > 0, what="a positive number"):
    """An argparse type: parse, then check, with the reason in argparse's error message."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e) if parse is parse_sizes else f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    convert.__name__ = parse.__name__
    return convert


def names(text: str) -> list[str]:
    """An argparse type: a comma-separated list of at least one name."""
    found = [c.strip() for c in text.split(",") if c.strip()]
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing: give one or more, comma-separated")
    return found


def counts(text: str) -> list[int]:
    """An argparse type: a comma-separated list of at least one positive integer."""
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive integers (e.g. 1,8,32)")
    return values
