"""Ranks: one worker's place in an engine's parallel layout, and the ``ssd.path`` its
SSD tier lives under (``rank-<index>``). Engine-neutral: an adapter builds the ranks from
its engine's parallel config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint

__all__ = ["Rank", "ssd_root"]


@dataclass(frozen=True)
class Rank:
    """One worker of an engine: its place in the parallel layout. Each has an SSD tier of
    its own, in ``rank-<index>`` under ``ssd.path`` (a tier directory has one owner)."""

    tp: int
    pp: int
    dp: int
    tp_size: int
    pp_size: int

    @property
    def index(self) -> int:
        """The worker's global rank: data-parallel engine, then pipeline stage, then shard."""
        return (self.dp * self.pp_size + self.pp) * self.tp_size + self.tp

    def ssd_dir(self, root: Path) -> Path:
        return root / f"rank-{self.index}"

    def tier_id(self, fingerprint: Fingerprint) -> str:
        return fingerprint.tier_id(self.tp, self.pp)




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
