"""The `gan` workload: DCGAN generator and discriminator, two optimizers in one train state, a classifier-based
Fréchet distance for evaluation."""
