"""The driver core: the step protocol every driver follows, load-or-recompute costs, cache metrics.
May import: errors, system, identity, config, policy, kernels, tiers, trace, pool, dataplane.

What every driver (the library's :class:`~kvstrata.library.tiered.TieredKVCache`,
the vLLM connector's scheduler half, the ``kvstrata bench`` replay) does the same way.

* :mod:`.hits`: which tier served each block of a request, and the per-request counts.
"""
