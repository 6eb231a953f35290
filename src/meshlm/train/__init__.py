"""Training: the step, the optimizer, the data pipeline and the loop."""
