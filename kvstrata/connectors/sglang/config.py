"""The backend's configuration: SGLang's ``--hicache-storage-backend-extra-config``.

The extra config holds, beside the keys SGLang reads itself (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``, ``prefetch_*``, ...), kvstrata's own:
an optional YAML file under ``"config"`` and kvstrata's dotted keys (``"ssd.path"``,
``"ssd.capacity"``, ``"remote.url"``, ``"model.id"``, ``"load.*"``...), which override it.
Everything is checked when SGLang constructs the backend: an unknown key, a value of the
wrong type, a key SGLang decides, or no tier at all is one :class:`ConfigError` naming the
key, and SGLang's attach fails cleanly.

What differs from the other drivers: SGLang's host pool is the DRAM tier above kvstrata, so
kvstrata's own CPU tier is off unless ``cpu.capacity`` is set, except with a remote tier,
whose pages land in a small slab first (:data:`LANDING_PAGES` pages unless ``cpu.capacity``
says otherwise); pages are stored as SGLang backs them up (``spill.admission`` is
``on_compute``); and ``ssd.path`` must be set (a directory of the SGLang deployment's own:
vLLM's tiers and SGLang's are never shared).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kvstrata.config.schema import KVStrataConfig, first_under, key_paths, read_yaml
from kvstrata.errors import ConfigError
from kvstrata.system.values import short_repr

__all__ = ["BackendConfig", "load_backend_config", "SGLANG_KEYS", "LANDING_PAGES", "WHERE"]

WHERE = "hicache-storage-backend-extra-config"
CONFIG_FILE_KEY = "config"
#: Keys of the extra config that SGLang itself reads (the dynamic backend's selection, the
#: zero-copy switch, the prefetch knobs SGLang pops before the backend sees the rest).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
               "tp_lcm_size")
#: Pages of the CPU slab a remote tier's pages land in when ``cpu.capacity`` is not set (two
#: of SGLang's storage batches of 128 pages).
LANDING_PAGES = 256
_SGLANG_OWNS = (
    ("block_size", "SGLang's --page-size sets it"),
    ("gpu", "SGLang's host pool is the pool above kvstrata (--hicache-ratio or --hicache-size)"),
    ("model.name", "taken from the model SGLang serves (set model.id to name its identity)"),
    ("model.layers", "taken from SGLang's host pool"),
    ("model.kv_heads", "taken from SGLang's host pool"),
    ("model.head_size", "taken from SGLang's host pool"),
    ("model.kv_dtype", "taken from SGLang's host pool"),
    ("model.block_nbytes", "taken from SGLang's host pool"),
    ("model.groups", "SGLang registers its hybrid pools itself"),
    ("spill.admission", "SGLang offers a page when it backs it up (on_compute)"),
    ("spill.watermark", "SGLang offers a page when it backs it up (on_compute)"),
    ("spill.promotion", "SGLang's host pool holds what is loaded"),
    ("metrics", "the counters are exported through SGLang's get_stats"),
    ("trace", "not recorded under SGLang"),
)


@dataclass(frozen=True)
class BackendConfig:
    """kvstrata's config for the backend, and what SGLang's keys say of it."""

    config: KVStrataConfig
    interface_v1: bool = False
    backend_name: str = "kvstrata"

    def with_landing(self, block_nbytes: int) -> KVStrataConfig:
        """The config with the CPU slab a remote tier needs for pages of ``block_nbytes``
        bytes (:data:`LANDING_PAGES` of them, unless ``cpu.capacity`` was set)."""
        cfg = self.config
        if not cfg.remote.url or "cpu.capacity" in cfg.explicit:
            return cfg
        return dataclasses.replace(cfg, cpu=dataclasses.replace(cfg.cpu, capacity=LANDING_PAGES * block_nbytes))


def load_backend_config(extra: Mapping[str, Any] | None) -> BackendConfig:
    """Check SGLang's extra config and build kvstrata's from it (:class:`ConfigError` naming
    the key, prefixed with ``hicache-storage-backend-extra-config``)."""
    try:
        return _load(dict(extra or {}))
    except ConfigError as exc:
        raise ConfigError(f"{WHERE}: {exc}") from None


def _load(extra: dict[str, Any]) -> BackendConfig:
    bad = [k for k in extra if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"keys must be strings, got {bad[0]!r}")
    sglang = {k: extra.pop(k) for k in SGLANG_KEYS if k in extra}
    for key in ("backend_name", "module_path", "class_name"):
        if key in sglang and not isinstance(sglang[key], str):
            raise ConfigError(f"{key}: expected a string, got {short_repr(sglang[key])}")
    v1 = sglang.get("interface_v1", 0)
    if isinstance(v1, bool) or v1 in (0, 1):
        v1 = bool(v1)
    else:
        raise ConfigError(f"interface_v1: expected 0 or 1, got {short_repr(v1)}")
    path = extra.pop(CONFIG_FILE_KEY, None)
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ConfigError(f"{CONFIG_FILE_KEY}: expected a YAML file's path, got {short_repr(path)}")
    given = key_paths({}, extra) | (key_paths(read_yaml(path)) if path is not None else set())
    if path is not None:
        _reject_sglang_keys(key_paths(read_yaml(path)), f"{path}: ")
    _reject_sglang_keys(key_paths({}, extra), "")
    if first_under(given, "cpu.capacity") is None:
        extra["cpu.capacity"] = 0  # SGLang's host pool is the DRAM tier above kvstrata
    cfg = KVStrataConfig.from_yaml(path, extra) if path is not None else KVStrataConfig.from_dict({}, extra)
    if first_under(given, "cpu.capacity") is None:
        cfg = dataclasses.replace(cfg, explicit=cfg.explicit - {"cpu.capacity"})
    _check_tiers(cfg)
    return BackendConfig(cfg, interface_v1=v1, backend_name=str(sglang.get("backend_name", "kvstrata")))


def _reject_sglang_keys(paths: set[str], where: str) -> None:
    for key, why in _SGLANG_OWNS:
        hit = first_under(paths, key)
        if hit is not None:
            raise ConfigError(f"{where}{hit}: not used under SGLang: {why}")


def _check_tiers(cfg: KVStrataConfig) -> None:
    """A tier below SGLang's host pool, in a directory named for it; a remote tier's slab."""
    if cfg.ssd.enabled and "ssd.path" not in cfg.explicit:
        raise ConfigError("ssd.path: required: the directory of this SGLang deployment's SSD tier (each rank "
                          "uses rank-<r> under it; never a vLLM deployment's), or ssd.capacity: 0 with remote.url")
    if not cfg.ssd.enabled and not cfg.remote.url:
        raise ConfigError("ssd.path: no tier below SGLang's host pool: set ssd.path (and ssd.capacity) or remote.url")
    if cfg.remote.url and "cpu.capacity" in cfg.explicit and cfg.cpu.capacity == 0:
        raise ConfigError("cpu.capacity: the remote tier's pages land in a CPU slab before SGLang's host pool: "
                          f"leave it unset ({LANDING_PAGES} pages) or give it room for at least 128 pages")

