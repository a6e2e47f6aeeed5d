"""Planning: will a run fit a TPU slice or GPUs, how fast, at what cost (`systolic plan`)."""
