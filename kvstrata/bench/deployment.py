"""The deployment ``kvstrata bench`` replays when no ``--config`` is given.

An 8B model (Llama-3-8B's KV layout, fp16: 128 KiB per token) served by vLLM on
one 48 GB card: 22 GiB of KV pool (about 180K tokens, enough for long-context
requests), a 64 GiB DRAM tier and a 1 TiB SSD tier, with the library's
default placement rules. ``--set`` overrides any of it (``--set
gpu.num_blocks`` replaces the pool's capacity).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from kvstrata.config.schema import KVStrataConfig

__all__ = ["DEFAULT_DEPLOYMENT", "default_config", "recorded_config", "recorded_deployment", "recorded_load"]

DEFAULT_DEPLOYMENT: dict[str, Any] = {
    "model": {"name": "llama-3-8b", "layers": 32, "kv_heads": 8, "head_size": 128, "kv_dtype": "fp16"},
    "gpu": {"capacity": "22GiB"}, "cpu": {"capacity": "64GiB"}, "ssd": {"capacity": "1TiB"},
}


def default_config(overrides: Iterable[str] = ()) -> KVStrataConfig:
    """The default deployment with ``--set`` style overrides applied."""
    overrides = list(overrides)
    base = {k: dict(v) for k, v in DEFAULT_DEPLOYMENT.items()}
    if any(isinstance(o, str) and o.split("=", 1)[0].strip() == "gpu.num_blocks" for o in overrides):
        base["gpu"].pop("capacity")  # one pool size: num_blocks and capacity are exclusive
    return KVStrataConfig.from_dict(base, overrides)


# What a recording's header says of the deployment that served it (``deployment``), and
# the config a replay of the recording starts from. Left out: where things are (paths,
# the remote server's URL, which may hold a password), the metrics endpoint and the
# recorder itself.
_NOT_RECORDED = {"ssd": ("path",), "remote": ("url", "cluster", "secret_file", "password_file"), "metrics": None,
                 "trace": None}


def recorded_deployment(cfg: KVStrataConfig, *, block_size: int, block_nbytes: int, gpu_blocks: int,
                        capacity_blocks: dict[str, int], engine: dict[str, Any],
                        max_num_batched_tokens: int | None = None) -> dict[str, Any]:
    """The ``deployment`` of a recording's header: ``cfg`` as it ran (the engine's block
    size, a block's bytes, the GPU blocks the engine sized and its tokens per step), the
    blocks each tier held, and what served it (``engine``: names and versions, for the reader)."""
    d = cfg.to_dict()
    for section, keys in _NOT_RECORDED.items():
        if keys is None:
            d.pop(section, None)
        else:
            for key in keys:
                d[section].pop(key, None)
    d["block_size"] = block_size
    d["model"]["block_nbytes"] = block_nbytes
    d["gpu"] = {"num_blocks": gpu_blocks, **({"max_num_batched_tokens": max_num_batched_tokens}
                                             if max_num_batched_tokens else {})}
    return {"config": d, "capacity_blocks": dict(capacity_blocks), "engine": engine}


def recorded_config(deployment: dict[str, Any], overrides: Iterable[str] = (),
                    measured: dict[str, Any] | None = None) -> KVStrataConfig:
    """The config a recording's deployment ran, with ``--set`` style overrides applied.
    ``measured``: what the plugin measured over the recording; the costs it estimated fill
    the ``load.*`` figures the deployment did not fix (:func:`recorded_load`); a tier whose
    bandwidth it fixed keeps the latency it fixed with it (0 when none), as the plugin did."""
    from kvstrata.errors import ConfigError

    base = deployment.get("config") if isinstance(deployment, dict) else None
    if not isinstance(base, dict):
        raise ConfigError("trace: the recording's header holds no deployment to replay; give --config")
    engine = deployment.get("engine")
    groups = engine.get("groups") if isinstance(engine, dict) else None
    overrides = list(overrides)
    base = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    if groups and isinstance(base.get("model", {}), dict):  # a hybrid model: its KV-cache groups, as the engine had them
        base["model"] = {**base.get("model", {}), "groups": groups,
                         "retention_interval": engine.get("retention_interval", 0)}
    if isinstance(base.get("load", {}), dict):
        fixed = base.get("load", {})
        base["load"] = {**fixed, **{k: v for k, v in recorded_load(measured).items() if fixed.get(k) is None
                                    and fixed.get(k.replace("_latency", "_bandwidth")) is None}}
    keys = {o.split("=", 1)[0].strip() for o in overrides if isinstance(o, str)}
    for section in {k.split(".", 1)[0] for k in keys if "." in k} & base.keys():
        if base[section] is not None and not isinstance(base[section], dict):  # --set cannot reach into it
            raise ConfigError(f"trace: the recorded deployment: {section}: expected a mapping, "
                              f"got {type(base[section]).__name__}")
    if "gpu.capacity" in keys and isinstance(base.get("gpu"), dict):
        base["gpu"].pop("num_blocks", None)  # one pool size: num_blocks and capacity are exclusive
    try:  # --set applies first: it can fix what the recording holds
        return KVStrataConfig.from_dict(base, overrides)
    except ConfigError as exc:
        if _names_override(str(exc), keys):
            raise
        raise ConfigError(f"trace: the recorded deployment: {exc}") from None


def _names_override(message: str, keys: set[str]) -> bool:
    """Is a config error about a value ``--set`` gave (its key or a key under it), not the recording's?"""
    head = message.split(":", 1)[0].strip()
    return head.startswith("override ") or any(head == k or head.startswith(k + ".") for k in keys)


def recorded_load(measured: dict[str, Any] | None) -> dict[str, float]:
    """The ``load.*`` figures the plugin estimated over a recording (``measured["load"]``,
    as :meth:`~kvstrata.core.costs.LoadCosts.estimates` gives them): each tier's bandwidth
    from its seconds per block and its latency per load, the compute rates from the seconds
    per token and per token pair attended. A figure that is not a positive, finite number
    (absent, forged), and a bandwidth outside 1 byte to 1 EiB a second, is left out, so the
    replay then decides as if it had not been measured."""
    load = measured.get("load") if isinstance(measured, dict) else None
    nbytes = measured.get("block_nbytes") if isinstance(measured, dict) else None
    if not isinstance(load, dict) or not _positive(nbytes):
        return {}
    out: dict[str, float] = {}
    per_block, per_load = load.get("block_seconds"), load.get("latency_seconds")
    for tier in ("cpu", "ssd", "remote"):
        seconds = per_block.get(tier) if isinstance(per_block, dict) else None
        bandwidth = nbytes / seconds if _positive(seconds) else 0.0
        if 1 <= bandwidth < 2**60:  # a whole number of bytes per second: never rounded down to 0
            out[f"{tier}_bandwidth"] = round(bandwidth)
            latency = per_load.get(tier) if isinstance(per_load, dict) else None
            if _positive(latency) and latency <= 60:
                out[f"{tier}_latency"] = float(latency)
    for key, rate in (("token_seconds", "prefill_rate"), ("attended_seconds", "attention_rate")):
        seconds = load.get(key)
        if _positive(seconds) and _positive(1.0 / seconds) and (rate == "prefill_rate" or "prefill_rate" in out):
            out[rate] = 1.0 / seconds
    return out


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
