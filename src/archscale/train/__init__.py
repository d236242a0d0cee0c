"""Training: config, optimizer, schedule, checkpoints, metrics and the loop."""
