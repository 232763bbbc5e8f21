"""Checkpoint files: the full model, optimizer state by parameter name, position and RNG; written atomically.

Only rank 0 reads and writes them (it gathers the model first and scatters it on resume), so a
multi-node job needs the checkpoint folder on rank 0's node only. Contents (``torch.save`` of a dict)::

    version, plan_fingerprint, model_name, optimizer, world_size,
    model        {parameter name: tensor}            (canonical names: layers.<i>.<...>)
    optim        {parameter name: {state key: tensor}}  (active parameters only)
    position     {epoch, step_in_epoch, cursor, global_step, frozen_blocks, decided_T, norm_sum, norm_count}
    rng          [per-rank torch RNG states]
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ptplan.planner.errors import PtplanError

VERSION = 1
NAME = "checkpoint.pt"


def checkpoint_path(folder: str | os.PathLike) -> str:
    return os.path.join(os.fspath(folder), NAME)


def save_checkpoint(folder: str | os.PathLike, payload: dict[str, Any]) -> str:
    """Write ``payload`` to ``folder/checkpoint.pt`` atomically (temp file, fsync, rename)."""
    os.makedirs(folder, exist_ok=True)
    path = checkpoint_path(folder)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save({"version": VERSION, **payload}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(folder: str | os.PathLike) -> dict[str, Any]:
    """Read ``folder/checkpoint.pt``; a clear error when it is missing or of another version."""
    path = checkpoint_path(folder)
    if not os.path.exists(path):
        raise PtplanError(f"--resume: no checkpoint at {path}; run without --resume to start from scratch")
    data = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise PtplanError(f"{path} is not a ptplan checkpoint of version {VERSION}")
    return data
