"""The training job: configuration, the loop, checkpoints, evaluation, export and the run log."""
