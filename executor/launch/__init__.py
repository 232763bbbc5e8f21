"""Launching a run: torchrun command lines, the job folder, the worker entry point."""
