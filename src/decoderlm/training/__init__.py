"""Training: the loop, run resolution, TrainConfig, the optimizer, reporting, runtime and distribution."""
