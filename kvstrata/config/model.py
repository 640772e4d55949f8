"""``model.*``: the model's identity, KV layout and KV-cache groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvstrata.identity.groups import parse_groups
from kvstrata.errors import ConfigError
from kvstrata.system.values import check_keys, integer, one_of, parse_size, short_repr

__all__ = ["KV_DTYPE_BYTES", "ModelConfig"]

KV_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2,
                  "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


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

    ``groups``: the KV-cache groups of a hybrid model, in the engine's order
    (:func:`~kvstrata.identity.groups.parse_groups`; ``"full,sliding:1024"``,
    ``"full,state"``), as ``kvstrata bench`` replays them; "" for one
    full-attention group. With vLLM the connector reads them from the engine
    instead.

    ``retention_interval``: vLLM's ``prefix_cache_retention_interval``, which
    window blocks and states a hybrid's prefix cache and the tiers below keep
    (:meth:`~kvstrata.identity.groups.KVGroups.stored`,
    :meth:`~kvstrata.identity.groups.KVGroups.state_cached`): 0 (vLLM's default)
    those before each prompt's end and shared-prefix junctions, ``N`` tokens
    also before every ``N``-token boundary, ``dense`` (or null) all of them.
    With vLLM the connector reads it from the engine.
    """

    name: str = "default"
    id: str | None = None
    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    kv_dtype: str = "fp16"
    block_nbytes: int | None = None
    groups: str = ""
    retention_interval: int | None = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "model") -> "ModelConfig":
        check_keys(d, ("name", "id", "layers", "kv_heads", "head_size", "kv_dtype", "block_nbytes", "groups",
                       "retention_interval"), p)
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
            layers=integer(d.get("layers", cls.layers), f"{p}.layers", minimum=1),
            kv_heads=integer(d.get("kv_heads", cls.kv_heads), f"{p}.kv_heads", minimum=1),
            head_size=integer(d.get("head_size", cls.head_size), f"{p}.head_size", minimum=1),
            kv_dtype=one_of(d.get("kv_dtype", cls.kv_dtype), f"{p}.kv_dtype", KV_DTYPE_BYTES),
            block_nbytes=_block_nbytes(bn, f"{p}.block_nbytes") if bn is not None else None,
            groups=_groups(d.get("groups"), f"{p}.groups"),
            retention_interval=_retention(d, f"{p}.retention_interval"),
        )

    @property
    def num_groups(self) -> int:
        """The KV-cache groups (1 for one full-attention group)."""
        return len(self.groups.split(",")) if self.groups else 1

    def bytes_per_token(self) -> int:
        """Of one block row: with ``groups``, vLLM's hybrid allocator gives each group the same
        number of layers (padding the last), and a row holds one group's layers."""
        layers = -(-self.layers // self.num_groups)
        return 2 * layers * self.kv_heads * self.head_size * KV_DTYPE_BYTES[self.kv_dtype]


def _block_nbytes(value: Any, path: str) -> int:
    nbytes = parse_size(value, path)
    if nbytes < 1:
        raise ConfigError(f"{path}: expected a positive size, got {short_repr(value)}")
    return nbytes


def _retention(d: Mapping[str, Any], path: str) -> int | None:
    if "retention_interval" not in d:
        return 0
    value = d["retention_interval"]
    if value is None or value == "dense":
        return None
    return integer(value, path, minimum=0)


def _groups(value: Any, path: str) -> str:
    try:
        groups = parse_groups(value, path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return "" if groups == parse_groups(None, path) else ",".join(g.describe() for g in groups)
