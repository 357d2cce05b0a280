"""The tiered store: shards paged among device memory, pinned host RAM and NVMe, within byte budgets.
Knows nothing about modules or optimizers."""
