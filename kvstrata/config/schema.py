"""kvstrata configuration: frozen dataclasses loaded from YAML or dicts.

Every error is a :class:`ConfigError` whose message starts with the dotted
field path (``cpu.capacity: expected a size like '8GiB', got 'lots'``).
Unknown keys are errors with a did-you-mean suggestion.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from kvstrata.errors import ConfigError
from kvstrata.system.values import (check_keys, clip, duration_s, format_size, integer, one_of, parse_size, path_or_none,
                             plural, short_key, short_repr)
from kvstrata.config.load import LoadConfig
from kvstrata.config.model import ModelConfig
from kvstrata.config.remote import REMOTE_SCHEMES, RemoteConfig
from kvstrata.config.tier_sections import TierSections
from kvstrata.system.values import ALWAYS, LRU, eviction, tier_admission
from kvstrata.config.yaml_file import YAMLLimitError, load_yaml, read_yaml

__all__ = [
    "ConfigError",
    "GPUConfig",
    "CPUConfig",
    "SSDConfig",
    "SSD_TIER_KEYS",
    "RemoteConfig",
    "REMOTE_SCHEMES",
    "ModelConfig",
    "SpillConfig",
    "LoadConfig",
    "MetricsConfig",
    "KVStrataConfig",
    "parse_size",
    "format_size",
    "plural",
    "short_repr",
    "apply_overrides",
    "read_yaml",
    "key_paths",
]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxh3_128")


@dataclass(frozen=True)
class GPUConfig:
    """The device block pool: ``num_blocks`` rows, or ``capacity`` bytes (one of them).

    ``max_num_batched_tokens``: the engine's tokens per step (vLLM's setting of that
    name), in which ``kvstrata bench`` computes a prompt's prefill, a chunk a step; None
    (the default): a prefill in one step. A recording carries the engine's. With vLLM the
    connector follows the engine's steps instead."""

    num_blocks: int | None = 1024
    capacity: int | None = None
    device: str = "auto"
    max_num_batched_tokens: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "gpu") -> "GPUConfig":
        check_keys(d, ("num_blocks", "capacity", "device", "max_num_batched_tokens"), p)
        num_blocks = integer(d.get("num_blocks"), f"{p}.num_blocks", minimum=1, optional=True)
        capacity = parse_size(d["capacity"], f"{p}.capacity") if d.get("capacity") is not None else None
        if num_blocks is not None and capacity is not None:
            raise ConfigError(f"{p}: set either num_blocks or capacity, not both")
        if num_blocks is None and capacity is None:
            num_blocks = cls.num_blocks
        device = d.get("device", "auto")
        if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ConfigError(f"{p}.device: expected auto, cpu, cuda or cuda:N; got {short_repr(device)}")
        budget = integer(d.get("max_num_batched_tokens"), f"{p}.max_num_batched_tokens", minimum=1, optional=True)
        return cls(num_blocks=num_blocks, capacity=capacity, device=device, max_num_batched_tokens=budget)

    def resolve_num_blocks(self, block_nbytes: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        assert self.capacity is not None
        n = self.capacity // block_nbytes
        if n < 1:
            raise ConfigError(f"gpu.capacity: {self.capacity} bytes is below one block ({block_nbytes} bytes)")
        return n

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def pool_mismatch(self, key: str, num_blocks: int, block_nbytes: int, device: str) -> str | None:
        """Why the value of ``key`` (``num_blocks``, ``capacity`` or ``device``) does not
        describe a pool of ``num_blocks`` rows of ``block_nbytes`` bytes on ``device``;
        None when it does (``auto`` describes every device, ``cuda`` every CUDA device)."""
        pool = "the kv_pool passed to TieredKVCache"
        if key == "num_blocks" and self.num_blocks not in (None, num_blocks):
            return f"{self.num_blocks} in the config, but {pool} has {num_blocks} blocks"
        if key == "capacity" and self.capacity is not None and self.capacity // block_nbytes != num_blocks:
            return (f"{format_size(self.capacity)} in the config is {self.capacity // block_nbytes} blocks of "
                    f"{block_nbytes} bytes, but {pool} has {num_blocks} blocks")
        if key == "device" and not _device_matches(self.device, device):
            return f"{self.device} in the config, but {pool} is on {device}"
        return None


def _device_matches(configured: str, device: str) -> bool:
    return configured in ("auto", device) or (configured == "cuda" and device.startswith("cuda"))


@dataclass(frozen=True)
class CPUConfig:
    """The DRAM tier: a preallocated slab of ``capacity`` bytes (0 disables the tier)."""

    capacity: int = 8 * 1024**3
    pin_memory: str = "auto"
    eviction: str = LRU

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "cpu") -> "CPUConfig":
        check_keys(d, ("capacity", "pin_memory", "eviction"), p)
        cap = parse_size(d.get("capacity", cls.capacity), f"{p}.capacity")
        pin = one_of(d.get("pin_memory", "auto"), f"{p}.pin_memory", ("auto", "true", "false"))
        return cls(capacity=cap, pin_memory=pin, eviction=eviction(d, p))

    @property
    def pin(self) -> bool | None:
        return None if self.pin_memory == "auto" else self.pin_memory == "true"


