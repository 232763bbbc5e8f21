"""What the training loop and its callbacks share: the run's position (saved in checkpoints) and its context."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ptplan.planner.plan import Plan

from ptplan.executor.data.dataset import Dataset
from ptplan.executor.runtime.elastic import ElasticRuntime
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.freezing import FreezeSchedule
from ptplan.executor.training.runlog import RunLog


@dataclass
class Position:
    """Where the run is; saved in checkpoints."""

    epoch: int = 0
    step_in_epoch: int = 0
    cursor: int = 0
    """Samples of the epoch's order consumed so far."""
    global_step: int = 0
    """Optimizer steps done."""
    frozen_blocks: int = 0
    decided_T: int = 0
    """Last freeze step T already decided (adaptive)."""
    norm_sum: list[float] = field(default_factory=list)
    """Per block: sum of per-step gradient norms since the last decision (adaptive)."""
    norm_count: int = 0
    best_eval: list[float] = field(default_factory=list)
    """``--export-best``: the best evaluation's score (``callbacks.score``) and step, once one was exported."""


@dataclass
class StepResult:
    """One optimizer step as the loop ran it, before the position moves on; callbacks add ``fields``."""

    seconds: float
    loss: float
    data_seconds: float | None = None
    """Of ``seconds``, the time making this rank's batch took (the data set's ``batch``)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Extra fields of the step's run-log record (memory, lr, grad_norm...)."""


@dataclass
class RunContext:
    """One rank's run: what the loop drives and every callback may read (``pos`` changes as it goes)."""

    cfg: RunConfig
    plan: Plan
    rt: ElasticRuntime
    dataset: Dataset
    log: RunLog
    fs: FreezeSchedule
    device: torch.device
    run_id: dict[str, Any]
    """The settings a checkpoint is bound to (``resume.run_id``)."""
    resuming: bool
    epochs: int
    total: int | None
    """The run's optimizer steps when known in advance (the LR schedule needs it), else None."""
    amp: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    pos: Position = field(default_factory=Position)
    loss: float | None = None
    """The last step's loss (None before the first)."""
    transitions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.rt.rank
