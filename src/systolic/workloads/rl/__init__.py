"""The `rl` workload: PPO on JAX environments (gymnax), many environments and seeds in one compiled program."""
