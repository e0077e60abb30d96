"""Dynamic-embedding engine: tables, packed rows, sparse optimizers, admission,
eviction, delta export, fusion planner, PS sharding."""
