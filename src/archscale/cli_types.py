"""argparse `type=` functions, so every number a command line reads is checked where it is parsed (no `int(...)`
on a raw string later): a bad value is the parser's one-line error naming the flag."""

from __future__ import annotations

import argparse
import math

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def nonnegative_int(text: str) -> int:
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def seed_int(text: str) -> int:
    """A seed torch.Generator takes (int64)."""
    n = _int(text)
    if not INT64_MIN <= n <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits (-2**63 .. 2**63-1), got {n}")
    return n


def finite_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number, got {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return x


def nonnegative_float(text: str) -> float:
    x = finite_float(text)
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {x:g}")
    return x


def positive_float(text: str) -> float:
    x = finite_float(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {x:g}")
    return x


def positive_int_list(text: str) -> str:
    """A comma-separated list of positive integers ("1,2,4"), kept as the string the rest of the code reads."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"want comma-separated positive integers, got {text!r}")
    for p in parts:
        if not p.isdigit() or int(p) < 1:
            raise argparse.ArgumentTypeError(f"want comma-separated positive integers, got {text!r}")
    return ",".join(parts)
