"""Training: distributed init, DeepSpeed engine, checkpoints, schedule, logging, one module per task."""
