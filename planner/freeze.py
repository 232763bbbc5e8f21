"""Freeze trajectories: how many bottom Transformer blocks are frozen at each freeze step.

Legend: L = number of Transformer blocks; f = frozen block count (0..L); T = freeze step (one per
epoch, or one per N optimizer steps); α = freeze rate in (0, 1).

The paper's rule (PipeTransformer Eq. 1)::

    f(T) = min( f(T-1) + α·(L - f(T-1)),  argmin-gradient-norm term )

*Geometric bound alone* (the released code's schedule, policy ``geometric``): the real-valued
recursion x(T) = x(T-1) + α·(L - x(T-1)), x(0) = 0, has the closed form x(T) = L·(1 - (1-α)^T); the
frozen count is f(T) = ceil(x(T)) (with a 1e-9 tolerance so that 12·(1 - 2/3) = 4.000000000000001
counts as 4). L=12, α=1/3 gives 0,4,7,9,10,11,11,12,12,12.

No recursion on the *integer* count reproduces that sequence: it holds 11 at T=5 and T=6 and then
moves to 12, so the step after 11 would have to be both 11 and 12. The rounding therefore lives on
the real-valued x, and ``trajectory`` uses the closed form.

*Adaptive* (``next_frozen``, called by the executor at run time with measured norms): it starts from
the integer count actually frozen, f_prev, so its bound is ceil(f_prev + α·(L - f_prev)). Ceil, not
round or floor, so that at least one more block freezes while any is active (floor would stall for
L - f_prev < 1/α). Gradient-norm term: among the active blocks f_prev..L-1, the block ℓ* with the
smallest norm (the lowest index on ties) has converged first, so "freeze up to and including ℓ*",
i.e. the count ℓ* + 1. The result is min(bound, ℓ* + 1), always in f_prev+1..L while f_prev < L.
Without norms the adaptive rule is the integer recursion 0,4,7,9,10,11,12 (L=12, α=1/3): one step
ahead of the closed form at T=6.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .errors import PtplanError
from .jsonio import Fields

POLICIES = ("geometric", "manual", "none")
_EPS = 1e-9


def geometric_count(T: int, L: int, alpha: float) -> int:
    """Closed form of the geometric bound: ceil(L·(1 - (1-α)^T)), f(0) = 0."""
    _check_L_alpha(L, alpha)
    if T < 0:
        raise PtplanError(f"freeze step T is {T}; it must be >= 0")
    x = L * (1.0 - (1.0 - alpha) ** T)
    return min(L, max(0, math.ceil(x - _EPS * max(1, L))))


def next_frozen(prev: int, L: int, alpha: float, grad_norms: Sequence[float] | None = None) -> int:
    """The next frozen block count from the current one (Eq. 1; see the module docstring).

    ``grad_norms``: one norm per block (length L), as measured since the last decision; entries of
    frozen blocks (index < prev) are ignored and may be anything (0, NaN). None = bound alone.
    """
    _check_L_alpha(L, alpha)
    if isinstance(prev, bool) or not isinstance(prev, int) or not 0 <= prev <= L:
        raise PtplanError(f"current frozen count {prev!r} is outside 0..{L}")
    if prev == L:
        return L
    bound = min(L, math.ceil(prev + alpha * (L - prev) - _EPS * max(1, L)))
    bound = max(bound, prev + 1)
    if grad_norms is None:
        return bound
    if len(grad_norms) != L:
        raise PtplanError(f"got {len(grad_norms)} gradient norms for a model of {L} blocks; pass one per "
                          "block (entries of frozen blocks are ignored)")
    best, best_norm = -1, math.inf
    for i in range(prev, L):
        g = float(grad_norms[i])
        if not math.isfinite(g) or g < 0:
            raise PtplanError(f"gradient norm of active block {i} is {g}; norms must be finite and >= 0")
        if g < best_norm:
            best, best_norm = i, g
    return min(bound, best + 1)


@dataclass(frozen=True, kw_only=True)
class FreezePolicy:
    """How the frozen block count evolves during training."""

    policy: str = "geometric"
    """``geometric`` (the paper's bound), ``manual`` (a list), or ``none`` (never freeze: the baseline)."""
    alpha: float = 1 / 3
    """α, freeze rate per step in (0, 1); used by ``geometric``. The paper reports speedups at 1/3."""
    manual: tuple[int, ...] = ()
    """For ``manual``: frozen count at step 0, 1, 2, ...; non-decreasing; the last value holds after the end."""
    every: str | int = "epoch"
    """When a freeze step happens: ``"epoch"`` (at the start of each epoch) or every N optimizer steps."""
    adaptive: bool = False
    """For ``geometric``: at run time the executor calls ``next_frozen`` with measured gradient norms, so
    any count up to the bound may occur (the plan holds a phase for every count 0..L)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise PtplanError(f"freeze policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < 1:
            raise PtplanError(f"freeze rate alpha is {a!r}; it must lie strictly between 0 and 1 "
                              "(the paper uses 1/3; 2/5 and 1/2 freeze faster)")
        if self.every != "epoch" and (isinstance(self.every, bool) or not isinstance(self.every, int)
                                      or self.every < 1):
            raise PtplanError(f"freeze 'every' is {self.every!r}; use \"epoch\" or a number of steps >= 1")
        object.__setattr__(self, "manual", tuple(self.manual))
        if self.policy == "manual":
            if not self.manual:
                raise PtplanError("manual freeze policy needs a list of frozen counts, e.g. [0, 4, 7, 9]")
            for i, c in enumerate(self.manual):
                if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                    raise PtplanError(f"manual freeze list entry {i} is {c!r}; counts must be integers >= 0")
                if i and c < self.manual[i - 1]:
                    raise PtplanError(f"manual freeze list goes down at entry {i} ({self.manual[i - 1]} -> {c}); "
                                      "frozen blocks never thaw, so the list must be non-decreasing")
        elif self.manual:
            raise PtplanError(f"a manual freeze list was given with policy {self.policy!r}; "
                              "set policy to \"manual\" or drop the list")
        if self.adaptive and self.policy != "geometric":
            raise PtplanError(f"adaptive freezing needs policy \"geometric\" (got {self.policy!r})")


def freeze_from_json(f: Fields) -> FreezePolicy:
    """A FreezePolicy from a plan's ``inputs.freeze`` object (unknown keys rejected by name)."""
    Fields(f.obj, f.what, f.path, allowed=("policy", "alpha", "manual", "every", "adaptive"))
    every = f.raw("every", "epoch")
    if every != "epoch":
        every = f.int("every", min=1)
    try:
        return FreezePolicy(policy=f.str("policy", choices=POLICIES), alpha=f.float("alpha", 1 / 3),
                            manual=tuple(f.ints("manual", min=0)) if "manual" in f.obj else (), every=every,
                            adaptive=f.bool("adaptive", False))
    except PtplanError as e:
        raise PtplanError(f"{f.what}: {f.path}: {e}") from None


def _check_L_alpha(L: int, alpha: float) -> None:
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
        raise PtplanError(f"number of blocks L is {L!r}; it must be an integer >= 1")
    if not 0 < alpha < 1:
        raise PtplanError(f"freeze rate alpha is {alpha!r}; it must lie strictly between 0 and 1 (e.g. 1/3)")


def _count_at(policy: FreezePolicy, L: int, T: int) -> int:
    """Frozen count in force after freeze step T (step 0 = start of training)."""
    if policy.policy == "none":
        return 0
    if policy.policy == "geometric":
        return geometric_count(T, L, policy.alpha)
    c = policy.manual[min(T, len(policy.manual) - 1)]
    if c > L:
        raise PtplanError(f"manual freeze list asks for {c} frozen blocks but the model has L={L} blocks")
    return c


def freeze_table(policy: FreezePolicy, L: int, last_T: int) -> list[int]:
    """The frozen count at freeze steps T = 0..last_T, cut where it stops changing (the last entry
    then holds for every later T): what a plan stores and a run replays."""
    _check_L_alpha(L, policy.alpha)
    if isinstance(last_T, bool) or not isinstance(last_T, int) or last_T < 0:
        raise PtplanError(f"last freeze step is {last_T!r}; it must be an integer >= 0")
    final = 0 if policy.policy == "none" else L if policy.policy == "geometric" else policy.manual[-1]
    out = [_count_at(policy, L, 0)]
    T = 0
    while T < last_T and not (out[-1] == final and (policy.policy != "manual" or T >= len(policy.manual) - 1)):
        T += 1
        out.append(_count_at(policy, L, T))
    return out
