"""SGLang's host pool as kvstrata blocks: which bytes are a page, and what identifies them.

A kvstrata block is one page of SGLang's host pool, every layer's K and V, in the order of
the pool's flat data page (``get_data_page(index, flat=True)``), so that the zero-copy path
(``batch_*_v1``, straight between the pool and the tiers) and the generic one (``get`` /
``set`` on flat pages) store the same bytes under the same key:

* ``layer_first`` (``[2, layers, tokens, heads, dim]``): one run per K or V and layer;
* ``page_first`` (``[2, tokens, layers, heads, dim]``) and ``page_first_direct``
  (``[2, pages, layers, page, heads, dim]``): one run for K and one for V.

The runs are read through :class:`~kvstrata.connectors.kit.kv_layout.KVLayout` (block axis:
the page). Other layouts (``page_head``, ``page_unified``, ...) and other pools (MLA, the
asymmetric and sparse MHA pools) are refused at registration, naming what is served.

The fingerprint (:func:`sglang_fingerprint`) covers the model, the page size, the KV dtype,
the geometry, the layout, whether the model is MLA and the ranks: pages written under
another of any of these are never read. Its layout is SGLang's name for it, so an SGLang
tier never shares a namespace with a vLLM tier (whose layouts are named ``LBHNC``...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstrata.connectors.kit.kv_layout import KVLayout
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint, model_identity

if TYPE_CHECKING:
    from kvstrata.config.schema import KVStrataConfig

__all__ = ["LAYOUTS", "PoolPages", "host_pages", "page_ids", "sglang_fingerprint", "model_of", "check_parallel"]

#: The host pool layouts kvstrata serves.
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PoolPages:
    """One registered host pool's pages: their runs (``layout``) and geometry."""

    layout: KVLayout
    layout_name: str
    page_size: int
    page_num: int
    block_nbytes: int
    dtype: str
    layers: int
    heads: int
    head_dim: int
    format_tag: str


def _views(kv: Any, layout: str, page_num: int, page_size: int) -> dict[str, Any]:
    """Per run, a view of the pool whose dimension 0 is the page."""
    if layout == "layer_first":
        return {f"{'kv'[c]}{layer}": kv[c, layer].view(page_num, page_size, *kv.shape[3:])
                for c in range(2) for layer in range(kv.shape[1])}
    if layout == "page_first":
        return {"k": kv[0].view(page_num, page_size, *kv.shape[2:]), "v": kv[1].view(page_num, page_size, *kv.shape[2:])}
    return {"k": kv[0], "v": kv[1]}  # page_first_direct: [2, pages, layers, page, heads, dim]


def host_pages(host: Any) -> PoolPages:
    """The pages of SGLang's host pool ``host``; :class:`ConfigError` naming the pool's class
    or layout and what is served when kvstrata cannot serve it."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    if type(host) is not MHATokenToKVPoolHost:
        raise ConfigError(f"host pool: kvstrata serves SGLang's MHATokenToKVPoolHost (MHA models); got "
                          f"{type(host).__name__}")
    layout = getattr(host, "layout", None)
    if layout not in LAYOUTS:
        raise ConfigError(f"host pool layout {layout!r} (--hicache-mem-layout): kvstrata serves "
                          f"{', '.join(LAYOUTS)}")
    if getattr(host, "dcp_size", 1) != 1 or host.v_head_dim != host.head_dim:
        raise ConfigError("host pool: kvstrata serves pools without decode context parallelism whose K and V "
                          "heads are equally wide")
    views = _views(host.kv_buffer, layout, host.page_num, host.page_size)
    kv_layout = KVLayout(views, host.page_num)
    flat = host.get_dummy_flat_data_page()
    if kv_layout.block_nbytes != flat.numel() * flat.element_size():
        raise ConfigError(f"host pool: a page is {kv_layout.block_nbytes} bytes in the pool but "
                          f"{flat.numel() * flat.element_size()} as a flat page: not a layout kvstrata knows")
    return PoolPages(kv_layout, layout, host.page_size, host.page_num, kv_layout.block_nbytes,
                     str(host.dtype).removeprefix("torch."), host.layer_num, host.head_num, host.head_dim,
                     str(host.storage_format_tag or ""))


def page_ids(host_indices: Any, pages: int, page_size: int, page_num: int) -> list[int] | None:
    """The pool pages of a ``host_indices`` batch for ``pages`` keys: whole pages, each
    ``page_size`` consecutive indices from a page boundary, inside the pool; None otherwise."""
    try:
        idx = np.asarray(host_indices.detach().cpu().numpy() if hasattr(host_indices, "detach") else host_indices)
    except (TypeError, ValueError, RuntimeError):
        return None
    if idx.ndim != 1 or idx.dtype.kind not in "iu" or idx.size != pages * page_size:
        return None
    if not pages:
        return []
    rows = idx.reshape(pages, page_size).astype(np.int64)
    first = rows[:, 0]
    if ((first % page_size) != 0).any() or (rows != first[:, None] + np.arange(page_size)).any():
        return None
    ids = first // page_size
    if (ids < 0).any() or (ids >= page_num).any():
        return None
    return ids.tolist()


def model_of(config: "KVStrataConfig", model_name: str | None) -> str:
    """The model's identity: ``model.id`` when set, else the checkpoint SGLang serves,
    identified by its weights (:func:`model_identity`: a :class:`ConfigError` naming
    ``model.id`` when they cannot be read)."""
    if config.model.id:
        return f"id:{config.model.id}"
    if not model_name:
        raise ConfigError("model.id: SGLang names no model for storage: set model.id")
    return model_identity(model_name)


def sglang_fingerprint(model: str, pages: PoolPages, storage_config: Any) -> Fingerprint:
    """What SGLang pages stored by this rank are compatible with (see the module docstring)."""
    sc = storage_config
    variant = [f"sglang:mla={int(bool(sc.is_mla_model))}"]
    if getattr(sc, "attn_cp_size", 1) > 1:  # each rank holds a slice of every page
        variant.append(f"cp={sc.attn_cp_rank}/{sc.attn_cp_size}")
    if pages.format_tag:
        variant.append(f"format={pages.format_tag}")
    return Fingerprint(model=model, dtype=pages.dtype, kv_dtype=pages.dtype, block_size=pages.page_size,
                       block_nbytes=pages.block_nbytes, layers=pages.layers, kv_heads=pages.heads,
                       head_size=pages.head_dim, hash="sha256", tp_size=sc.tp_size, pp_size=sc.pp_size,
                       variant="|".join(variant), kv_layout=f"sglang:{pages.layout_name}")


def check_parallel(storage_config: Any) -> None:
    """Ranks kvstrata keys apart; decode context parallelism (MLA only) is not served."""
    if getattr(storage_config, "dcp_size", 1) > 1:
        raise ConfigError("hicache storage: kvstrata does not serve decode context parallelism (dcp_size > 1)")

