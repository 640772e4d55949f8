"""The replay driver and what ``kvstrata bench`` and ``plan`` report: workloads, the replay, comparisons, sizing.
May import every room below the engine; never the connectors or the command line."""
