"""Block identity: hash chains, KV-cache groups, fingerprints, namespaces and format versions.
May import: errors, system."""
