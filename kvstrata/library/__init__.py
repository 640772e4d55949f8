"""The library driver: TieredKVCache, kvstrata's own paged device pool over the driver core.
May import every room below the engine (core, dataplane, pool, tiers, policy, config, ...)."""
