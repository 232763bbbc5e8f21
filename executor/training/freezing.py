"""When and how far to freeze during a run: follow the plan's freeze steps, or decide from measured gradient norms.

A *freeze step* T happens at the start of each epoch (T = epoch) or every N optimizer steps
(T = global_step // N), N being the plan's cadence or ``--freeze-every``. ``planned`` reads the
frozen count for T from the plan (``Plan.frozen_at``: the table ``ptplan plan`` computed; nothing is
recomputed here); ``adaptive`` calls ``planner.freeze.next_frozen(prev, L, alpha, norms)`` once per
new T with the mean per-block gradient norm since the previous decision (all ranks agree: the norms
are all-reduced and the decision is broadcast from rank 0 by the runtime).
"""
from __future__ import annotations

from typing import Sequence

from ptplan.planner.freeze import next_frozen
from ptplan.planner.plan import Plan


class FreezeSchedule:
    """Maps a run position to its freeze step T and (for ``planned``) the plan's frozen count."""

    def __init__(self, plan: Plan, mode: str, *, num_blocks: int, every: int | None = None,
                 alpha: float | None = None) -> None:
        self.plan, self.mode, self.L = plan, mode, num_blocks
        fz = plan.inputs.freeze
        if every is None and fz.every != "epoch":
            every = int(fz.every)
        self.every = every
        """Optimizer steps per freeze step, or None for one freeze step per epoch."""
        self.alpha = float(alpha if alpha is not None else fz.alpha)

    def T(self, epoch: int, global_step: int) -> int:
        return epoch if self.every is None else global_step // self.every

    def planned(self, epoch: int, global_step: int) -> int:
        """The plan's frozen count at this position."""
        return self.plan.frozen_at(self.T(epoch, global_step))

    def adaptive(self, prev: int, grad_norms: Sequence[float] | None) -> int:
        """The gradient-norm rule's next count from ``prev`` (never below ``prev``)."""
        return max(prev, next_frozen(prev, self.L, self.alpha, grad_norms))
