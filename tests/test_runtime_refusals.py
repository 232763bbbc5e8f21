"""What the executor does not run is one list (``planner.strategy.runtime_refusal``): the search leaves it out, and
``ptplan run`` refuses a plan that has it.

Before, the search had its own list (2BW's) and the executor another (2BW's and FSDP under a split backward), so
``ptplan plan --schedule zb-h1 --strategies auto`` wrote FSDP phases that ``ptplan run`` refused, and layer-wise
recomputation under ZB-H1 and ZB-V ran with a checkpointed unit that recomputed in every backward pass (B's and each
of W's parameter groups'). The executor now runs both as priced -- B rebuilds the first layers once for itself and W
(``tests/test_split_backward_recompute.py``); a sharded stage's B runs its whole backward and its W nothing
(``tests/test_hybrid_runtime.py``) --, and so does layer-wise recomputation under 2BW (its rerun binds the
micro-batch's weight version: ``tests/test_twobw.py``), so they left the list: what is left is tp and FSDP under
2BW."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ptplan.executor.training.validate import check_strategies
from ptplan.planner.cluster import get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.errors import PtplanError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import load_profile
from ptplan.planner.strategy import Strategy, runtime_refusal

PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "bert-base_a100_bf16.json"


@pytest.mark.parametrize("schedule,fraction", [("zb-h1", 0.02), ("zb-h1", 0.004), ("zb-v", 0.02), ("zb-v", 0.006),
                                               ("2bw", 0.01), ("1f1b", 0.004)])
def test_every_plan_the_search_writes_passes_the_executors_strategy_check(schedule, fraction):
    """bert-base on 8 A100s with a share of their memory small enough that the search needs tensor parallelism,
    FSDP or recomputation (on every stage or per stage): every phase's every stage passes ``check_strategies``.
    On adf136d the zb-h1 and zb-v plans at 2 % had FSDP phases that it refused, and at 0.4-0.6 % layer-wise
    recomputation that it ran as a checkpoint recomputed in every pass (both now run as priced; the zb-h1 plan at
    0.4 % takes layer-wise recomputation in its first phase)."""
    prof = load_profile(PROFILE)
    cfg = TrainingConfig(batch=256, schedule=schedule, memory_fraction=fraction, epochs=4, samples_per_epoch=4096)
    plan = make_plan(prof, get_preset("dgx-a100"), cfg, FreezePolicy(), strategies="auto")
    check_strategies(plan)
    strategies = {ph.strategy_label for ph in plan.phases}
    assert strategies - {"dp"}, strategies  # the memory share made the search use a strategy
    if (schedule, fraction) == ("zb-h1", 0.004):  # the search may take layer-wise recomputation under ZB-H1
        assert any(ph.recompute_layers for ph in plan.phases), strategies


def test_each_refusal_by_hand():
    rc2 = Strategy(recompute=True, recompute_layers=2)
    assert runtime_refusal("2bw", Strategy(tp=2), 1) is not None
    assert runtime_refusal("2bw", Strategy(fsdp=True), 2) is not None
    assert runtime_refusal("2bw", rc2, 1) is None
    assert runtime_refusal("2bw", Strategy(recompute=True), 1) is None
    for zb in ("zb-h1", "zb-v"):
        assert runtime_refusal(zb, Strategy(fsdp=True), 2) is None
        assert runtime_refusal(zb, Strategy(fsdp=True), 1) is None
        assert runtime_refusal(zb, rc2, 1) is None
        assert runtime_refusal(zb, Strategy(tp=2, recompute=True), 4) is None
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"):
        for st in (Strategy(tp=2, fsdp=True), rc2, Strategy(fsdp=True, recompute=True)):
            assert runtime_refusal(name, st, 2) is None


def test_run_takes_fsdp_and_layer_wise_recomputation_under_a_split_backward_and_refuses_fsdp_under_2bw():
    """A plan written by hand (or by an older ptplan): under ZB-H1 with D > 1, stage 1 sharded (FSDP) or recomputing
    its first 2 layers passes ``check_strategies``; under 2BW layer-wise recomputation passes too, and FSDP is
    refused, naming the phase, the stage and why."""
    prof = load_profile(PROFILE)
    cfg = TrainingConfig(batch=64, schedule="zb-h1", epochs=2, samples_per_epoch=1024, pin_K=2)
    plan = make_plan(prof, get_preset("dgx-a100"), cfg, FreezePolicy(policy="none"))
    ph = plan.phases[0]
    assert ph.K == 2 and ph.D > 1 and ph.schedule == "zb-h1"
    fsdp, layer_wise = dict(fsdp=(False, True)), dict(recompute=(False, True), recompute_layers=(0, 2))
    for st in (fsdp, layer_wise):
        check_strategies(dataclasses.replace(plan, phases=(dataclasses.replace(ph, **st), *plan.phases[1:])))
    twobw = make_plan(prof, get_preset("dgx-a100"), dataclasses.replace(cfg, schedule="2bw"),
                      FreezePolicy(policy="none"))
    ph = twobw.phases[0]
    assert ph.K == 2 and ph.D > 1 and ph.schedule == "2bw", (ph.K, ph.D, ph.schedule)
    check_strategies(dataclasses.replace(twobw, phases=(dataclasses.replace(ph, **layer_wise), *twobw.phases[1:])))
    with pytest.raises(PtplanError, match=r"stage 1: 2bw with fsdp is not run by the executor"):
        check_strategies(dataclasses.replace(twobw, phases=(dataclasses.replace(ph, **fsdp), *twobw.phases[1:])))
