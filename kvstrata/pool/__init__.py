"""kvstrata's own device block pool: rows, the free queue, the plain and the grouped (hybrid) block managers.
May import: errors, system, identity, config, policy."""
