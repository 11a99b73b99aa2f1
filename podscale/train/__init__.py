"""Training: the engine, the loop, data loading, checkpoints, mixed precision and reports."""
