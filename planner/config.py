"""What the user trains and how the planner may search: one keyword-only record, checked on construction.

Legend: K pipeline length, M micro-batches per pipeline per iteration, b micro-batch size, B global
batch, D data-parallel width.

Batch policies:

- ``constant-global`` (default): B stays fixed as D changes, so optimisation matches the baseline;
  each pipeline gets B / D samples, split into M micro-batches of b = B / (D * M). Both must divide.
- ``constant-pipeline`` (the paper's): each pipeline keeps its batch P, so B = D * P grows as
  freezing frees GPUs; b = P / M must divide.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from .errors import PtplanError
from .jsonio import Fields

BATCH_POLICIES = ("constant-global", "constant-pipeline")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "looped-bfs", "zb-v", "2bw")
"""Schedules a phase may run (``planner/schedule.py`` generates each as data). "2bw" (PipeDream-2BW) is
asked for by name only: it changes the optimisation (one-step-stale gradients), so ``auto``, which
picks among schedules that compute the same update, never picks it."""
SCHEDULE_CHOICES = ("auto", *SCHEDULES)
"""What a user may ask for: one schedule, or ``auto`` (the search picks per phase among AUTO_SCHEDULES)."""
AUTO_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1")
"""The schedules ``auto`` searches (zero-bubble ones only with a profile that measured the weight-gradient
part of the backward)."""
INTERLEAVED_V = (2, 4)
"""Chunks per position the search tries for interleaved schedules."""
OPTIMIZERS = ("adamw", "sgd")
CACHE_MODES = ("off", "on", "auto")

MAX_EPOCHS = 100_000
"""A plan stores a trajectory point per epoch; more epochs than this is a typo, not a plan."""
MAX_SAMPLES_PER_EPOCH = 10**13
"""Ten trillion samples per epoch; beyond that seconds and counts lose meaning."""
MAX_BATCH = 10**9
MAX_HOST_BANDWIDTH = 1e15
"""Bytes/s; a petabyte per second bounds any host link."""


def _int_in(name: str, v: Any, lo: int, hi: int, fix: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise PtplanError(f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise PtplanError(f"{name} is {v:,}; it must lie in {lo:,}..{hi:,}. {fix}")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """What the user trains (epochs, data, batch, schedule, optimizer) and the planner's knobs."""

    epochs: int
    """Number of epochs."""
    samples_per_epoch: int
    """Training samples per epoch (the last partial global batch of an epoch is dropped)."""
    batch: int
    """Global batch B under ``constant-global``; per-pipeline batch under ``constant-pipeline``."""
    batch_policy: str = "constant-global"
    """``constant-global`` (same optimisation as the baseline) or ``constant-pipeline`` (the paper's)."""
    schedule: str = "1f1b"
    """Pipeline schedule (``SCHEDULES``), or ``auto``: the search picks one per phase among
    ``AUTO_SCHEDULES`` (and V for interleaved ones) together with K and M."""
    optimizer: str = "adamw"
    """``adamw`` (two moments per parameter) or ``sgd`` (one momentum buffer); sets the optimizer-state
    bytes of the stage memory model (torch keeps the state in the parameters' dtype)."""
    pin_K: int | None = None
    """Use this pipeline length in every phase where it fits; phases where it cannot (fewer active
    layers than K, or no split fits in memory) choose freely and say so."""
    pin_M: int | None = None
    """Use this micro-batch count in every phase where it divides the pipeline batch (and M >= K for
    1F1B); elsewhere M is chosen freely and the phase says so."""
    start_K: int | None = None
    """Start from this pipeline length (the paper starts with one pipeline per node) and only compress:
    the no-freeze phase and the baseline use it, later phases choose any K <= start_K."""
    cache: str = "auto"
    """AutoCache of the frozen prefix's output: ``off``, ``on`` (in every phase with frozen layers;
    refused where host memory cannot hold it) or ``auto`` (where it saves time, fill epochs included)."""
    memory_fraction: float = 0.9
    """Share of each GPU's memory the plan may fill (the rest: framework context, allocator slack)."""
    host_read_bandwidth: float = 10e9
    """Bytes/s of the AutoCache's host traffic (cached prefix outputs read to the device, computed ones written
    back, frozen weights streamed to the device) where the profile did not measure it: a profile made by ``ptplan
    profile`` records the three rates of its device and host (``measurement["host_io"]``), which the plan charges
    instead on a cluster of that kind of device (``cluster.measured_host_io``)."""
    allow_extrapolation: bool = False
    """Let phases use micro-batch sizes outside the profile's measured range (their times are then
    extrapolated; each such phase says by how much). Off: only measured-range sizes are searched."""

    def __post_init__(self) -> None:
        _int_in("epochs", self.epochs, 1, MAX_EPOCHS, "Plan fewer epochs (a plan stores one trajectory point "
                "per epoch).")
        _int_in("samples per epoch", self.samples_per_epoch, 1, MAX_SAMPLES_PER_EPOCH, "Give the real data-set size.")
        _int_in("batch", self.batch, 1, MAX_BATCH, "Give the global batch in samples, e.g. 512.")
        if self.batch_policy not in BATCH_POLICIES:
            raise PtplanError(f"unknown batch policy {self.batch_policy!r}; use one of {', '.join(BATCH_POLICIES)}")
        if self.schedule not in SCHEDULE_CHOICES:
            raise PtplanError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULE_CHOICES)}")
        if self.optimizer not in OPTIMIZERS:
            raise PtplanError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.cache not in CACHE_MODES:
            raise PtplanError(f"unknown cache mode {self.cache!r}; use one of {', '.join(CACHE_MODES)}")
        mf = self.memory_fraction
        if isinstance(mf, bool) or not isinstance(mf, (int, float)) or not math.isfinite(mf) or not 0 < mf <= 1:
            raise PtplanError(f"memory fraction must be in (0, 1], got {mf!r}")
        bw = self.host_read_bandwidth
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) \
                or not 1.0 <= bw <= MAX_HOST_BANDWIDTH:
            raise PtplanError(f"host read bandwidth is {bw!r} bytes/s; give a finite number between 1 and "
                              f"{MAX_HOST_BANDWIDTH:.0e} (PCIe 4.0 x16 is about 25e9)")
        for name in ("pin_K", "pin_M", "start_K"):
            v = getattr(self, name)
            if v is not None:
                _int_in(name.replace("_", " "), v, 1, 1 << 30, "Give a positive integer.")
        if self.start_K is not None and self.pin_K is not None:
            raise PtplanError("give either a pinned K (--pipeline-length) or a start K (--start-K), not both")
        if not isinstance(self.allow_extrapolation, bool):
            raise PtplanError(f"allow_extrapolation must be true or false, got {self.allow_extrapolation!r}")

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_batch_reach(training: TrainingConfig, world_size: int, largest_micro_batch: int) -> None:
    """Refuse, in closed form and before any search, a batch no schedule can split: with micro-batches of at
    most ``largest_micro_batch`` samples (the profile's largest measured size, unless extrapolation is allowed)
    a pipeline of K positions needs M >= its batch / b micro-batches, and schedules are built for at most
    ``schedule.MICRO_BATCHES_PER_STAGE`` · K · V of them. Whatever K divides the ``world_size`` devices, that
    holds only if batch <= MICRO_BATCHES_PER_STAGE · world_size · V · b (both batch policies)."""
    from .schedule import MICRO_BATCHES_PER_STAGE

    if training.allow_extrapolation:
        return
    V = max(INTERLEAVED_V) if training.schedule in ("auto", "interleaved-1f1b", "looped-bfs") else \
        2 if training.schedule == "zb-v" else 1
    reach = MICRO_BATCHES_PER_STAGE * world_size * V * largest_micro_batch
    if training.batch > reach:
        per = "global" if training.batch_policy == "constant-global" else "per-pipeline"
        raise PtplanError(
            f"a {per} batch of {training.batch:,} samples needs more than {MICRO_BATCHES_PER_STAGE}*K*V micro-batches "
            f"per pipeline on any of the {world_size} devices' pipelines: with micro-batches of at most "
            f"{largest_micro_batch} samples (the profile's largest measured size) the most a step can take is "
            f"{MICRO_BATCHES_PER_STAGE}*{world_size}*{V}*{largest_micro_batch} = {reach:,}; use --batch {reach} or "
            f"less, profile larger micro-batch sizes, or --allow-extrapolation")


