"""``freeze_only_costs``'s ``table`` hook (issue 22 item 6): the freeze-only row's stage costs priced from another
per-layer table, as ``bench/pt_freeze_only.py`` prices the ways PipeTransformer's code could run its frozen layers.
Hand-computed here: with frozen layers paying their backward's input-gradient part, a stage's backward is the sum
of its frozen layers' (backward - weight-gradient part) plus its active layers' backward."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ptplan.planner.ablate import freeze_only_costs, frozen_in_place_table
from ptplan.planner.cluster import get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.costs import CostTable
from ptplan.planner.profile import load_profile
from ptplan.planner.search import Candidate, PhaseSearch

ROOT = Path(__file__).resolve().parents[1]


def _input_grad_table(table: CostTable, n0: int) -> CostTable:
    t = frozen_in_place_table(table, n0)
    t._bwd = np.where((np.arange(table.n) < n0)[:, None], table._bwd - table._bww, t._bwd)
    return t


@pytest.fixture(scope="module")
def search() -> PhaseSearch:
    bert = load_profile(ROOT / "profiles" / "bert-base_rtx5000_fp32.json")
    return PhaseSearch(bert, get_preset("paper"), TrainingConfig(epochs=2, samples_per_epoch=4096, batch=256,
                                                                 schedule="gpipe"))


def test_frozen_layers_pay_their_input_gradient_part_under_the_hook(search):
    t = search.t
    assert t.backward_split_measured  # so the weight-gradient part is not 0 and the test can fail
    n0 = search.p.frozen_boundary(4)
    cut = n0 // 2
    ranges = [(0, cut), (cut, n0 + 2), (n0 + 2, n0 + 6), (n0 + 6, t.n)]  # frozen-only, mixed, active, active
    cand = Candidate(K=4, D=4, M=4, b=16, cache=False, schedule="gpipe")
    plain = freeze_only_costs(search, cand, ranges, n0)
    assert freeze_only_costs(search, cand, ranges, n0, frozen_in_place_table) == plain  # the default
    hooked = freeze_only_costs(search, cand, ranges, n0, _input_grad_table)
    at = t.at(cand.b)
    input_part = at.bwd - np.diff(at.cum_bwd_weight)  # each layer's backward less its weight-gradient part
    assert (input_part >= 0).all() and (np.diff(at.cum_bwd_weight) > 0).any()
    for (lo, hi), a, h in zip(ranges, plain, hooked):
        frozen = float(input_part[lo:min(hi, n0)].sum())
        active = float(at.bwd[max(lo, n0):hi].sum())
        assert a.backward_s == pytest.approx(active, rel=1e-9, abs=1e-15), (lo, hi)
        assert h.backward_s == pytest.approx(frozen + active, rel=1e-9, abs=1e-15), (lo, hi)
        assert h.forward_s == pytest.approx(a.forward_s, rel=1e-12)  # the forward is the no-grad one either way
    assert hooked[0].backward_s > 0 and plain[0].backward_s == 0  # the frozen-only stage now has a backward
