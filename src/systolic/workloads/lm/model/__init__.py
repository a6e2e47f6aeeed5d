"""The lm's model: the transformer, its attention, rope, MoE, LoRA, parametrization, CPU kernels, FLOP and size formulas."""
