"""Optimizers shared by the workloads: AdamW with its schedule, Muon."""