SAMPLE_ORDER_BYTES = 8
"""Bytes per sample of the order each training process draws an epoch from (an int64 permutation)."""


def epoch_order_problem(samples_per_epoch: int, processes_per_node: int, host_memory_bytes: int | None) -> str | None:
    """Why an epoch of ``samples_per_epoch`` cannot be run on a node whose ``processes_per_node`` processes each
    keep its shuffled sample order (``SAMPLE_ORDER_BYTES`` per sample) in ``host_memory_bytes`` (None: unknown,
    no bound); None when it fits."""
    need = SAMPLE_ORDER_BYTES * samples_per_epoch * processes_per_node
    if host_memory_bytes is None or need <= host_memory_bytes:
        return None
    return (f"{samples_per_epoch:,} samples per epoch: each of a node's {processes_per_node} processes keeps the "
            f"epoch's shuffled sample order ({SAMPLE_ORDER_BYTES} bytes per sample), {need / 2**30:,.1f} GiB per node, "
            f"but a node has {host_memory_bytes / 2**30:,.1f} GiB of host memory; give the real data-set size "
            f"(--samples-per-epoch) or --steps-per-epoch")


def training_from_json(f: Fields) -> TrainingConfig:
    """A TrainingConfig from a plan's ``inputs.training`` object (unknown keys rejected by name)."""
    known = [x.name for x in fields(TrainingConfig)]
    Fields(f.obj, f.what, f.path, allowed=known)

    def opt_int(key: str) -> int | None:
        return None if f.raw(key, None) is None else f.int(key, min=1)

    try:
        return TrainingConfig(
            epochs=f.int("epochs", min=1), samples_per_epoch=f.int("samples_per_epoch", min=1),
            batch=f.int("batch", min=1), batch_policy=f.str("batch_policy", choices=BATCH_POLICIES),
            schedule=f.str("schedule", choices=SCHEDULE_CHOICES), optimizer=f.str("optimizer", "adamw", choices=OPTIMIZERS),
            pin_K=opt_int("pin_K"), pin_M=opt_int("pin_M"), start_K=opt_int("start_K"),
            cache=f.str("cache", "off", choices=CACHE_MODES), memory_fraction=f.float("memory_fraction", 0.9),
            host_read_bandwidth=f.float("host_read_bandwidth", 10e9),
            allow_extrapolation=f.bool("allow_extrapolation", False))
    except PtplanError as e:
        if type(e) is PtplanError:
            raise PtplanError(f"{f.what}: {f.path}: {e}") from None
        raise
