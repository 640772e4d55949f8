"""The SSD tier as a tier kind: its capacity rule, where a rank's tier lives under ``ssd.path``,
the factory that opens it, and the tiers this process holds open.

LMDB opens an environment once per process: a tier a worker of this process opened is the one
every other reader in the process uses (the scheduler half of an engine that runs its workers in
its own process reads the keys through it, :func:`held_open`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvstrata.config.schema import SSD_TIER_KEYS, KVStrataConfig
from kvstrata.errors import ConfigError, config_keys
from kvstrata.policy.spec import ghost_keys
from kvstrata.policy.tiers import KNOWN, SSD, Tier
from kvstrata.tiers.kinds import Opening, TierKind, register
from kvstrata.tiers.ssd.commands import add_commands
from kvstrata.tiers.ssd.footprint import capacity_blocks
from kvstrata.tiers.ssd.tier import SSDTier

if TYPE_CHECKING:
    from kvstrata.identity.ranks import Rank

__all__ = ["ssd_root", "rank_dir", "open_ssd", "held_open", "ssd_capacity", "declare_ssd"]

log = logging.getLogger(__name__)

_OPEN: dict[str, SSDTier] = {}  # realpath of a tier directory -> the tier this process holds open there


def ssd_capacity(config: KVStrataConfig, block_nbytes: int) -> int | None:
    """Uncompressed blocks the SSD tier of ``config`` holds (None: disabled). Compression then
    saves disk space and bandwidth; it does not change which blocks are kept, so every mode
    agrees on placement."""
    if not config.ssd.enabled:
        return None
    return capacity_blocks(config.ssd.capacity, block_nbytes)


def rank_dir(config: KVStrataConfig, rank: "Rank") -> Path:
    """The directory of ``rank``'s SSD tier: ``rank-<index>`` under ``ssd.path``."""
    return rank.directory(ssd_root(config))


def open_ssd(opening: Opening) -> SSDTier:
    """The SSD tier of one deployment: a rank's own directory under ``ssd.path`` when it is a
    rank of an engine, ``ssd.path`` itself otherwise. ``options``: ``compression`` in place of
    ``ssd.compression`` (a replay's payload run)."""
    cfg = opening.config
    if opening.rank is not None:
        root = ssd_root(cfg)
        if opening.rank.index == 0 and (root / "data.mdb").exists():
            log.warning("kvstrata: %s holds an SSD tier of the layout before per-rank directories; "
                        "it is no longer read (each worker uses %s/rank-<r>): delete its files to "
                        "free the space", root, root)
        path = opening.rank.directory(root)
    else:
        path = cfg.ssd.resolved_path()
        assert path is not None
        if path.parent == Path.home() / ".cache":  # the default location: create ~/.cache
            path.parent.mkdir(parents=True, exist_ok=True)
    options = opening.options
    with config_keys(SSD_TIER_KEYS):
        tier = SSDTier(path, capacity_bytes=cfg.ssd.capacity, fingerprint=opening.tier_id(),
                       compression=options.get("compression", cfg.ssd.compression), level=cfg.ssd.level,
                       queue_capacity_bytes=cfg.ssd.queue_capacity, block_nbytes=opening.block_nbytes)
    _OPEN[str(tier.path)] = tier
    return tier


def held_open(path: Path) -> SSDTier | None:
    """The tier this process holds open in ``path`` (None: none, or closed since)."""
    tier = _OPEN.get(str(path))
    if tier is not None and tier.closed:
        _OPEN.pop(str(path), None)
        return None
    return tier


def ssd_root(cfg: KVStrataConfig) -> Path:
    """``ssd.path``, created owner-only if missing; its parent must exist (an unmounted
    disk must not fill the root file system)."""
    from kvstrata.tiers.ssd.directory import DIR_MODE, FILE_MODE, LMDB_LOCK, check_environment
    from kvstrata.tiers.ssd.pagefile import BLOCKS
    from kvstrata.tiers.ssd.arguments import check_path

    configured = cfg.ssd.resolved_path()
    assert configured is not None
    path = check_path(os.path.realpath(configured), "ssd.path")
    if (path / "data.mdb").exists():  # a tier of the layout before rank-<r>, or not kvstrata's
        check_environment(path, "ssd.path")
    try:
        path.mkdir(mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"ssd.path: cannot create {path}: {exc.strerror}") from None
    _tighten(path, DIR_MODE)
    for name in ("data.mdb", LMDB_LOCK, BLOCKS):  # a tier of the layout before rank-<r>
        if os.path.isfile(path / name) and not os.path.islink(path / name):
            _tighten(path / name, FILE_MODE)
    return path




def _tighten(path: Path, mode: int) -> None:
    """Owner-only, when this user owns ``path`` (each rank's own directory is checked
    strictly by the SSD tier; the directory above it may be shared on purpose)."""
    try:
        st = path.stat()
        if st.st_uid == os.geteuid() and st.st_mode & 0o777 & ~mode:
            os.chmod(path, mode)
    except OSError:
        pass


def declare_ssd(config: KVStrataConfig, capacity: int) -> Tier:
    """The SSD tier's declaration: ``ssd.admission`` (with its ghost window) and ``ssd.eviction``."""
    ssd = config.ssd
    return dataclasses.replace(KNOWN[SSD], capacity=capacity, admission=ssd.admission,
                               ghost_keys=ghost_keys(ssd, capacity), eviction=ssd.eviction)


register(TierKind(KNOWN[SSD], section="ssd", capacity=ssd_capacity, open=open_ssd, backend=SSDTier,
                  position=300, configure=declare_ssd, commands=add_commands))
