"""kvstrata configuration: frozen dataclasses loaded from YAML or dicts.

Every error is a :class:`ConfigError` whose message starts with the dotted
field path (``cpu.capacity: expected a size like '8GiB', got 'lots'``).
Unknown keys are errors with a did-you-mean suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from kvstrata.errors import ConfigError

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
    "MetricsConfig",
    "KVStrataConfig",
    "parse_size",
    "format_size",
    "apply_overrides",
    "read_yaml",
    "key_paths",
]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)")
_MAX_SIZE = 2**60  # 1 EiB
_SIZE_RANGE = "expected a finite size between 0 and 1 EiB"
_MAX_INT = 2**31 - 1
_MAX_SHOWN = 80
_MAX_FILE_BYTES = 2**20
_MAX_YAML_DEPTH = 32
_MAX_YAML_VALUES = 10_000
_MAX_YAML_INT_CHARS = 1000

HASH_ALGOS = ("sha256", "sha256_cbor", "xxh3_128")
KV_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2,
                  "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def parse_size(value: Any, what: str = "size") -> int:
    """Parse ``512MiB``, ``64GiB``, ``1.5GB`` or a plain non-negative integer into bytes
    (at most 1 EiB; a fraction of a byte is dropped)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{what}: {_SIZE_RANGE}, got {short_repr(value)}")
    if isinstance(value, str):
        nbytes = _size_string(value, what)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value):
        nbytes = int(value)
    else:
        raise ConfigError(f"{what}: expected a size like '8GiB', got {short_repr(value)}")
    if nbytes < 0:
        raise ConfigError(f"{what}: expected a non-negative size, got {short_repr(value)}")
    if nbytes > _MAX_SIZE:
        raise ConfigError(f"{what}: {_SIZE_RANGE}, got {short_repr(value)}")
    return nbytes


def _size_string(text: str, what: str) -> int:
    """The bytes in a size string such as ``1.5GiB``, exactly (no float rounding)."""
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None or m.group(3).lower() not in _UNITS:
        raise ConfigError(f"{what}: expected a size like '8GiB', got {short_repr(text)}")
    whole, frac = m.group(1).lstrip("0"), (m.group(2) or "")[:64]
    if len(whole) > 30:
        raise ConfigError(f"{what}: {_SIZE_RANGE}, got {short_repr(text)}")
    return int(whole + frac or "0") * _UNITS[m.group(3).lower()] // 10 ** len(frac)


