"""The engine-neutral adapter kit: shared-tier lookups, page stores, transfer timing, paged-KV layouts.
May import every room below the connectors; never an engine's package, never connectors.vllm."""
