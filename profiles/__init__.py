"""Shipped, measured profile files (data). See README.md in this folder."""
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent


def shipped(name: str) -> Path:
    """Path of a shipped profile by file stem, e.g. ``shipped("vit-base_cpu_fp32")``."""
    return PROFILE_DIR / f"{name}.json"