def plural(n: int, noun: str) -> str:
    """``1 bad line``, ``2 bad lines``, ``1,024 bad lines``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def format_size(nbytes: float) -> str:
    """Human-readable binary size (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


class _ShortRepr(reprlib.Repr):
    """``repr`` that stops early: a few items of a few levels, long strings and numbers
    cut in the middle, so its cost and length do not grow with the value."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 6
        self.maxset = self.maxfrozenset = self.maxdeque = 6
        self.maxstring = self.maxother = _MAX_SHOWN
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:  # more digits than Python converts to text
            return f"<{'negative ' if x < 0 else ''}integer of {x.bit_length():,} bits>"


_SHORT_REPR = _ShortRepr()


def short_repr(value: Any) -> str:
    """``repr(value)`` for an error message: at most about 80 characters, ``...`` where cut,
    cheap for any value (an alias bomb, a huge string or integer, a recursive list)."""
    return _clip(_SHORT_REPR.repr(value))


def _short_key(key: Any) -> str:
    """A mapping key as it reads in a dotted path, shortened like :func:`short_repr`."""
    return _clip(key if isinstance(key, str) else short_repr(key))


def _clip(text: str) -> str:
    """``text`` cut to at most 80 characters, ending in ``...`` where cut."""
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


# --------------------------------------------------------------------------- fields

def _int(v: Any, path: str, *, minimum: int | None = None, maximum: int = _MAX_INT,
         optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{path}: expected an integer, got {short_repr(v)}")
    if minimum is not None and v < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {short_repr(v)}")
    if v > maximum:
        raise ConfigError(f"{path}: must be <= {maximum}, got {short_repr(v)}")
    return v


def _choice(v: Any, path: str, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if isinstance(v, bool):  # YAML turns yes/no/true/false into bools
        v = "true" if v else "false"
    if not isinstance(v, str) or v not in choices:
        raise ConfigError(f"{path}: expected one of {', '.join(choices)}; got {short_repr(v)}")
    return v


def _check_keys(d: Mapping[str, Any], allowed: Iterable[str], prefix: str) -> None:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(d).__name__}")
    allowed = list(allowed)
    for key in d:
        if key not in allowed:
            name = _short_key(key)
            path = f"{prefix}.{name}" if prefix else name
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(allowed)}"
            raise ConfigError(f"{path}: unknown key{hint}")


@dataclass(frozen=True)
class GPUConfig:
    """The device block pool: ``num_blocks`` rows, or ``capacity`` bytes (one of them)."""

    num_blocks: int | None = 1024
    capacity: int | None = None
    device: str = "auto"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "gpu") -> "GPUConfig":
        _check_keys(d, ("num_blocks", "capacity", "device"), p)
        num_blocks = _int(d.get("num_blocks"), f"{p}.num_blocks", minimum=1, optional=True)
        capacity = parse_size(d["capacity"], f"{p}.capacity") if d.get("capacity") is not None else None
        if num_blocks is not None and capacity is not None:
            raise ConfigError(f"{p}: set either num_blocks or capacity, not both")
        if num_blocks is None and capacity is None:
            num_blocks = cls.num_blocks
        device = d.get("device", "auto")
        if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ConfigError(f"{p}.device: expected auto, cpu, cuda or cuda:N; got {short_repr(device)}")
        return cls(num_blocks=num_blocks, capacity=capacity, device=device)

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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "cpu") -> "CPUConfig":
        _check_keys(d, ("capacity", "pin_memory"), p)
        cap = parse_size(d.get("capacity", cls.capacity), f"{p}.capacity")
        pin = _choice(d.get("pin_memory", "auto"), f"{p}.pin_memory", ("auto", "true", "false"))
        return cls(capacity=cap, pin_memory=pin)

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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "ssd") -> "SSDConfig":
        _check_keys(d, ("path", "capacity", "compression", "level", "queue_capacity"), p)
        path = d.get("path", cls.path)
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ConfigError(f"{p}.path: expected a directory path or null, got {short_repr(path)}")
        cap = parse_size(d.get("capacity", cls.capacity), f"{p}.capacity")
        comp = _choice(d.get("compression", "auto"), f"{p}.compression", ("auto", "zstd", "none"))
        level = _int(d.get("level", 1), f"{p}.level", minimum=-7, maximum=22)
        qcap = parse_size(d.get("queue_capacity", cls.queue_capacity), f"{p}.queue_capacity")
        return cls(path=path, capacity=cap, compression=comp, level=level, queue_capacity=qcap)

    @property
    def enabled(self) -> bool:
        return self.path is not None and self.capacity > 0

    def resolved_path(self) -> Path | None:
        return Path(os.path.expanduser(os.path.expandvars(self.path))) if self.path else None


#: the ``ssd.*`` key each :class:`~kvstrata.tiers.ssd.SSDTier` argument comes from (for its errors)
SSD_TIER_KEYS = {"path": "ssd.path", "capacity_bytes": "ssd.capacity", "queue_capacity_bytes": "ssd.queue_capacity"}


REMOTE_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


def _seconds(v: Any, path: str, *, minimum: float, maximum: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{path}: expected a number of seconds, got {short_repr(v)}")
    if not minimum <= v <= maximum:
        raise ConfigError(f"{path}: expected seconds in [{minimum:g}, {maximum:g}], got {short_repr(v)}")
    return float(v)


REMOTE_SECRET_ENV = "KVSTRATA_REMOTE_SECRET"


def _path_or_none(d: Mapping[str, Any], key: str, p: str) -> str | None:
    v = d.get(key)
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise ConfigError(f"{p}.{key}: expected a path, got {short_repr(v)}")
    return v


def _remote_url(v: Any, path: str) -> str | None:
    """``redis://[user:password@]host:port[/db]``, ``rediss://`` (TLS), ``unix:///socket``
    (``valkey://`` and ``valkeys://`` are read as ``redis://`` and ``rediss://``), or None.
    Errors show the URL with its password redacted."""
    from kvstrata.credentials import redact_url

    if v is None:
        return None
    if not isinstance(v, str) or any(c.isspace() for c in v):
        raise ConfigError(f"{path}: expected a URL like redis://host:6379/0, got {short_repr(redact_url(v))}")
    from urllib.parse import urlsplit

    try:
        u = urlsplit(v)
        port = u.port
    except ValueError as exc:
        raise ConfigError(f"{path}: {redact_url(str(exc))}: {short_repr(redact_url(v))}") from None
    if u.scheme not in REMOTE_SCHEMES:
        raise ConfigError(f"{path}: expected a scheme among {', '.join(REMOTE_SCHEMES)}; "
                          f"got {short_repr(redact_url(v))}")
    if u.scheme == "unix":
        if not u.path:
            raise ConfigError(f"{path}: a unix:// URL names a socket file (unix:///run/valkey.sock), "
                              f"got {short_repr(redact_url(v))}")
        return v
    if not u.hostname:
        raise ConfigError(f"{path}: no host in {short_repr(redact_url(v))} (expected redis://host:6379/0)")
    db = u.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"{path}: the path names a database number (redis://host:6379/0), "
                          f"got {short_repr(redact_url(v))}")
    del port
    return v


@dataclass(frozen=True)
class RemoteConfig:
    """A shared tier on a Redis or Valkey server (``url`` null: none).

    ``capacity``: what kvstrata may use of the server (None: the server's ``maxmemory``;
    the server bounds the store itself with ``maxmemory`` and ``allkeys-lru``, kvstrata
    reports both and warns when the capacity exceeds it; ``kvstrata bench`` sizes its model
    of the shared tier with it). ``timeout``: the deadline of one round trip (a lookup that cannot answer
    in time is a miss). ``queue_capacity``: bytes waiting to be written (beyond it puts
    are dropped and counted). ``batch_bytes``: values per pipelined round trip.
    ``secret_file``: the deployment's secrets (one per line, the first signs; a file only
    its owner can read), which every value is signed with; else the environment variable
    ``KVSTRATA_REMOTE_SECRET``. ``trust_server``: run without a secret (values unsigned:
    whoever can write to the server can have their bytes served). ``password_file``: the
    server's password (first line; else ``REDISCLI_AUTH``), so that none is inline in the URL.
    """

    url: str | None = None
    cluster: bool = False
    secret_file: str | None = None
    trust_server: bool = False
    password_file: str | None = None
    capacity: int | None = None
    compression: str = "auto"
    level: int = 1
    timeout: float = 0.5
    connect_timeout: float = 1.0
    queue_capacity: int = 256 * 1024**2
    batch_bytes: int = 8 * 1024**2

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "remote") -> "RemoteConfig":
        _check_keys(d, ("url", "cluster", "capacity", "compression", "level", "timeout", "connect_timeout",
                        "queue_capacity", "batch_bytes", "secret_file", "trust_server", "password_file"), p)
        cluster, trust = d.get("cluster", False), d.get("trust_server", False)
        for key, flag in (("cluster", cluster), ("trust_server", trust)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{p}.{key}: expected true or false, got {short_repr(flag)}")
        secret_file, password_file = _path_or_none(d, "secret_file", p), _path_or_none(d, "password_file", p)
        batch = parse_size(d.get("batch_bytes", cls.batch_bytes), f"{p}.batch_bytes")
        if batch < 64 * 1024:
            raise ConfigError(f"{p}.batch_bytes: expected at least 64KiB, got {short_repr(d.get('batch_bytes'))}")
        return cls(url=_remote_url(d.get("url"), f"{p}.url"), cluster=cluster, secret_file=secret_file,
                   trust_server=trust, password_file=password_file,
                   capacity=None if d.get("capacity") is None else parse_size(d["capacity"], f"{p}.capacity"),
                   compression=_choice(d.get("compression", "auto"), f"{p}.compression", ("auto", "zstd", "none")),
                   level=_int(d.get("level", 1), f"{p}.level", minimum=-7, maximum=22),
                   timeout=_seconds(d.get("timeout", cls.timeout), f"{p}.timeout", minimum=0.001, maximum=60),
                   connect_timeout=_seconds(d.get("connect_timeout", cls.connect_timeout), f"{p}.connect_timeout",
                                            minimum=0.001, maximum=60),
                   queue_capacity=parse_size(d.get("queue_capacity", cls.queue_capacity), f"{p}.queue_capacity"),
                   batch_bytes=batch)

    @property
    def enabled(self) -> bool:
        return self.url is not None and self.capacity != 0

    def secrets(self) -> list[bytes] | None:
        """The secrets values are signed with (``secret_file``, else ``KVSTRATA_REMOTE_SECRET``);
        None with ``trust_server``. A ConfigError naming ``remote.secret_file`` when there is
        none: a server anyone can write to would otherwise have its bytes served as KV."""
        from kvstrata.credentials import read_secret_file, secrets_from_env

        if self.secret_file is not None:
            return read_secret_file(self.secret_file, "remote.secret_file")
        found = secrets_from_env(REMOTE_SECRET_ENV)
        if found is not None:
            return found
        if self.trust_server:
            return None
        raise ConfigError(f"remote.secret_file: the remote tier signs its values with a secret: set "
                          f"remote.secret_file (a file only its owner can read) or {REMOTE_SECRET_ENV}, or set "
                          f"remote.trust_server: true if only trusted processes can write to the server")

    def password(self) -> str | None:
        """The server's password from ``password_file`` (else ``REDISCLI_AUTH``); None: the URL's own."""
        from kvstrata.credentials import read_secret_file

        if self.password_file is not None:
            return read_secret_file(self.password_file, "remote.password_file", min_bytes=1)[0].decode()
        return os.environ.get("REDISCLI_AUTH") or None

    def __repr__(self) -> str:  # the URL's password is never shown
        from kvstrata.credentials import redact_url

        fields = ", ".join(f"{f.name}={redact_url(v) if f.name == 'url' else v!r}"
                           for f in dataclasses.fields(self) for v in (getattr(self, f.name),))
        return f"RemoteConfig({fields})"


@dataclass(frozen=True)
class ModelConfig:
    """The model: its identity and KV layout (the layout sizes one block when no engine
    hands kvstrata its tensors).

    ``id`` overrides the model's identity in every fingerprint: blocks are
    shared exactly between deployments with equal ids (and layouts). Without
    it the library uses ``name``, and the vLLM connector derives the identity
    from the checkpoint's weight files. ``block_nbytes`` overrides the value
    derived from the layout (``2 * layers * kv_heads * head_size * dtype bytes
    * block_size``).
    """

    name: str = "default"
    id: str | None = None
    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    kv_dtype: str = "fp16"
    block_nbytes: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "model") -> "ModelConfig":
        _check_keys(d, ("name", "id", "layers", "kv_heads", "head_size", "kv_dtype", "block_nbytes"), p)
        name = d.get("name", cls.name)
        if not isinstance(name, str):
            raise ConfigError(f"{p}.name: expected a string, got {short_repr(name)}")
        ident = d.get("id")
        if ident is not None and (not isinstance(ident, str) or not ident.strip()):
            raise ConfigError(f"{p}.id: expected a non-empty string, got {short_repr(ident)}")
        bn = d.get("block_nbytes")
        return cls(
            name=name,
            id=ident,
            layers=_int(d.get("layers", cls.layers), f"{p}.layers", minimum=1),
            kv_heads=_int(d.get("kv_heads", cls.kv_heads), f"{p}.kv_heads", minimum=1),
            head_size=_int(d.get("head_size", cls.head_size), f"{p}.head_size", minimum=1),
            kv_dtype=_choice(d.get("kv_dtype", cls.kv_dtype), f"{p}.kv_dtype", KV_DTYPE_BYTES),
            block_nbytes=_block_nbytes(bn, f"{p}.block_nbytes") if bn is not None else None,
        )

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * KV_DTYPE_BYTES[self.kv_dtype]


def _block_nbytes(value: Any, path: str) -> int:
    nbytes = parse_size(value, path)
    if nbytes < 1:
        raise ConfigError(f"{path}: expected a positive size, got {short_repr(value)}")
    return nbytes


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
        _check_keys(d, ("admission", "watermark", "promotion", "write_through"), p)
        wm = d.get("watermark", cls.watermark)
        if isinstance(wm, bool) or not isinstance(wm, (int, float)) or not 0 <= wm <= 1:
            raise ConfigError(f"{p}.watermark: expected a fraction between 0 and 1, got {short_repr(wm)}")
        wt = d.get("write_through", cls.write_through)
        if not isinstance(wt, bool):
            raise ConfigError(f"{p}.write_through: expected true or false, got {short_repr(wt)}")
        adm = _choice(d.get("admission", cls.admission), f"{p}.admission", ADMISSIONS)
        promo = _choice(d.get("promotion", cls.promotion), f"{p}.promotion", PROMOTIONS)
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
        _check_keys(d, ("port", "host"), p)
        port = _int(d.get("port"), f"{p}.port", minimum=0, maximum=65535, optional=True)
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
        _check_keys(d, ("path", "rotate_bytes", "rotate_seconds", "sample", "secret", "secret_file",
                        "insecure_hashes"), p)
        path = d.get("path")
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ConfigError(f"{p}.path: expected a directory, got {short_repr(path)}")
        rotate = parse_size(d.get("rotate_bytes", cls.rotate_bytes), f"{p}.rotate_bytes")
        if rotate < 4096:
            raise ConfigError(f"{p}.rotate_bytes: expected at least 4KiB, got {short_repr(d.get('rotate_bytes'))}")
        seconds = _seconds(d.get("rotate_seconds", cls.rotate_seconds), f"{p}.rotate_seconds", minimum=1,
                           maximum=366 * 86400)
        sample = d.get("sample", cls.sample)
        if isinstance(sample, bool) or not isinstance(sample, (int, float)) or not 0 < sample <= 1:
            raise ConfigError(f"{p}.sample: expected a fraction of the requests in (0, 1], got {short_repr(sample)}")
        secret = d.get("secret")
        if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
            raise ConfigError(f"{p}.secret: expected a string of at least 16 characters")
        secret_file = _path_or_none(d, "secret_file", p)
        if secret is not None and secret_file is not None:
            raise ConfigError(f"{p}.secret_file: give the secret once (trace.secret or trace.secret_file)")
        insecure = d.get("insecure_hashes", False)
        if not isinstance(insecure, bool):
            raise ConfigError(f"{p}.insecure_hashes: expected true or false, got {short_repr(insecure)}")
        return cls(path=path, rotate_bytes=rotate, rotate_seconds=seconds, sample=float(sample), secret=secret,
                   secret_file=secret_file, insecure_hashes=insecure)

    def key(self) -> bytes | None:
        """The secret block hashes are re-keyed with: ``secret_file``'s first line, else ``secret``."""
        from kvstrata.credentials import read_secret_file

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
    "metrics": MetricsConfig,
    "remote": RemoteConfig,
    "trace": TraceConfig,
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
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    #: dotted paths of the keys the input set (defaults excluded): a mode that cannot
    #: honour a key rejects it only when it was set
    explicit: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, overrides: Mapping[str, Any] | Iterable[str] = ()) -> "KVStrataConfig":
        """Build from a mapping, then apply dotted ``overrides`` (``{"cpu.capacity": "16GiB"}``
        or ``["cpu.capacity=16GiB"]``)."""
        d = apply_overrides(dict(d or {}), overrides)
        _check_keys(d, ("block_size", "hash", *_SECTIONS), "")
        kwargs: dict[str, Any] = {
            "block_size": _int(d.get("block_size", 16), "block_size", minimum=1),
            "hash": _choice(d.get("hash", "sha256"), "hash", HASH_ALGOS),
        }
        for name, section in _SECTIONS.items():
            sub = d.get(name) or {}
            kwargs[name] = section.from_dict(sub, name)
        explicit = {k for k in d if k not in _SECTIONS}
        explicit |= {f"{name}.{k}" for name in _SECTIONS for k in (d.get(name) or {})}
        if kwargs["remote"].enabled and kwargs["cpu"].capacity == 0:
            raise ConfigError("remote.url: the remote tier fetches blocks into CPU slots before they are "
                              "served; set cpu.capacity above 0")
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
        if self.spill.admission != "on_evict":
            del out["spill"]["watermark"]  # refused beside on_compute (see SpillConfig)
        return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a YAML config file (empty for an empty file); errors name the file and line.

    The file must be UTF-8 text of at most 1 MiB; the YAML is refused while it is read,
    before any value is used, when it nests too deeply or its aliases expand too far
    (see :func:`_load_yaml`).
    """
    import yaml

    p = Path(path)
    text = _read_text(p)
    try:
        data = _load_yaml(text)
    except _YAMLLimitError as e:
        raise ConfigError(f"{p}:{e.line}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}{where}: invalid YAML: {_clip(str(getattr(e, 'problem', e)))}") from None
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
    return dict(data or {})


def _read_text(p: Path) -> str:
    """The text of config file ``p``: at most 1 MiB of UTF-8."""
    from kvstrata.files import NotRegular, open_regular

    try:
        fd, _ = open_regular(p)  # a FIFO or a device is refused, never waited on
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except NotRegular:
        raise ConfigError(f"{p}: not a regular file; a config is a YAML file") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise ConfigError(f"{p}: larger than {format_size(_MAX_FILE_BYTES)}; not a config file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{p}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, bounded: refuses (:class:`_YAMLLimitError`, with the line)
    nesting deeper than 32 levels, more than 10,000 values once every alias is expanded
    and an alias inside its own anchor while the document is composed, before any value
    is built, and integers longer than 1,000 characters before they are converted."""
    import yaml

    return yaml.load(text, Loader=_bounded_loader())