@dataclass(frozen=True)
class SSDConfig:
    """The LMDB tier under ``path`` (``null`` path or capacity 0 disables it)."""

    path: str | None = "~/.cache/kvstrata"
    capacity: int = 100 * 1024**3
    compression: str = "auto"
    level: int = 1
    queue_capacity: int = 256 * 1024**2
    admission: str = ALWAYS
    ghost_keys: int | None = None
    eviction: str = LRU

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "ssd") -> "SSDConfig":
        check_keys(d, ("path", "capacity", "compression", "level", "queue_capacity", "admission", "ghost_keys",
                       "eviction"), p)
        path = d.get("path", cls.path)
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ConfigError(f"{p}.path: expected a directory path or null, got {short_repr(path)}")
        cap = parse_size(d.get("capacity", cls.capacity), f"{p}.capacity")
        comp = one_of(d.get("compression", "auto"), f"{p}.compression", ("auto", "zstd", "none"))
        level = integer(d.get("level", 1), f"{p}.level", minimum=-7, maximum=22)
        qcap = parse_size(d.get("queue_capacity", cls.queue_capacity), f"{p}.queue_capacity")
        return cls(path=path, capacity=cap, compression=comp, level=level, queue_capacity=qcap,
                   eviction=eviction(d, p), **tier_admission(d, p))

    @property
    def enabled(self) -> bool:
        return self.path is not None and self.capacity > 0

    def resolved_path(self) -> Path | None:
        return Path(os.path.expanduser(os.path.expandvars(self.path))) if self.path else None


#: the ``ssd.*`` key each :class:`~kvstrata.tiers.ssd.SSDTier` argument comes from (for its errors)
SSD_TIER_KEYS = {"path": "ssd.path", "capacity_bytes": "ssd.capacity", "queue_capacity_bytes": "ssd.queue_capacity"}


# The spill rules (``spill.admission``, ``spill.promotion``): the choices and which combine.
ON_COMPUTE, ON_EVICT = "on_compute", "on_evict"
ADMISSIONS = (ON_COMPUTE, ON_EVICT)
PROMOTIONS = ("inclusive", "exclusive")


def check_spill_rules(admission: object, promotion: object, section: str = "spill") -> None:
    """The admission and promotion choices, and which combinations exist (``ConfigError``
    naming the key under ``section``)."""
    if admission not in ADMISSIONS:
        raise ConfigError(f"{section}.admission: expected one of {', '.join(ADMISSIONS)}; got {admission!r}")
    if promotion not in PROMOTIONS:
        raise ConfigError(f"{section}.promotion: expected one of {', '.join(PROMOTIONS)}; got {promotion!r}")
    if admission == ON_COMPUTE and promotion == "exclusive":
        raise ConfigError(f"{section}.promotion: exclusive needs {section}.admission: on_evict (with on_compute "
                          "a loaded block is stored again as soon as its request computes)")


