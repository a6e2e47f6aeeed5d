"""The lm's parallelism beyond the sharding table: context (ring) and pipeline parallelism."""