class _YAMLLimitError(Exception):
    """YAML refused by the bounded loader; ``line`` is 1-based."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.line = mark.line + 1


@functools.lru_cache(maxsize=None)
def _bounded_loader() -> type:
    """The loader class of :func:`_load_yaml` (built on first use: PyYAML is imported lazily)."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        """``SafeLoader`` that counts the values of the document as it composes it, each
        alias as many times as its anchor holds values, and tracks the nesting depth."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.depth = 0
            self.total = 0
            self.weights: dict[int, int] = {}  # id of an anchored node -> values under it

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                target = self.anchors.get(event.anchor)
                if target is not None:
                    if id(target) not in self.weights:
                        raise _YAMLLimitError(f"YAML alias *{_clip(event.anchor)} inside its own anchor",
                                              event.start_mark)
                    self.count(self.weights[id(target)], event.start_mark)
                return super().compose_node(parent, index)
            if self.depth >= _MAX_YAML_DEPTH:
                raise _YAMLLimitError(f"YAML nested more than {_MAX_YAML_DEPTH} levels deep", event.start_mark)
            self.depth += 1
            before = self.total
            self.count(1, event.start_mark)
            node = super().compose_node(parent, index)
            self.depth -= 1
            if event.anchor is not None:
                self.weights[id(node)] = self.total - before
            return node

        def count(self, values: int, mark: Any) -> None:
            self.total += values
            if self.total > _MAX_YAML_VALUES:
                raise _YAMLLimitError(f"YAML holds more than {_MAX_YAML_VALUES:,} values with aliases expanded", mark)

        def construct_yaml_int(self, node: Any) -> int:
            if len(node.value) > _MAX_YAML_INT_CHARS:
                raise _YAMLLimitError(f"integer out of range ({len(node.value):,} characters)", node.start_mark)
            return super().construct_yaml_int(node)

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    return BoundedLoader


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
    YAML refused by :func:`_load_yaml` is a :class:`ConfigError` naming ``key``."""
    import yaml

    try:
        return _load_yaml(raw)
    except _YAMLLimitError as e:
        raise ConfigError(f"{_clip(key)}: {e}") from None
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
            raise ConfigError(f"{_short_key(key)}: malformed dotted key")
        node = out
        for i, part in enumerate(parts[:-1]):
            if i == 0:
                _check_keys({part: None}, _SECTIONS, "")
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, Mapping):
                raise ConfigError(f"{_clip('.'.join(parts[: i + 1]))}: is not a section")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return out
