"""The engine-neutral adapter kit: ranks and their SSD tiers, remote lookups, transfer timing, paged-KV layouts.
May import every room below the connectors; never an engine's package, never connectors.vllm."""
