"""Profiles: measured on a device, projected from counted operations, token-slice costs."""
