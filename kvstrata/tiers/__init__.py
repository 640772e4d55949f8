"""Storage tiers below the GPU pool: the host slab, the SSD tier (:mod:`.ssd`), the remote tier (:mod:`.remote`).
May import: errors, system, identity, config, policy."""
