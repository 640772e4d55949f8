"""kvstrata as SGLang's HiCache storage backend: the backend, its extra config, the host pool's pages, hybrid pools.
May import every room but the command line (the engine-neutral kit included).

SGLang loads it as a dynamic backend::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \
        --enable-hierarchical-cache --hicache-storage-backend dynamic \
        --hicache-storage-backend-extra-config '{"backend_name": "kvstrata",
            "module_path": "kvstrata.connectors.sglang", "class_name": "KVStrataStorage",
            "interface_v1": 1, "ssd.path": "/data/kvstrata-sglang", "ssd.capacity": "200GiB"}'

Only :mod:`.backend` imports SGLang; importing this package does not (``KVStrataStorage`` is
loaded on first use, as SGLang's factory asks for it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStrataStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVStrataStorage":
        from kvstrata.connectors.sglang.backend import KVStrataStorage

        return KVStrataStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