@dataclass(frozen=True)
class SpillConfig:
    """How blocks move between tiers (the tier policy's rules, the same in every mode).

    ``admission``: ``on_compute`` stores every block below as soon as it is
    computed; ``on_evict`` stores a block when the GPU pool evicts it.
    ``watermark`` (``on_evict`` only): fraction of the GPU pool (at least one
    block) of least recently used free blocks paged out ahead of eviction.
    ``promotion``: ``inclusive`` keeps the lower copy when a block is loaded,
    ``exclusive`` moves it out of the CPU tier (``on_evict`` only).
    ``write_through``: every block stored to the CPU tier is also queued for
    the SSD tier, so the SSD tier is a persistent superset of the CPU tier.
    """

    admission: str = "on_compute"
    watermark: float = 0.02
    promotion: str = "inclusive"
    write_through: bool = True

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "spill") -> "SpillConfig":
        check_keys(d, ("admission", "watermark", "promotion", "write_through"), p)
        wm = d.get("watermark", cls.watermark)
        if isinstance(wm, bool) or not isinstance(wm, (int, float)) or not 0 <= wm <= 1:
            raise ConfigError(f"{p}.watermark: expected a fraction between 0 and 1, got {short_repr(wm)}")
        wt = d.get("write_through", cls.write_through)
        if not isinstance(wt, bool):
            raise ConfigError(f"{p}.write_through: expected true or false, got {short_repr(wt)}")
        adm = one_of(d.get("admission", cls.admission), f"{p}.admission", ADMISSIONS)
        promo = one_of(d.get("promotion", cls.promotion), f"{p}.promotion", PROMOTIONS)
        check_spill_rules(adm, promo, p)
        if adm == "on_compute" and "watermark" in d:
            raise ConfigError(f"{p}.watermark: only used with {p}.admission: on_evict (on_compute stores "
                              "every block when it is computed; there is nothing to page out)")
        return cls(admission=adm, watermark=float(wm), promotion=promo, write_through=wt)


@dataclass(frozen=True)
class MetricsConfig:
    port: int | None = None
    host: str = "0.0.0.0"  # every interface, as Prometheus scrapes from elsewhere; 127.0.0.1: this machine only

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "metrics") -> "MetricsConfig":
        check_keys(d, ("port", "host"), p)
        port = integer(d.get("port"), f"{p}.port", minimum=0, maximum=65535, optional=True)
        host = d.get("host", cls.host)
        if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
            raise ConfigError(f"{p}.host: expected an address to listen on (0.0.0.0, 127.0.0.1, ::), got {host!r}")
        return cls(port=port, host=host)


