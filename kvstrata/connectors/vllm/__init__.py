"""kvstrata as a vLLM (v1) KV connector: the connector, its scheduler and worker halves, metrics, events.
May import every room but the command line (the engine-neutral kit included).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStrataConnector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": "configs/vllm.yaml"}}'

(``"kv_connector_module_path": "kvstrata.connectors.vllm"`` is optional: the
``vllm.general_plugins`` entry point calls :func:`register`.)
``kv_connector_extra_config`` takes an optional YAML file under ``"config"``
and dotted overrides of its keys (``"cpu.capacity": "16GiB"``,
``"ssd.path": "/data/kvstrata"``); an unknown key stops start-up with a
:class:`kvstrata.ConfigError` naming it. vLLM's block size wins over the
config's ``block_size``. Use ``"kv_load_failure_policy": "recompute"`` so that
a block the tiers cannot deliver (evicted, corrupt) is recomputed instead of
failing the request.

The class is glue: :class:`KVStrataScheduler` (engine-core process) keeps the
index and :class:`KVStrataWorker` (each worker process) moves the bytes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

__all__ = ["KVStrataConnector", "register", "CONNECTOR_NAME"]

CONNECTOR_NAME = "KVStrataConnector"

log = logging.getLogger(__name__)


def register() -> None:
    """Register ``KVStrataConnector`` with vLLM's connector factory (idempotent).

    Called by vLLM through the ``vllm.general_plugins`` entry point.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, CONNECTOR_NAME)


def __getattr__(name: str) -> Any:
    # The connector class imports vLLM and torch; build it only when asked for,
    # so that the plugin entry point stays cheap.
    if name == CONNECTOR_NAME:
        from kvstrata.connectors.vllm.connector import KVStrataConnector

        globals()[name] = KVStrataConnector
        return KVStrataConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from kvstrata.connectors.vllm.connector import KVStrataConnector as KVStrataConnector  # noqa: F401
