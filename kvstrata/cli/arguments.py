"""The command line's argument types: each refuses a bad value with a one-line message
naming what was expected (argparse turns it into exit 2, no traceback).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["int_at_least", "positive_int", "count", "finite", "block_bytes", "MAX_DISTINCT_HELP", "MAX_SCALE"]


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
        return value
    return parse


positive_int = int_at_least(1, "positive")
count = int_at_least(0, "non-negative")


MAX_DISTINCT_HELP = ("stop with an error once a trace has more distinct blocks than this, before the analysis "
                      "runs out of memory; 0: no limit (default: what the memory available now holds)")


MAX_SCALE = 10_000.0  # about 10^7 requests of the built-in workloads: hours to generate already


def finite(minimum: float, inclusive: bool, maximum: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number above ``minimum`` (or equal, if ``inclusive``), at most ``maximum``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value >= minimum if inclusive else value > minimum
        if not math.isfinite(value) or not low_ok or value > maximum:
            bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
            bound += f" and <= {maximum:g}" if math.isfinite(maximum) else ""
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
        return value
    return parse


def block_bytes(text: str) -> int:
    """An argparse type: a size of at least one byte, such as ``16KiB``."""
    from kvstrata.config.schema import parse_size
    from kvstrata.errors import ConfigError

    try:
        value = parse_size(text, "size")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size: ")) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 byte, got {text!r}")
    return value
