"""The data plane: the executor that applies plans to bytes, the asynchronous copier, device<->host transfer.
May import: errors, system, identity, config, policy, kernels, tiers, trace."""
