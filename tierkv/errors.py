"""Exception types. The type says whose fault it is."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or argument supplied by the user is invalid.

    The message always starts with the field path or argument name.
    """


class OutOfBlocksError(RuntimeError):
    """The block pool has too few free blocks for a request; nothing was changed."""
