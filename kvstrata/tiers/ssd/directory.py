"""The SSD tier's directory: whose it is is decided before anything in it is touched.

:func:`prepare_directory` runs before the tier takes the directory's lock. It
first only looks (``lstat``, ``listdir``, and at most a read-only child
process): the directory and every file kvstrata keeps there must belong to this
user, and no such file may be a symbolic link or have a second name (a hard
link); a directory without ``data.mdb`` may hold only kvstrata's own files; one
with ``data.mdb`` must hold a kvstrata environment (:func:`check_environment`).
Anything else is refused with a ``ConfigError`` naming the path, and nothing
there has changed. Only then is the directory created if missing and made
owner-only (0700, files 0600; logged when it was looser).

Whose ``data.mdb`` is, only its meta record tells (:func:`identify`, read-only):
a file name beside it (``kvstrata.lock``, ``blocks.dat``) proves nothing, since any
program can leave one. :func:`check_environment` is the one rule every path
applies before it writes to a directory (the tier opening it, ``kvstrata ssd
purge`` in every mode, ``verify --drop``) or reads it beside its owner
(``read_keys``); what counts as proof depends only on what the caller is about
to do (:data:`OPEN`, :data:`CHANGE`, :data:`PURGE`).

Threads: functions of the thread that opens the tier; nothing shared.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
from pathlib import Path
from typing import Callable, NamedTuple

from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import PREVIOUS_NAME, RECORD_VERSION
from kvstrata.tiers.ssd.owner import LOCK_FILE, reader_slot
from kvstrata.tiers.ssd.pagefile import BLOCKS
from kvstrata.tiers.ssd.private import check_private
from kvstrata.tiers.ssd.snapshot import CLEAN
from kvstrata.tiers.ssd.walk import BARE, NOT_KVSTRATA, PREVIOUS, REBUILT, child_command

__all__ = ["prepare_directory", "check_environment", "identify", "Environment", "owner_only", "previous_tier",
           "DIR_MODE", "FILE_MODE", "LMDB_LOCK", "OWN_FILES", "PREVIOUS_FILES", "OPEN", "CHANGE", "PURGE"]

log = logging.getLogger("kvstrata.tiers.ssd")

DIR_MODE = 0o700         # KV bytes derive from users' prompts: owner-only at rest
FILE_MODE = 0o600
LMDB_LOCK = "lock.mdb"
OWN_FILES = frozenset({"data.mdb", LMDB_LOCK, CLEAN, BLOCKS, LOCK_FILE, REBUILT})
#: The lock and clean-close files of a tier written under the project's previous name.
PREVIOUS_FILES = frozenset({f"{PREVIOUS_NAME}.lock", f"{PREVIOUS_NAME}.clean"})
_IDENTIFY_TIMEOUT = 120.0

OPEN = "open"      # open the tier (or read it): an unreadable environment beside our lock is recovery's
CHANGE = "change"  # delete records through the tier: its format record, nothing less
PURGE = "purge"    # delete the tier's files: its format record, or the previous name's


class Environment(NamedTuple):
    """What ``data.mdb`` is (:func:`identify`): ``kind`` is ``kvstrata`` (``detail``: its
    record format), ``previous`` (the previous name's; its record format), ``bare`` (no
    record at all; ``bare``: kvstrata's databases, empty, ``blank``: none), ``foreign``
    or ``unreadable`` (``detail``: why)."""

    kind: str
    detail: str = ""


def prepare_directory(path: Path, what: str = "path") -> None:
    """Refuse a directory that is not a tier's, untouched; create ``path`` if missing;
    make it and the files kvstrata keeps there owner-only. Errors name ``what``."""
    if path.exists():
        _check_owner(path, what)
        names = set(os.listdir(path))
        for name in sorted(names & OWN_FILES):
            _check_file(path / name, what)
        if "data.mdb" in names:
            check_environment(path, what, names)
        if names & PREVIOUS_FILES:
            raise ConfigError(previous_tier(path, what, None))
        if "data.mdb" not in names and names - OWN_FILES:
            raise ConfigError(f"{what}: {path} is a non-empty directory without an LMDB "
                              "environment; refusing to write into it")
    path.mkdir(mode=DIR_MODE, exist_ok=True)
    owner_only(path, DIR_MODE, what)
    for name in sorted(OWN_FILES):
        if os.path.lexists(path / name):
            owner_only(path / name, FILE_MODE, what)


def check_environment(path: Path, what: str = "path", names: set[str] | None = None,
                      purpose: str = OPEN) -> Environment:
    """``path/data.mdb`` is a kvstrata environment for ``purpose``, as its meta record says
    (:func:`identify`); a ConfigError naming ``what`` and the path otherwise, with nothing
    there changed. One holding no record counts when its databases are kvstrata's or the
    tier's lock file lies beside it (nothing is stored to lose). One that cannot be read
    counts only to open it beside the tier's lock file (recovery then verifies it and
    refuses another program's): never to delete anything. :data:`PURGE` accepts a tier of
    the previous name too (``purge --all`` is its way out)."""
    names = set(os.listdir(path)) if names is None else names
    env = identify(path, what)
    ours = LOCK_FILE in names
    if env.kind == "kvstrata" or (env.kind == "bare" and (env.detail == "bare" or ours)) \
            or (env.kind == "unreadable" and ours and purpose == OPEN) \
            or (env.kind == "previous" and purpose == PURGE):
        return env
    if env.kind == "previous":
        raise ConfigError(previous_tier(path, what, env.detail or None))
    unchanged = "" if purpose == OPEN else "; nothing deleted"
    if env.kind == "unreadable":
        raise ConfigError(f"{what}: {path}/data.mdb cannot be read ({env.detail}) and nothing there says it "
                          f"is a kvstrata tier; refusing to use it{unchanged}")
    raise ConfigError(f"{what}: {path} holds an LMDB environment that kvstrata did not create; refusing to "
                      f"use it{unchanged}")


def identify(path: Path, what: str = "path") -> Environment:
    """What ``path/data.mdb`` is, from its meta record alone, read in a child process (a
    damaged environment can fault the process that maps it) that opens it read-only:
    beside the tier's running owner as one more reader (a slot in the owner's
    ``lock.mdb``), else with no lock at all, so that not a byte changes, ``lock.mdb``
    included. A ConfigError naming ``what`` when it takes too long."""
    cmd = child_command("from kvstrata.tiers.ssd.walk import _identify; _identify()", str(path),
                        "1" if reader_slot(path) else "0")
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=_IDENTIFY_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{what}: reading the LMDB environment in {path} took over "
                          f"{_IDENTIFY_TIMEOUT:g} s; refusing to use it") from None
    said = proc.stdout.decode(errors="replace").strip()
    kinds = {0: "kvstrata", PREVIOUS: "previous", BARE: "bare", NOT_KVSTRATA: "foreign"}
    if proc.returncode in kinds:
        return Environment(kinds[proc.returncode], said)
    why = proc.stderr.decode(errors="replace").strip().splitlines()
    return Environment("unreadable", f"signal {-proc.returncode}" if proc.returncode < 0 else
                       why[-1] if why else f"exit {proc.returncode}")


def previous_tier(path: Path, what: str, record_format: object) -> str:
    """The one line that refuses a tier written under the project's previous name: who
    wrote it, and the way out. Nothing there is changed or reused."""
    fmt = f"record format {record_format}" if record_format not in (None, "None") else "an unreadable format"
    return (f"{what}: {path} is an SSD tier written by {PREVIOUS_NAME} (kvstrata's previous name; {fmt}), "
            f"which kvstrata (record format {RECORD_VERSION}) does not reuse: delete it with "
            f"`kvstrata ssd purge --all {path}`, or give another path")


def owner_only(path: Path, mode: int, what: str = "path") -> None:
    """``path`` (not a symbolic link, unless a directory) belongs to this user; set ``mode``
    when it grants more, and say so (an older tier, a loose umask). A ConfigError
    otherwise."""
    st = _check_owner(path, what) if path.is_dir() else _check_file(path, what)
    was = st.st_mode & 0o777
    if was & ~mode:
        try:
            os.chmod(path, mode)
        except OSError as exc:
            raise ConfigError(f"{what}: cannot make {path} owner-only: {exc.strerror}") from None
        log.warning("SSD tier: %s was readable by others (mode %o); now %o", path, was, mode)


def _check_owner(path: Path, what: str) -> os.stat_result:
    """A directory of this user (another user who could plant files in it would read the
    KV, forge records, or have an open truncate a file of their choosing)."""
    st = _stat(path, os.stat, what)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what}: {path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what}: {path} belongs to uid {st.st_uid}, not to this user "
                          f"({os.geteuid()}); refusing to keep KV there")
    return st


def _check_file(path: Path, what: str) -> os.stat_result:
    st = _stat(path, os.lstat, what)
    check_private(st, path, what)  # a regular file of this user with one name
    return st


def _stat(path: Path, how: Callable[[Path], os.stat_result], what: str) -> os.stat_result:
    try:
        return how(path)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot inspect {path}: {exc.strerror}") from None