@dataclass(frozen=True)
class TraceConfig:
    """The plugin's request recorder (``path`` null: off). ``path`` is a directory:
    each server start writes one recording there, in parts rotated after
    ``rotate_bytes`` or ``rotate_seconds``, of ``sample`` of the requests; with a
    ``secret_file`` (or ``secret``) every block hash is re-keyed (HMAC) so it cannot be
    matched against the hashes of known prompts; without one the recorder stays off
    unless ``insecure_hashes`` says the plain hashes may be recorded."""

    path: str | None = None
    rotate_bytes: int = 256 * 1024**2
    rotate_seconds: float = 3600.0
    sample: float = 1.0
    secret: str | None = field(default=None, repr=False)
    secret_file: str | None = None
    insecure_hashes: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "trace") -> "TraceConfig":
        check_keys(d, ("path", "rotate_bytes", "rotate_seconds", "sample", "secret", "secret_file",
                        "insecure_hashes"), p)
        path = d.get("path")
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ConfigError(f"{p}.path: expected a directory, got {short_repr(path)}")
        rotate = parse_size(d.get("rotate_bytes", cls.rotate_bytes), f"{p}.rotate_bytes")
        if rotate < 4096:
            raise ConfigError(f"{p}.rotate_bytes: expected at least 4KiB, got {short_repr(d.get('rotate_bytes'))}")
        seconds = duration_s(d.get("rotate_seconds", cls.rotate_seconds), f"{p}.rotate_seconds", minimum=1,
                           maximum=366 * 86400)
        sample = d.get("sample", cls.sample)
        if isinstance(sample, bool) or not isinstance(sample, (int, float)) or not 0 < sample <= 1:
            raise ConfigError(f"{p}.sample: expected a fraction of the requests in (0, 1], got {short_repr(sample)}")
        secret = d.get("secret")
        if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
            raise ConfigError(f"{p}.secret: expected a string of at least 16 characters")
        secret_file = path_or_none(d, "secret_file", p)
        if secret is not None and secret_file is not None:
            raise ConfigError(f"{p}.secret_file: give the secret once (trace.secret or trace.secret_file)")
        insecure = d.get("insecure_hashes", False)
        if not isinstance(insecure, bool):
            raise ConfigError(f"{p}.insecure_hashes: expected true or false, got {short_repr(insecure)}")
        return cls(path=path, rotate_bytes=rotate, rotate_seconds=seconds, sample=float(sample), secret=secret,
                   secret_file=secret_file, insecure_hashes=insecure)

    def key(self) -> bytes | None:
        """The secret block hashes are re-keyed with: ``secret_file``'s first line, else ``secret``."""
        from kvstrata.config.credentials import read_secret_file

        if self.secret_file is not None:
            return read_secret_file(self.secret_file, "trace.secret_file")[0]
        return self.secret.encode() if self.secret else None

    @property
    def enabled(self) -> bool:
        return self.path is not None


_SECTIONS = {
    "gpu": GPUConfig,
    "cpu": CPUConfig,
    "ssd": SSDConfig,
    "model": ModelConfig,
    "spill": SpillConfig,
    "load": LoadConfig,
    "metrics": MetricsConfig,
    "remote": RemoteConfig,
    "trace": TraceConfig,
    "tiers": TierSections,
}


