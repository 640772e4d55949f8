"""Storage tiers below the GPU pool: the host slab and the SSD tier (:mod:`kvstrata.tiers.ssd`)."""
