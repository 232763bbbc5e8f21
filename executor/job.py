"""What a run builds from the plan and its config: the model (shaped as the plan's profile), the data, the device."""
from __future__ import annotations

import math
import os

import torch

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Plan

from .config import RunConfig
from .data import Dataset, SyntheticDataset, load_dataset


def build_for_plan(plan: Plan, cfg: RunConfig):
    """The model adapter ``cfg.model`` at the plan's granularity and sequence length."""
    from .models import build_model

    prof = plan.inputs.profile
    gran = prof.granularity
    seq = prof.seq_len
    dtype = getattr(torch, cfg.dtype)
    common = dict(granularity=gran, num_labels=cfg.num_labels, dtype=dtype, dropout=cfg.dropout,
                  weights=cfg.weights, seed=cfg.seed)
    if cfg.model.startswith("vit"):
        model = build_model(cfg.model, image_size=cfg.image_size, **common)
        if cfg.image_size is None and isinstance(seq, int) and seq != model.seq_len and seq > 1:
            side = math.isqrt(seq - 1)
            if side * side == seq - 1:
                model = build_model(cfg.model, image_size=side * model.config.patch_size, **common)
        return model
    return build_model(cfg.model, seq_len=seq, **common)


def samples_needed(plan: Plan, cfg: RunConfig) -> int:
    """Samples per epoch: steps_per_epoch × the largest global batch, else the plan's samples per epoch."""
    biggest = max(ph.global_batch for ph in plan.phases)
    if cfg.steps_per_epoch:
        return cfg.steps_per_epoch * biggest
    n = plan.inputs.training.samples_per_epoch
    if n < biggest:
        raise PtplanError(f"the plan gives no usable samples_per_epoch ({n!r}); pass --steps-per-epoch")
    return n


def make_dataset(plan: Plan, cfg: RunConfig, model) -> Dataset:
    """``--data synthetic`` (deterministic per sample id) or a .pt/.npz file."""
    if cfg.data == "synthetic":
        return SyntheticDataset(model, samples_needed(plan, cfg), seed=cfg.seed)
    return load_dataset(cfg.data)


def pick_device(cfg: RunConfig) -> tuple[torch.device, str]:
    """(device, backend): CUDA device LOCAL_RANK with NCCL when asked or available, else CPU with gloo."""
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise PtplanError("--device cuda but this torch build or machine has no CUDA device")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise PtplanError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices are visible; "
                              f"use --nproc-per-node {torch.cuda.device_count()} or fewer")
        return torch.device("cuda", local), "nccl"
    return torch.device("cpu"), "gloo"
