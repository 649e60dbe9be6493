"""The training loop, learning-rate schedule, metrics and checkpoints."""
