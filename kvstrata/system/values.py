"""Reading and showing config values: sizes, counts, choices, and short forms of bad input.

Every check raises :class:`~kvstrata.errors.ConfigError` whose message starts with the
dotted path of the value (``cpu.capacity: expected a size like '8GiB', got 'lots'``).
Shared by the config's sections and the YAML reader.
"""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from typing import Any, Iterable, Mapping

from kvstrata.errors import ConfigError

__all__ = ["ALWAYS", "SECOND_HIT", "TIER_ADMISSIONS", "tier_admission", "LRU", "S3FIFO", "ARC", "COST", "EVICTIONS",
           "EVICTION_ORDERS", "COST_ALPHA", "check_eviction", "eviction_alpha", "eviction_name",
           "eviction", "MAX_GHOST_KEYS", "parse_size", "plural", "format_size", "format_number",
           "short_repr", "short_key", "clip",
           "integer", "one_of", "duration_s", "check_keys", "path_or_none"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)")
_MAX_SIZE = 2**60  # 1 EiB
_SIZE_RANGE = "expected a finite size between 0 and 1 EiB"
_MAX_INT = 2**31 - 1
_MAX_SHOWN = 80


def parse_size(value: Any, what: str = "size") -> int:
    """Parse ``512MiB``, ``64GiB``, ``1.5GB`` or a plain non-negative integer into bytes
    (at most 1 EiB; a fraction of a byte is dropped)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{what}: {_SIZE_RANGE}, got {short_repr(value)}")
    if isinstance(value, str):
        nbytes = _size_string(value, what)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value):
        nbytes = int(value)
    else:
        raise ConfigError(f"{what}: expected a size like '8GiB', got {short_repr(value)}")
    if nbytes < 0:
        raise ConfigError(f"{what}: expected a non-negative size, got {short_repr(value)}")
    if nbytes > _MAX_SIZE:
        raise ConfigError(f"{what}: {_SIZE_RANGE}, got {short_repr(value)}")
    return nbytes


def _size_string(text: str, what: str) -> int:
    """The bytes in a size string such as ``1.5GiB``, exactly (no float rounding)."""
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None or m.group(3).lower() not in _UNITS:
        raise ConfigError(f"{what}: expected a size like '8GiB', got {short_repr(text)}")
    whole, frac = m.group(1).lstrip("0"), (m.group(2) or "")[:64]
    if len(whole) > 30:
        raise ConfigError(f"{what}: {_SIZE_RANGE}, got {short_repr(text)}")
    return int(whole + frac or "0") * _UNITS[m.group(3).lower()] // 10 ** len(frac)


def plural(n: int, noun: str) -> str:
    """``1 bad line``, ``2 bad lines``, ``1,024 bad lines``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def format_size(nbytes: float) -> str:
    """Human-readable binary size (``1.5 GiB``); at most a few characters for any number
    (``1.23e+15 TiB``, ``inf TiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{format_number(nbytes, '.1f')} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


_MAX_PLAIN = 1e15  # from here on a number is shown in scientific notation: a column stays narrow


def format_number(x: float, spec: str = ",.0f") -> str:
    """``x`` formatted by ``spec`` (``3,540``), or with three significant digits in scientific
    notation (``1.23e+300``, ``inf``) from 10^15 on and below 10^-3: at most 21 characters for
    any float."""
    if not math.isfinite(x) or abs(x) >= _MAX_PLAIN or 0 < abs(x) < 1e-3:
        return f"{x:.3g}"
    return format(x, spec)


def format_seconds(x: float | None) -> str:
    """``0.25``, ``42.1``, ``3,540`` (three significant digits below 100); ``-`` for none."""
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 100 else format_number(x)


class _ShortRepr(reprlib.Repr):
    """``repr`` that stops early: a few items of a few levels, long strings and numbers
    cut in the middle, so its cost and length do not grow with the value."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 6
        self.maxset = self.maxfrozenset = self.maxdeque = 6
        self.maxstring = self.maxother = _MAX_SHOWN
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:  # more digits than Python converts to text
            return f"<{'negative ' if x < 0 else ''}integer of {x.bit_length():,} bits>"


_SHORT_REPR = _ShortRepr()


def short_repr(value: Any) -> str:
    """``repr(value)`` for an error message: at most about 80 characters, ``...`` where cut,
    cheap for any value (an alias bomb, a huge string or integer, a recursive list)."""
    return clip(_SHORT_REPR.repr(value))


def short_key(key: Any) -> str:
    """A mapping key as it reads in a dotted path, shortened like :func:`short_repr`."""
    return clip(key if isinstance(key, str) else short_repr(key))


def clip(text: str) -> str:
    """``text`` cut to at most 80 characters, ending in ``...`` where cut."""
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


# --------------------------------------------------------------------------- fields