@dataclass(frozen=True)
class KVStrataConfig:
    """The whole configuration (see ``configs/default.yaml``)."""

    block_size: int = 16
    hash: str = "sha256"
    gpu: GPUConfig = field(default_factory=GPUConfig)
    cpu: CPUConfig = field(default_factory=CPUConfig)
    ssd: SSDConfig = field(default_factory=SSDConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    spill: SpillConfig = field(default_factory=SpillConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    tiers: TierSections = field(default_factory=TierSections)
    trace: TraceConfig = field(default_factory=TraceConfig)
    #: dotted paths of the keys the input set (defaults excluded): a mode that cannot
    #: honour a key rejects it only when it was set
    explicit: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, overrides: Mapping[str, Any] | Iterable[str] = ()) -> "KVStrataConfig":
        """Build from a mapping, then apply dotted ``overrides`` (``{"cpu.capacity": "16GiB"}``
        or ``["cpu.capacity=16GiB"]``)."""
        d = apply_overrides(dict(d or {}), overrides)
        check_keys(d, ("block_size", "hash", *_SECTIONS), "")
        kwargs: dict[str, Any] = {
            "block_size": integer(d.get("block_size", 16), "block_size", minimum=1),
            "hash": one_of(d.get("hash", "sha256"), "hash", HASH_ALGOS),
        }
        for name, section in _SECTIONS.items():
            sub = d.get(name) or {}
            kwargs[name] = section.from_dict(sub, name)
        explicit = {k for k in d if k not in _SECTIONS}
        explicit |= {f"{name}.{k}" for name in _SECTIONS for k in (d.get(name) or {})}
        return cls(**kwargs, explicit=frozenset(explicit))

    def reject(self, keys: Iterable[str], why: str) -> None:
        """Raise :class:`ConfigError` naming the first of ``keys`` (dotted paths, or a
        section name for all its keys) that was set explicitly, with ``why``."""
        for key in keys:
            hit = first_under(self.explicit, key)
            if hit is not None:
                raise ConfigError(f"{hit}: {why}")

    def check_kv_pool(self, num_blocks: int, block_nbytes: int, device: str) -> None:
        """Raise :class:`ConfigError` naming the first explicitly set ``gpu.*`` key whose
        value does not describe the pool passed to ``TieredKVCache`` (``num_blocks`` rows
        of ``block_nbytes`` bytes on ``device``): values that describe it are accepted."""
        for key in sorted(k for k in self.explicit if k.startswith("gpu.")):
            why = self.gpu.pool_mismatch(key[len("gpu."):], num_blocks, block_nbytes, device)
            if why is not None:
                raise ConfigError(f"{key}: {why}")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], overrides: Mapping[str, Any] | Iterable[str] = ()) -> "KVStrataConfig":
        data = read_yaml(path)
        try:
            return cls.from_dict(data, overrides)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def block_nbytes(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        if self.model.block_nbytes is not None:
            return self.model.block_nbytes
        return self.model.bytes_per_token() * self.block_size

    def to_dict(self) -> dict[str, Any]:
        """Every value, as :meth:`from_dict` reads it back (the same config)."""
        out = dataclasses.asdict(self)
        out.pop("explicit", None)
        out["tiers"] = self.tiers.to_dict()
        if self.spill.admission != "on_evict":
            del out["spill"]["watermark"]  # refused beside on_compute (see SpillConfig)
        return out


def first_under(paths: Iterable[str], key: str) -> str | None:
    """The first (sorted) of ``paths`` that is ``key`` or lies under it (``key.``...)."""
    return min((p for p in paths if p == key or p.startswith(key + ".")), default=None)


def key_paths(d: Mapping[str, Any], overrides: Mapping[str, Any] | Iterable[str] = ()) -> set[str]:
    """The dotted paths a config mapping and its overrides set (before any value is checked)."""
    def flat(m: Mapping[str, Any]) -> set[str]:
        paths = {str(k) for k, v in m.items() if not isinstance(v, Mapping) or not v}
        return paths | {f"{k}.{sub}" for k, v in m.items() if isinstance(v, Mapping) for sub in flat(v)}

    items = flat(overrides) if isinstance(overrides, Mapping) else {
        str(o).split("=", 1)[0].strip() for o in overrides}
    return flat(d) | items


def _parse_override_value(raw: str, key: str = "override") -> Any:
    """The value of ``KEY=VALUE`` as YAML, or ``raw`` itself where it is not valid YAML;
    YAML refused by :func:`load_yaml` is a :class:`ConfigError` naming ``key``."""
    import yaml

    try:
        return load_yaml(raw)
    except YAMLLimitError as e:
        raise ConfigError(f"{clip(key)}: {e}") from None
    except yaml.YAMLError:
        return raw


def apply_overrides(d: dict[str, Any], overrides: Mapping[str, Any] | Iterable[str]) -> dict[str, Any]:
    """Apply dotted-path overrides to a nested dict (returns a new dict).

    ``overrides`` is a mapping ``{"cpu.capacity": "16GiB"}`` or strings
    ``"cpu.capacity=16GiB"`` (values parsed as YAML scalars).
    """
    items: list[tuple[str, Any]]
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    else:
        items = []
        for s in overrides:
            if not isinstance(s, str) or "=" not in s:
                raise ConfigError(f"override {short_repr(s)}: expected KEY=VALUE, e.g. cpu.capacity=16GiB")
            k, v = s.split("=", 1)
            items.append((k.strip(), _parse_override_value(v.strip(), k.strip())))
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in d.items()}
    for key, value in items:
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"{short_key(key)}: malformed dotted key")
        node = out
        for i, part in enumerate(parts[:-1]):
            if i == 0:
                check_keys({part: None}, _SECTIONS, "")
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, Mapping):
                raise ConfigError(f"{clip('.'.join(parts[: i + 1]))}: is not a section")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return out
