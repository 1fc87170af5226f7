"""Argument types the bench commands share."""

from __future__ import annotations

import argparse


def positive_ints(text: str) -> tuple[int, ...]:
    """`1,4,16` -> (1, 4, 16): stream counts, batch sizes; an argparse type."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse
