"""Value parsers shared by the CLI and the pytest plugin: each raises ArgumentTypeError with a
message that says what was wrong and what to write instead."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(text).strip().lstrip("+") != str(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (e.g. 32)")
    return value


def positive_int_list(text: str) -> list[int]:
    """'16,32' -> [16, 32]."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of positive integers (e.g. 16,32)")
    return [positive_int(item) for item in items]


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def choice_list(choices: tuple[str, ...]):
    """A parser for a comma list whose items must be among ``choices``."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",")]
        bad = [item for item in items if item not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(choices)}")
        return items

    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number (e.g. 1e-3)")
    return value
