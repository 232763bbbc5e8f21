"""The ablation's freeze-only row is priced by the one stage model (issue 21 item 4): where the stage model's own
phase describes the same stages -- every frozen layer on stage 0, ahead of its trained ones -- the row's stage
costs are that phase's ``StageModel.stage_costs``, every field (ZB-H1's weight-gradient part and PipeDream-2BW's
weight versions included), and the row's iteration is that phase's simulated one."""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest

from ptplan.planner.ablate import (RowPhase, _freeze_only, _prefix_note, _Priced, freeze_only_costs,
                                   frozen_in_place_table)
from ptplan.planner.cluster import get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import load_profile
from ptplan.planner.schedule import build_schedule
from ptplan.planner.search import Candidate, PhaseSearch
from ptplan.planner.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
TRAIN = TrainingConfig(epochs=2, samples_per_epoch=4096, batch=256)
TIMES = ("backward_s", "backward_weight_s", "send_forward_s", "send_backward_s", "send_forward_latency_s",
         "send_backward_latency_s", "allreduce_s", "optimizer_s", "setup_s", "overhead_s", "tp_comm_s")
BYTES = ("fixed_bytes", "activation_bytes_per_mb", "after_bytes")


@pytest.fixture(scope="module")
def bert():
    return load_profile(ROOT / "profiles" / "bert-base_rtx5000_fp32.json")


def _static_split(n: int, first: int, S: int) -> list[tuple[int, int]]:
    """Stage 0 = [0, first), the rest of the n layers evenly over S - 1 stages."""
    rest = [first + (n - first) * s // (S - 1) for s in range(S)]
    return [(0, first)] + list(zip(rest[:-1], rest[1:]))


@pytest.mark.parametrize("cluster,schedule,K,M", [("paper", "1f1b", 4, 8), ("paper", "zb-h1", 4, 8),
                                                  ("paper", "gpipe", 8, 8), ("paper", "2bw", 4, 4),
                                                  ("cpu:4", "zb-h1", 2, 4), ("cpu:4", "1f1b", 4, 4)])
def test_freeze_only_costs_are_the_stage_models_where_it_describes_the_phase(bert, cluster, schedule, K, M):
    search = PhaseSearch(bert, get_preset(cluster), replace(TRAIN, schedule=schedule))
    assert search.t.backward_split_measured  # so ZB-H1's W (backward_weight_s) is not 0
    D = search.W // K
    cand = Candidate(K=K, D=D, M=M, b=256 // D // M, cache=False, schedule=schedule)
    n = search.n
    for f in (1, 2, 3):
        n0 = bert.frozen_boundary(f)
        ranges = _static_split(n, n0 + 2, K)
        ours = freeze_only_costs(search, cand, ranges, n0)
        theirs = search.model(cand, n0).stage_costs([(n0, ranges[0][1]), *ranges[1:]])
        for s, (a, b) in enumerate(zip(ours, theirs)):
            # the stage model runs the frozen prefix as stage 0's prefix_s; the freeze-only row as its forward
            assert a.forward_s + a.prefix_s == pytest.approx(b.forward_s + b.prefix_s, rel=1e-12), (f, s)
            for name in TIMES:
                assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12, abs=1e-15), (f, s, name)
            for name in BYTES:
                assert abs(getattr(a, name) - getattr(b, name)) <= 1, (f, s, name)
        if schedule == "zb-h1":
            assert all(c.backward_weight_s > 0 for c in ours)


def test_the_rows_iteration_is_the_stage_models_phase(bert):
    """``_freeze_only`` (the row) simulates the stage model's costs: at a frozen count whose frozen layers all sit
    on the static split's stage 0, its iteration is the stage model's phase's, simulated."""
    cfg = replace(TRAIN, start_K=2, cache="off", epochs=3)
    plan = make_plan(bert, get_preset("paper"), cfg, FreezePolicy(policy="geometric", alpha=1 / 3))
    base = plan.baseline.phase
    search = PhaseSearch(bert, get_preset("paper"), cfg)
    table = [f for f in range(3) if bert.frozen_boundary(f) < base.partition[0][1]]
    assert table[-1] > 0, base.partition  # some frozen count keeps its frozen layers on stage 0
    row = _freeze_only(search, base, table, cfg, FreezePolicy(policy="manual", manual=tuple(table)))
    cand = Candidate(K=base.K, D=base.D, M=base.M, b=base.micro_batch_size, cache=False, schedule=base.schedule)
    sched = build_schedule(base.schedule, base.K, base.M)
    for r in row.rows:
        n0 = bert.frozen_boundary(r.frozen_blocks)
        ranges = [(n0, base.partition[0][1]), *base.partition[1:]] if n0 else list(base.partition)
        want = simulate(sched, search.model(cand, n0).stage_costs(ranges), step_overhead_s=search.c.step_overhead_s)
        assert r.iteration_s == pytest.approx(want.iteration_s, rel=1e-12), r.frozen_blocks


def test_the_frozen_in_place_table_keeps_only_the_frozen_layers_forward(bert):
    t = PhaseSearch(bert, get_preset("paper"), TRAIN).t
    n0 = bert.frozen_boundary(2)
    ft = frozen_in_place_table(t, n0)
    a, fa = t.at(8), ft.at(8)
    assert list(fa.fwd[:n0]) == list(a.nograd[:n0]) and list(fa.fwd[n0:]) == list(a.fwd[n0:])
    assert not fa.bwd[:n0].any() and list(fa.bwd[n0:]) == list(a.bwd[n0:])
    for name in ("grad_bytes", "saved_per_sample", "optimizer_s", "param_bytes"):
        assert not getattr(ft, name)[:n0].any() and list(getattr(ft, name)[n0:]) == list(getattr(t, name)[n0:])
    assert list(ft.out_per_sample) == list(t.out_per_sample)
    assert ft.cum_sync[-1] == pytest.approx(t.cum_sync[-1] - t.cum_sync[n0], rel=1e-12)
    assert t.at(8) is a  # the profile's table is left as it was


def test_the_prefix_note_reads_the_stage_models_prefix(bert):
    """Row 3's note (AutoPipe slower than freeze only) states stage 0's recomputed prefix per iteration: M times the
    stage model's ``prefix_s``, at the frozen count where row 3 loses most."""
    search = PhaseSearch(bert, get_preset("paper"), TRAIN)

    def priced(its: dict[int, float]) -> _Priced:
        return _Priced([], [], [RowPhase(frozen_blocks=f, K=4, D=4, M=8, micro_batch_size=8, cache=False,
                                         partition=(), iteration_s=it, fill_iteration_s=0.0, peak_memory_bytes=0,
                                         fits=True) for f, it in its.items()])

    note = _prefix_note(search, priced({2: 1.0, 6: 3.0}), priced({2: 0.9, 6: 1.0}))
    n0 = bert.frozen_boundary(6)
    want = 8 * search.uniform_model(Candidate(K=4, D=4, M=8, b=8, cache=False), n0).prefix_s
    assert want > 0 and f"at 6 frozen blocks (K=4, M=8) stage 0 spends {want:.1f} s of the 3.0 s" in note, note
