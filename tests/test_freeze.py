"""Freeze trajectories: the geometric closed form, the adaptive rule, manual lists, reachable counts."""
from __future__ import annotations

import math

import pytest

from ptplan.planner.errors import PtplanError
from ptplan.planner.freeze import FreezePolicy, freeze_table, geometric_count, next_frozen


def trajectory(pol: FreezePolicy, L: int, steps: int) -> list[int]:
    """The frozen count at freeze steps 0..steps-1, read from the (cut) table as a run reads it."""
    table = freeze_table(pol, L, steps - 1)
    return [table[min(T, len(table) - 1)] for T in range(steps)]

# research/pipetransformer.md §1.3: ceil(L(1-(1-α)^T)) for L=12, T=0..9
PAPER_TABLE = {
    1 / 5: [0, 3, 5, 6, 8, 9, 9, 10, 10, 11],
    1 / 4: [0, 3, 6, 7, 9, 10, 10, 11, 11, 12],
    1 / 3: [0, 4, 7, 9, 10, 11, 11, 12, 12, 12],
    2 / 5: [0, 5, 8, 10, 11, 12, 12, 12, 12, 12],
    1 / 2: [0, 6, 9, 11, 12, 12, 12, 12, 12, 12],
}


@pytest.mark.parametrize("alpha", PAPER_TABLE)
def test_geometric_trajectory_matches_the_paper_table(alpha):
    assert trajectory(FreezePolicy(alpha=alpha), 12, 10) == PAPER_TABLE[alpha]


def test_real_valued_recursion_equals_closed_form():
    for L in (12, 24, 96):
        for alpha in (0.07, 0.2, 1 / 3, 0.5, 0.9):
            x = 0.0
            for T in range(40):
                assert geometric_count(T, L, alpha) == max(0, math.ceil(x - 1e-9 * L))
                assert x == pytest.approx(L * (1 - (1 - alpha) ** T), abs=1e-9)
                x = x + alpha * (L - x)


def test_no_integer_recursion_gives_the_closed_form():
    seq = PAPER_TABLE[1 / 3]
    # 11 is followed by 11 (T=5 -> 6) and then by 12 (T=6 -> 7): not a function of the previous count
    assert (seq[5], seq[6], seq[7]) == (11, 11, 12)
    # the adaptive rule without norms is the ceil integer recursion: one step ahead at T=6
    f, out = 0, [0]
    for _ in range(9):
        f = next_frozen(f, 12, 1 / 3)
        out.append(f)
    assert out == [0, 4, 7, 9, 10, 11, 12, 12, 12, 12]


def test_rounding_tolerance_on_exact_values():
    # 12 * (1 - 2/3) is 4.000000000000001 in floating point; it must count as 4, not 5
    assert geometric_count(1, 12, 1 / 3) == 4
    assert geometric_count(1, 24, 1 / 3) == 8
    assert geometric_count(0, 12, 0.5) == 0


def test_next_frozen_with_gradient_norms():
    L = 12
    norms = [float("nan")] * 4 + [5.0, 4.0, 0.5, 3.0, 2.0, 1.0, 0.9, 0.8]
    # bound from 4 frozen: ceil(4 + 8/3) = 7; smallest active norm is block 6 -> freeze through 6 -> 7
    assert next_frozen(4, L, 1 / 3, norms) == 7
    norms[6] = 9.0  # smallest active norm is now block 11 (0.8) -> 12, capped by the bound at 7
    assert next_frozen(4, L, 1 / 3, norms) == 7
    norms[4] = 0.1  # smallest at block 4 -> freeze only it
    assert next_frozen(4, L, 1 / 3, norms) == 5
    # ties go to the lowest block
    assert next_frozen(0, 4, 0.5, [1.0, 1.0, 1.0, 1.0]) == 1
    assert next_frozen(12, 12, 1 / 3, [0.0] * 12) == 12


def test_next_frozen_always_progresses_and_stays_in_range():
    for L in (1, 2, 5, 12, 24):
        for alpha in (0.01, 0.3, 0.99):
            for prev in range(L):
                nxt = next_frozen(prev, L, alpha)
                assert prev < nxt <= L


def test_next_frozen_errors():
    with pytest.raises(PtplanError, match="got 3 gradient norms for a model of 12 blocks"):
        next_frozen(0, 12, 1 / 3, [1.0, 2.0, 3.0])
    with pytest.raises(PtplanError, match="gradient norm of active block 1 is nan"):
        next_frozen(0, 3, 1 / 3, [1.0, float("nan"), 1.0])
    with pytest.raises(PtplanError, match="outside 0..12"):
        next_frozen(13, 12, 1 / 3)


def test_policy_validation_messages():
    with pytest.raises(PtplanError, match=r"alpha is 1.5; it must lie strictly between 0 and 1.*1/3"):
        FreezePolicy(alpha=1.5)
    with pytest.raises(PtplanError, match="alpha is 0"):
        FreezePolicy(alpha=0)
    with pytest.raises(PtplanError, match="goes down at entry 2 \\(4 -> 3\\)"):
        FreezePolicy(policy="manual", manual=(0, 4, 3))
    with pytest.raises(PtplanError, match="needs a list"):
        FreezePolicy(policy="manual")
    with pytest.raises(PtplanError, match="not one of"):
        FreezePolicy(policy="sometimes")
    with pytest.raises(PtplanError, match="'every' is 0"):
        FreezePolicy(every=0)
    with pytest.raises(PtplanError, match="adaptive freezing needs policy"):
        FreezePolicy(policy="none", adaptive=True)
    with pytest.raises(PtplanError, match="set policy to \"manual\""):
        FreezePolicy(manual=(0, 1))


def test_manual_and_none():
    pol = FreezePolicy(policy="manual", manual=[0, 2, 5])
    assert pol.manual == (0, 2, 5)
    assert trajectory(pol, 12, 5) == [0, 2, 5, 5, 5]        # holds the last value
    assert trajectory(pol, 12, 2) == [0, 2]                 # longer lists are cut
    assert freeze_table(pol, 12, 10) == [0, 2, 5]           # the table stops where the count settles
    with pytest.raises(PtplanError, match="asks for 5 frozen blocks but the model has L=4"):
        trajectory(pol, 4, 3)
    assert trajectory(FreezePolicy(policy="none"), 12, 4) == [0, 0, 0, 0]
    assert freeze_table(FreezePolicy(policy="none"), 12, 4) == [0]


def test_table_is_cut_where_the_geometric_count_settles():
    assert freeze_table(FreezePolicy(alpha=1 / 3), 12, 100) == [0, 4, 7, 9, 10, 11, 11, 12]
    assert freeze_table(FreezePolicy(alpha=1 / 3), 12, 3) == [0, 4, 7, 9]
    # every N steps: the table is per freeze step, the cadence lives in the policy
    assert freeze_table(FreezePolicy(alpha=1 / 3, every=50), 12, 3) == [0, 4, 7, 9]


def test_table_errors():
    with pytest.raises(PtplanError, match="last freeze step is -1"):
        freeze_table(FreezePolicy(), 12, -1)
    with pytest.raises(PtplanError, match="L is 0"):
        freeze_table(FreezePolicy(), 0, 3)
