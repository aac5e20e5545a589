"""Experiment trackers (MLflow, W&B, TensorBoard): plugins in the entry-point group autoloop.trackers."""
