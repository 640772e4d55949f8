"""The ``kvstrata`` command line: argument types, and one module per command group.
May import every other room; nothing imports it."""

from kvstrata.cli.commands import main

__all__ = ["main"]
