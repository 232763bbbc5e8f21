"""A frozen prefix too big for stage 0 (and, cached, for the host) stops freezing there with a warning, instead of
making the whole plan infeasible (issue 22), and a GPU profile on another device's cluster is warned."""
from __future__ import annotations

import pytest

from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.errors import InfeasibleError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import load_profile
from ptplan.planner.search import PhaseSearch, Visit
from ptplan.planner.synthetic import synthetic_profile


def _case(frac: float):
    prof = synthetic_profile(num_blocks=8, hidden=256, seq_len=16, vocab=256)
    weights = sum(r.param_bytes for r in prof.layers)
    cl = Cluster(name="toy8", nodes=1, gpus_per_node=8, gpu_memory_bytes=int(weights * frac), gpu_name="toy",
                 intra_bandwidth=1e9, intra_latency_s=1e-5, inter_bandwidth=1e9, inter_latency_s=1e-5,
                 host_memory_bytes=1 << 20)
    cfg = TrainingConfig(epochs=8, samples_per_epoch=64, batch=8, cache="off")
    return prof, cl, cfg, FreezePolicy(policy="manual", manual=(0, 2, 4, 6, 8, 8, 8, 8))


def test_freezing_stops_where_the_frozen_prefix_no_longer_fits():
    """GPUs of 0.9x the model's weights: 8 stages hold the model, but 6 frozen blocks' weights on stage 0 do not
    fit (and the host has 1 MiB for the cache): the plan freezes up to 4 blocks and says why."""
    prof, cl, cfg, fz = _case(0.9)
    s = PhaseSearch(prof, cl, cfg)
    with pytest.raises(InfeasibleError):
        s.search(6, Visit(samples=64.0))
    s.search(4, Visit(samples=64.0))
    plan = make_plan(prof, cl, cfg, fz)
    assert [p.frozen_blocks for p in plan.trajectory] == [0, 2, 4, 4, 4, 4, 4, 4]
    w = [x for x in plan.warnings if x.code == "freezing-stopped"]
    assert len(w) == 1 and "freezing stops at 4 of 8 blocks: with 6 frozen" in w[0].message
    assert "stage 0" in w[0].message or "fits" in w[0].message


def test_no_warning_where_everything_fits():
    prof, cl, cfg, fz = _case(1.2)
    plan = make_plan(prof, cl, cfg, fz)
    assert [p.frozen_blocks for p in plan.trajectory][-1] == 8
    assert not [x for x in plan.warnings if x.code == "freezing-stopped"]


def test_plan_warns_a_gpu_profile_on_another_devices_cluster():
    prof = load_profile("profiles/bert-tiny_h100_bf16.json")
    cfg = TrainingConfig(epochs=2, samples_per_epoch=2048, batch=64)
    plan = make_plan(prof, get_preset("paper"), cfg, FreezePolicy(policy="geometric", alpha=1 / 3))
    assert [x.code for x in plan.warnings].count("profile-device-differs") == 1
    same = make_plan(prof, get_preset("dgx-h100"), cfg, FreezePolicy(policy="geometric", alpha=1 / 3))
    assert "profile-device-differs" not in [x.code for x in same.warnings]


def test_the_new_warnings_survive_the_plan_file():
    """Both new warning codes are in the plan reader's list (planner/plan.py WARNING_CODES): the plan loads back."""
    import json

    from ptplan.planner.plan import plan_from_json
    prof, cl, cfg, fz = _case(0.9)
    plan = make_plan(prof, cl, cfg, fz)
    back = plan_from_json(json.loads(json.dumps(plan.to_json())))
    assert [w.code for w in back.warnings] == [w.code for w in plan.warnings]
    h100 = make_plan(load_profile("profiles/bert-tiny_h100_bf16.json"), get_preset("cpu:4"),
                     TrainingConfig(epochs=2, samples_per_epoch=2048, batch=64), FreezePolicy(policy="none"))
    assert "profile-device-differs" in [w.code for w in plan_from_json(json.loads(json.dumps(h100.to_json()))).warnings]
