"""Changes an operator asks of an SSD tier directory (``kvstrata ssd purge``, ``verify --drop``).

``purge --all`` (:func:`purge_all`) is the exception: it deletes the tier's own files
(those of a tier written under the project's previous name too), under the directory's
lock and that of the previous name, so that no server holds it meanwhile; only once
the environment's meta record proves the directory a tier
(:func:`~kvstrata.tiers.ssd.directory.check_environment`, :data:`PURGE`): another
program's ``data.mdb`` is refused, nothing created or deleted, whatever file names lie
beside it.

Each goes through the tier itself: :class:`~kvstrata.tiers.ssd.tier.SSDTier` is
opened as the directory's one owner (refused, changing nothing, while a server
holds it) for the namespace concerned, with the fingerprint recorded in the
index (so its keys are exactly the ones deleted) and a capacity no smaller than
what the directory holds (so opening evicts nothing); the deletions are the
tier's own (``discard_many``), committed, synced and followed by a clean close,
as a server would leave it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from kvstrata.errors import ConfigError

__all__ = ["delete_records", "find_namespace", "purge_all"]


def find_namespace(report: dict[str, Any], name: str, flag: str = "--namespace") -> dict[str, Any]:
    """The namespace of an inventory whose prefix starts with ``name`` (8 hex digits at
    least) or whose fingerprint is ``name``; a ``ConfigError`` naming the choices otherwise."""
    spaces = report["namespaces"]
    found = [ns for ns in spaces if ns.get("fingerprint") == name
             or (len(name) >= 8 and ns["prefix"].startswith(name.lower()))]
    if len(found) == 1:
        return found[0]
    known = ", ".join(f"{ns['prefix'][:16]} ({ns.get('fingerprint', '?')})" for ns in spaces) or "none"
    why = "matches several" if found else "matches none"
    raise ConfigError(f"{flag} {name}: {why} of {report['path']}'s namespaces: {known}")


def delete_records(path: Path, namespace: dict[str, Any], keys: Iterable[bytes] | None,
                   used_bytes: int) -> int:
    """Delete ``keys`` (None: every record) of ``namespace`` (an inventory entry) from the
    tier at ``path``; returns how many records it held that are gone now."""
    from kvstrata.tiers.ssd.record import namespace_of
    from kvstrata.tiers.ssd.tier import SSDTier

    fp_hex = namespace.get("fingerprint_hex")
    if fp_hex is None:
        raise ConfigError(f"{path}: namespace {namespace['prefix'][:16]} records no fingerprint; it cannot be "
                          "opened to delete from it")
    fingerprint = bytes.fromhex(fp_hex)
    if namespace_of(fingerprint).hex() != namespace["prefix"]:
        raise ConfigError(f"{path}: namespace {namespace['prefix'][:16]}'s recorded fingerprint does not derive "
                          "it (a damaged index); nothing deleted")
    block = namespace.get("block_nbytes")
    capacity = max(used_bytes + 64 * 1024**2, 2 * (block or 0), 1024**2)
    tier = SSDTier(path, capacity_bytes=capacity, fingerprint=fingerprint, block_nbytes=block,
                   compression=namespace.get("compression") or "auto")
    try:
        held = set(tier.keys())
        gone = held if keys is None else held & set(keys)
        tier.discard_many(sorted(gone))
        if not tier.flush(600):
            raise OSError(f"{path}: the deletions were not committed within 600 s")
    finally:
        tier.close()
    return len(gone)


def purge_all(path: Path) -> list[str]:
    """Delete every block of the tier at ``path``: the files a tier keeps there (of this
    format or the previous name's), nothing else. Refused, deleting nothing, unless its
    environment proves to be a tier's, and while a process holds the directory (this
    name's lock or the previous one's). Returns the names of the files deleted."""
    import fcntl
    import os

    from kvstrata.tiers.ssd.directory import OWN_FILES, PREVIOUS_FILES, PURGE, check_environment
    from kvstrata.tiers.ssd.owner import LOCK_FILE, Owner

    check_environment(path, "purge --all", purpose=PURGE)
    owner = Owner(path)  # this name's lock (created if missing)
    fds: list[int] = []
    try:
        for name in sorted(PREVIOUS_FILES):
            if name.endswith(".lock") and os.path.lexists(path / name):
                fd = os.open(path / name, os.O_RDONLY | os.O_NOFOLLOW)
                fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ConfigError(f"{path}: in use by another process (it holds {name}); stop it "
                                      "first") from None
        gone = [n for n in sorted((OWN_FILES | PREVIOUS_FILES) - {LOCK_FILE}) if os.path.lexists(path / n)]
        for name in gone:
            os.unlink(path / name)
        os.unlink(path / LOCK_FILE)
    finally:
        for fd in fds:
            os.close(fd)
        owner.release()
    return gone
