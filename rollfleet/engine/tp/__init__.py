"""The tp ranks of one engine, the engine's lowest layer: rank 0's actions run on every rank
(lockstep), every rank agrees or none applies (ranks), a parameter's shard on one rank (shards), and
the per-rank entries of tensor payloads (payloads)."""
