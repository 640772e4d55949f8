"""``kvstrata remote secret``: a new secret for ``remote.secret_file`` (the remote kind registers
:func:`add_commands` as its ``commands``).

Prints one secret of 256 random bits (:func:`~kvstrata.config.credentials.generate_secret`) on
standard output, or, with ``--output FILE``, writes it to a new file only its owner can
read or write (mode 600, created without following a link; an existing file is never
overwritten: a rotation puts the new secret on the first line of the old file by hand,
keeping the old one below it until every replica has restarted).

Threads: the command's own.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["add_commands", "cmd_secret", "write_secret"]


def add_commands(sub: Any) -> None:
    """``kvstrata remote ...`` on the top-level parser's subcommands."""
    remote = sub.add_parser("remote", help="the shared remote tier (Redis / Valkey)")
    remote_sub = remote.add_subparsers(dest="remote_command", required=True)
    secret = remote_sub.add_parser("secret", help="print a new secret for remote.secret_file (256 random bits)")
    secret.add_argument("--output", "-o", metavar="FILE",
                        help="write it to FILE instead (created with mode 600; an existing FILE is refused)")
    secret.set_defaults(func=cmd_secret)


def cmd_secret(args: argparse.Namespace) -> int:
    from kvstrata.config.credentials import generate_secret

    secret = generate_secret()
    if args.output is None:
        sys.stdout.write(secret.decode() + "\n")
        return 0
    write_secret(args.output, secret)
    print(f"kvstrata: wrote a new secret to {args.output} (mode 600): set remote.secret_file to it on every "
          f"replica", file=sys.stderr)
    return 0


def write_secret(path: str, secret: bytes) -> None:
    """``secret`` and a newline in a new file ``path`` (mode 600, no link followed); a
    ConfigError naming ``--output`` when it exists or cannot be created."""
    from kvstrata.errors import ConfigError

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise ConfigError(f"--output: {path} exists; not overwritten (to rotate, put the new secret on its "
                          f"first line and keep the old one below it)") from None
    except OSError as exc:
        raise ConfigError(f"--output: cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret + b"\n")