def integer(v: Any, path: str, *, minimum: int | None = None, maximum: int = _MAX_INT,
         optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, float) and v.is_integer() and abs(v) <= 2**53:
        v = int(v)  # a whole number in e-notation (1e4), where a float holds it exactly
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{path}: expected an integer, got {short_repr(v)}")
    if minimum is not None and v < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {short_repr(v)}")
    if v > maximum:
        raise ConfigError(f"{path}: must be <= {maximum}, got {short_repr(v)}")
    return v


def one_of(v: Any, path: str, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if isinstance(v, bool):  # YAML turns yes/no/true/false into bools
        v = "true" if v else "false"
    if not isinstance(v, str) or v not in choices:
        raise ConfigError(f"{path}: expected one of {', '.join(choices)}; got {short_repr(v)}")
    return v


def check_keys(d: Mapping[str, Any], allowed: Iterable[str], prefix: str) -> None:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(d).__name__}")
    allowed = list(allowed)
    for key in d:
        if key not in allowed:
            name = short_key(key)
            path = f"{prefix}.{name}" if prefix else name
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(allowed)}"
            raise ConfigError(f"{path}: unknown key{hint}")


def duration_s(v: Any, path: str, *, minimum: float, maximum: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{path}: expected a number of seconds, got {short_repr(v)}")
    if not minimum <= v <= maximum:
        raise ConfigError(f"{path}: expected seconds in [{minimum:g}, {maximum:g}], got {short_repr(v)}")
    return float(v)


def path_or_none(d: Mapping[str, Any], key: str, p: str) -> str | None:
    v = d.get(key)
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise ConfigError(f"{p}.{key}: expected a path, got {short_repr(v)}")
    return v


ALWAYS, SECOND_HIT = "always", "second_hit"
TIER_ADMISSIONS = (ALWAYS, SECOND_HIT)  # what a lower tier takes of the blocks offered to it


#: the largest ``ghost_keys`` window: 2^26 keys, ~1.5 GB of the scheduler's memory at most
MAX_GHOST_KEYS = 1 << 26


def tier_admission(d: Mapping[str, Any], p: str) -> dict[str, Any]:
    """``admission`` and ``ghost_keys`` of a tier's section ``p``."""
    ghost = d.get("ghost_keys")
    return {"admission": one_of(d.get("admission", ALWAYS), f"{p}.admission", TIER_ADMISSIONS),
            "ghost_keys": None if ghost is None else integer(ghost, f"{p}.ghost_keys", minimum=1,
                                                              maximum=MAX_GHOST_KEYS)}


LRU, S3FIFO, ARC, COST = "lru", "s3fifo", "arc", "cost"
#: The eviction orders a lower tier may run, by name: the one table of their names, which
#: :func:`check_eviction` reads. Each is bound to its class by the policy's registry
#: (:func:`kvstrata.policy.orders.register_order`, which adds the name of an order it
#: registers); the orders kvstrata ships are declared here, unbound (None) until the policy
#: is imported, so that a config is checked without importing the policy.
EVICTION_ORDERS: dict[str, Any] = dict.fromkeys((LRU, S3FIFO, ARC, COST))
EVICTIONS = tuple(EVICTION_ORDERS)  # the orders kvstrata ships (kvstrata.policy.eviction, .cost_eviction)
COST_ALPHA = 0.5  # ``cost`` alone: the weight of a block's compute against its recency (kvstrata.policy.cost_eviction)
MAX_COST_ALPHA = 100.0


def eviction(d: Mapping[str, Any], p: str) -> str:
    """``eviction`` of a tier's section ``p`` (:func:`check_eviction`)."""
    return check_eviction(d.get("eviction", LRU), f"{p}.eviction")


def check_eviction(value: Any, where: str) -> str:
    """An eviction order: a name of :data:`EVICTION_ORDERS`, or ``cost:<alpha>``; anything
    else is a :class:`ConfigError` naming ``where`` and the orders registered."""
    if isinstance(value, str) and value.strip().startswith(f"{COST}:") and COST in EVICTION_ORDERS:
        eviction_alpha(value, where)
        return value.strip()
    return one_of(value, where, EVICTION_ORDERS)


def eviction_alpha(value: str, where: str = "eviction") -> float | None:
    """The weight ``alpha`` of a ``cost`` order (``cost``: :data:`COST_ALPHA`; ``cost:0.25``),
    None for the other orders. A malformed weight is a :class:`ConfigError` naming ``where``."""
    name, _, alpha = value.partition(":")
    if name != COST:
        return None
    if not _:
        return COST_ALPHA
    try:
        weight = float(alpha)
    except ValueError:
        weight = -1.0
    if not 0 <= weight <= MAX_COST_ALPHA:  # (NaN fails too)
        raise ConfigError(f"{where}: expected cost or cost:<weight from 0 to {MAX_COST_ALPHA:g}> "
                          f"(cost:0.5), got {short_repr(value)}")
    return weight


def eviction_name(value: str) -> str:
    """The order an ``eviction`` value names (``cost:0.25``: ``cost``)."""
    return value.partition(":")[0]
