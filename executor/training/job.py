"""What a run builds from the plan and its config: the model (shaped as the plan's profile; on each rank only its
stage's weights), the data, the device."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Iterable

import torch

from ptplan.planner.errors import PtplanError
from ptplan.planner.families import family_facts
from ptplan.planner.plan import Plan, load_plan

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import Dataset, SyntheticDataset, TensorDataset, load_dataset


def _profile_file(plan: Plan, plan_path: str | None) -> Path | None:
    """The plan's profile file when it can be found: its recorded path as is, or relative to the plan."""
    ref = plan.inputs.profile.path
    if not ref:
        return None
    p = Path(ref)
    cands = [p] if p.is_absolute() else [p] + ([Path(plan_path).parent / p] if plan_path else [])
    return next((c for c in cands if c.is_file()), None)


def plan_num_labels(plan: Plan, model: str, plan_path: str | None = None) -> int | None:
    """The classifier size the plan's profile was measured with, so the run builds the same head.

    From the profile file the plan names (``profile_num_labels``), when it is found and is of the
    plan's model; else the family's usual head (bert 2, vit 1000; ``head_num_labels``). None for
    GPT-2 (an LM head). A head of another size fails the fingerprint check before launching.
    """
    from ptplan.planner.profile import load_profile

    from ptplan.executor.profiling.profiler import head_num_labels, profile_num_labels

    default = head_num_labels(model, None)
    path = _profile_file(plan, plan_path)
    if default is None or path is None:
        return default
    try:
        prof = load_profile(path)
    except PtplanError:
        return default
    if prof.fingerprint() != plan.inputs.profile.fingerprint:
        return default
    return profile_num_labels(prof) or default


def with_plan_num_labels(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``num_labels`` fixed (the plan's profile's when not given), so every worker builds the
    same head without looking for the profile file; an explicit value is checked against the model."""
    from ptplan.executor.profiling.profiler import head_num_labels

    if cfg.num_labels is not None:
        head_num_labels(cfg.model, cfg.num_labels)  # refuses labels for GPT-2
        return cfg
    return dataclasses.replace(cfg, num_labels=plan_num_labels(load_plan(cfg.plan), cfg.model, cfg.plan))


def build_for_plan(plan: Plan, cfg: RunConfig, layers: Iterable[int] | None = None):
    """The model adapter ``cfg.model`` at the plan's granularity and sequence length, with the classifier
    size ``cfg.num_labels`` (None: the plan's profile's, see ``plan_num_labels``). ``layers``: build only
    these layers' weights (a rank's stage: ``training.stage_layers``; the rest stays on the meta device);
    None: every layer."""
    from ptplan.executor.families import build_model
    from ptplan.executor.profiling.profiler import head_num_labels, model_family

    prof = plan.inputs.profile
    gran = prof.granularity
    seq = prof.seq_len
    dtype = getattr(torch, cfg.dtype)
    labels = (head_num_labels(cfg.model, cfg.num_labels) if cfg.num_labels is not None
              else plan_num_labels(plan, cfg.model, cfg.plan))
    common = dict(granularity=gran, dtype=dtype, dropout=cfg.dropout, weights=cfg.weights, seed=cfg.seed, layers=layers,
                  **({} if labels is None else {"num_labels": labels}))
    if getattr(family_facts(model_family(cfg.model) or ""), "pixels", False):  # an image model (preset or folder)
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


def epoch_samples(plan: Plan, cfg: RunConfig, available: int) -> int:
    """The samples an epoch trains from a data file of ``available``: the plan's samples per epoch where the file
    holds more (its epochs, steps and AutoCache rows are what the plan priced), else the file's; with
    ``--steps-per-epoch`` the whole file (the steps set the epoch)."""
    n = plan.inputs.training.samples_per_epoch
    if cfg.steps_per_epoch or n < max(ph.global_batch for ph in plan.phases):
        return available
    return min(available, n)


def epoch_samples_note(plan: Plan, cfg: RunConfig, available: int, what: str) -> str | None:
    """What ``epoch_samples`` does to a data file whose length is not the plan's, in words (None when it is)."""
    n, used = plan.inputs.training.samples_per_epoch, epoch_samples(plan, cfg, available)
    if used < available:
        return (f"{what} has {available:,} samples and the plan priced {n:,} per epoch: each epoch trains the first "
                f"{used:,} (the plan's epoch length and AutoCache rows); make the plan with `ptplan plan ... --data` "
                f"to train on all of them")
    if not cfg.steps_per_epoch and available < n:
        return (f"{what} has {available:,} samples and the plan priced {n:,} per epoch: epochs are shorter than "
                f"planned (the plan's times per epoch and its AutoCache memory are upper bounds)")
    return None


def file_dataset(plan: Plan, cfg: RunConfig) -> TensorDataset:
    """The ``--data`` file's samples the run trains on: its first ``epoch_samples``."""
    ds = load_dataset(cfg.data)
    n = epoch_samples(plan, cfg, len(ds))
    if n == len(ds):
        return ds
    return TensorDataset(ds.inputs[:n], ds.labels[:n], None if ds.attention_mask is None else ds.attention_mask[:n])


def make_dataset(plan: Plan, cfg: RunConfig, model) -> Dataset:
    """``--data synthetic`` (deterministic per sample id) or a .pt/.npz file (``file_dataset``)."""
    if cfg.data == "synthetic":
        return SyntheticDataset(model, samples_needed(plan, cfg), seed=cfg.seed)
    return file_dataset(plan, cfg)


def pick_device(cfg: RunConfig) -> tuple[torch.device, str]:
    """(device, backend): CUDA device LOCAL_RANK with NCCL when asked or available, else CPU with gloo."""
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        check_cuda(local + 1, f"LOCAL_RANK {local}")
        return torch.device("cuda", local), "nccl"
    return torch.device("cpu"), "gloo"


def check_cuda(processes: int, who: str) -> None:
    """PtplanError unless this machine gives ``processes`` processes a CUDA device each (``who`` names them): the
    worker's check (``pick_device``) and the launcher's before any process starts (``ptplan run --device cuda``)."""
    if not torch.cuda.is_available():
        raise PtplanError("--device cuda but this torch build or machine has no CUDA device; run with --device cpu "
                          "(or auto)")
    if processes > torch.cuda.device_count():
        raise PtplanError(f"{who} needs {processes} CUDA devices but only {torch.cuda.device_count()} are visible; "
                          f"use --nproc-per-node {torch.cuda.device_count()} or fewer")
