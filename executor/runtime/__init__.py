"""The elastic runtime: one rank's stages, schedules, sharding, transitions and optimizer."""
