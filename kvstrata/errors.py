"""Exception types. The type says whose fault it is."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping


class ConfigError(ValueError):
    """A configuration value or argument supplied by the user is invalid.

    The message always starts with the field path or argument name.
    """


class OutOfBlocksError(RuntimeError):
    """The block pool has too few free blocks for a request; nothing was changed."""


@contextmanager
def config_keys(names: Mapping[str, str]) -> Iterator[None]:
    """Name config keys in the errors of a call whose arguments come from a config: a
    :class:`ConfigError` that starts with an argument name in ``names`` is raised again
    starting with the key that argument came from (``path: ...`` -> ``ssd.path: ...``)."""
    try:
        yield
    except ConfigError as exc:
        name, sep, rest = str(exc).partition(": ")
        if not sep or name not in names:
            raise
        raise ConfigError(f"{names[name]}: {rest}") from None
