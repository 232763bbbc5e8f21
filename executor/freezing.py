"""When and how far to freeze during a run: follow the plan, or decide from measured gradient norms.

A *freeze step* T happens at the start of each epoch (T = epoch) or every N optimizer steps
(T = global_step // N). ``planned`` reads the frozen count for T from the plan; ``adaptive`` calls
``planner.freeze.next_frozen(prev, L, alpha, norms)`` once per new T with the mean per-block
gradient norm since the previous decision (all ranks agree: the norms are all-reduced and the
decision is broadcast from rank 0 by the runtime).
"""
from __future__ import annotations

from typing import Any, Sequence

from ptplan.planner.errors import PtplanError
from ptplan.planner.freeze import FreezePolicy, next_frozen, trajectory
from ptplan.planner.plan import Plan


class FreezeSchedule:
    """Maps a run position to its freeze step T and (for ``planned``) the frozen count."""

    def __init__(self, plan: Plan, mode: str, *, num_blocks: int, every: int | None = None,
                 alpha: float | None = None) -> None:
        self.plan, self.mode, self.L = plan, mode, num_blocks
        fz: dict[str, Any] = plan.inputs.get("freeze", {}) or {}
        self._policy: FreezePolicy | None = None
        self._from_trajectory = every is not None
        if every is None and isinstance(fz.get("every"), int):
            every = fz["every"]
            try:
                self._policy = FreezePolicy(**fz)
            except (TypeError, PtplanError) as e:
                raise PtplanError(f"the plan's freeze policy {fz} cannot be replayed step by step: {e}") from None
        self.every = every
        """Optimizer steps per freeze step, or None for one freeze step per epoch."""
        a = alpha if alpha is not None else fz.get("alpha", 1 / 3)
        self.alpha = float(a)
        self._cache: dict[int, int] = {}

    def T(self, epoch: int, global_step: int) -> int:
        return epoch if self.every is None else global_step // self.every

    def planned(self, epoch: int, global_step: int) -> int:
        """The plan's frozen count at this position."""
        T = self.T(epoch, global_step)
        if T in self._cache:
            return self._cache[T]
        traj = self.plan.trajectory
        if self._policy is not None and not self._from_trajectory:
            c = trajectory(self._policy, self.L, T + 1, steps_per_epoch=self.every)[T]
        elif not traj:
            c = 0
        elif self._from_trajectory:
            c = traj[min(T, len(traj) - 1)].frozen_blocks
        else:
            earlier = [p for p in traj if p.epoch <= T]
            c = (earlier[-1] if earlier else traj[0]).frozen_blocks
        self._cache[T] = c
        return c

    def adaptive(self, prev: int, grad_norms: Sequence[float] | None) -> int:
        """The gradient-norm rule's next count from ``prev`` (never below ``prev``)."""
        return max(prev, next_frozen(prev, self.L, self.alpha, grad_norms))
