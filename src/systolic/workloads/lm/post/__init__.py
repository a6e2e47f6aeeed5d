"""Post-training of lm runs: preference optimisation (DPO) and RL with verifiable rewards (GRPO)."""
