"""Plan assembly (planner/planner.py) and `ptplan plan`: structure, errors, and what the plan decides."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.costs import CostTable
from ptplan.planner.errors import InfeasibleError, PtplanError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.partition import greedy_param_partition, optimal_partition, stage_cost
from ptplan.planner.plan import load_plan, plan_from_json, save_plan
from ptplan.planner.planner import TrainingConfig, make_plan
from ptplan.planner.profile import load_profile, save_profile
from ptplan.planner.schedule import build_schedule
from ptplan.planner.simulate import simulate
from ptplan.planner.synthetic import synthetic_profile

PROFILES = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.json"))
GEOM = FreezePolicy(policy="geometric", alpha=1 / 3)


@pytest.fixture(scope="module")
def small_plan():
    prof = synthetic_profile(num_blocks=12)
    cfg = TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512)
    return prof, make_plan(prof, get_preset("paper"), cfg, GEOM)


def test_plan_has_a_valid_phase_for_every_frozen_count(small_plan):
    prof, plan = small_plan
    assert [p.frozen_blocks for p in plan.phases] == list(range(prof.num_blocks + 1))
    for ph in plan.phases:
        assert ph.K * ph.D == 16
        assert ph.partition[0][0] == ph.frozen_layers == prof.frozen_boundary(ph.frozen_blocks)
        assert ph.partition[-1][1] == prof.num_layers
        assert ph.global_batch == 512  # constant-global batch policy
        assert max(ph.predicted.stage_peak_memory_bytes) <= 0.9 * get_preset("paper").gpu_memory_bytes
    # the JSON contract round-trips exactly
    again = plan_from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan


def test_trajectory_follows_the_geometric_bound_and_totals_add_up(small_plan):
    _, plan = small_plan
    assert [t.frozen_blocks for t in plan.trajectory] == [0, 4, 7, 9, 10, 11, 11, 12, 12, 12]
    assert plan.totals["seconds"] == pytest.approx(sum(t.seconds for t in plan.trajectory))
    for t in plan.trajectory:
        ph = plan.phases[t.phase]
        assert ph.frozen_blocks == t.frozen_blocks
        assert t.seconds == pytest.approx(t.iterations * ph.predicted.iteration_s)
    assert plan.totals["speedup"] == pytest.approx(plan.baseline.seconds / plan.totals["seconds"])
    assert plan.totals["speedup"] > 1.2  # freezing removes backward work and all-reduce bytes


def test_no_freezing_means_no_speedup():
    prof = synthetic_profile(num_blocks=6)
    plan = make_plan(prof, get_preset("paper"), TrainingConfig(epochs=3, samples_per_epoch=4096, batch=256),
                     FreezePolicy(policy="none"))
    assert [t.frozen_blocks for t in plan.trajectory] == [0, 0, 0]
    assert plan.totals["speedup"] == pytest.approx(1.0)


def test_prediction_is_the_simulation_of_the_chosen_configuration(small_plan):
    """The phase's predicted iteration time is at least the closed-form bound for its stages."""
    prof, plan = small_plan
    t = CostTable(prof)
    for ph in plan.phases:
        fwd, bwd, nog = t.at(ph.micro_batch_size)
        stage = [float((fwd + bwd)[lo:hi].sum()) for lo, hi in ph.partition]
        stage[0] += float(nog[:ph.frozen_layers].sum())
        lower = sum(stage) + (ph.M - 1) * max(stage)
        assert ph.predicted.iteration_s >= lower * (1 - 1e-9)


def test_memory_bound_model_pipelines_first_and_compresses_as_blocks_freeze():
    """A model too big for one GPU needs K > 1 at first; frozen blocks keep only weights, so K shrinks."""
    prof = synthetic_profile(num_blocks=24, hidden=4096, batch_sizes=(1, 2, 4))
    cluster = Cluster.uniform(nodes=2, like="dgx-h100")  # 16 x 80 GB
    plan = make_plan(prof, cluster, TrainingConfig(epochs=10, samples_per_epoch=8192, batch=64), GEOM)
    Ks = [plan.phases[t.phase].K for t in plan.trajectory]
    Ds = [plan.phases[t.phase].D for t in plan.trajectory]
    assert Ks[0] > 1
    assert Ks[-1] < Ks[0] and Ds[-1] > Ds[0]
    assert all(a >= b for a, b in zip(Ks, Ks[1:]))


def test_pinned_K_and_M_are_obeyed():
    prof = synthetic_profile(num_blocks=8)
    cfg = TrainingConfig(epochs=4, samples_per_epoch=4096, batch=256, pin_K=4, pin_M=8)
    plan = make_plan(prof, get_preset("paper"), cfg, GEOM)
    assert {(p.K, p.M) for p in plan.phases} == {(4, 8)}


def test_infeasible_memory_names_the_numbers():
    prof = synthetic_profile(num_blocks=12, hidden=2048)
    tiny = Cluster(name="tiny", nodes=1, gpus_per_node=2, gpu_memory_bytes=64 * 2 ** 20, gpu_name="toy",
                   intra_bandwidth=1e10, intra_latency_s=1e-5, inter_bandwidth=1e9, inter_latency_s=1e-5)
    with pytest.raises(InfeasibleError, match=r"GiB") as e:
        make_plan(prof, tiny, TrainingConfig(epochs=2, samples_per_epoch=256, batch=16), GEOM)
    assert "0 frozen blocks" in str(e.value) and "Fix:" in str(e.value)


def test_batch_that_does_not_split_is_refused():
    prof = synthetic_profile(num_blocks=4)
    with pytest.raises(InfeasibleError, match="does not split over D="):
        make_plan(prof, get_preset("paper"), TrainingConfig(epochs=2, samples_per_epoch=1000, batch=7), GEOM)


@pytest.mark.parametrize("bad", [dict(epochs=0), dict(batch=0), dict(batch_policy="grow"), dict(schedule="zb"),
                                 dict(memory_fraction=1.5), dict(cache="maybe")])
def test_training_config_checks(bad):
    args = dict(epochs=2, samples_per_epoch=100, batch=8)
    args.update(bad)
    with pytest.raises(PtplanError):
        TrainingConfig(**args)


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_autopipe_never_worse_than_the_papers_greedy_balancer(path):
    """On every shipped profile, for K in 2..8 and several frozen counts, slowest stage <= greedy's."""
    prof = load_profile(path)
    t = CostTable(prof)
    fwd, bwd, nog = t.at(prof.batch_sizes[-1])
    compared = 0
    for f in sorted({0, prof.num_blocks // 2, prof.num_blocks - 1}):
        n0 = prof.frozen_boundary(f)
        costs = (fwd + bwd)[n0:]
        extra = float(nog[:n0].sum())
        params = [r.params for r in prof.layers[n0:]]
        for K in (2, 4, 8):
            if K > len(costs):
                continue
            opt = optimal_partition(costs, K, stage0_extra_s=extra)
            try:
                greedy = greedy_param_partition(params, K)
            except InfeasibleError:  # the greedy rule left a stage empty: any valid split beats it
                continue
            compared += 1
            g_worst = max(stage_cost(costs, lo, hi) + (extra if i == 0 else 0.0)
                          for i, (lo, hi) in enumerate(greedy.ranges))
            assert opt.bottleneck <= g_worst * (1 + 1e-12), (f, K, opt.ranges, greedy.ranges)
    assert compared > 0


# ---- CLI -------------------------------------------------------------------------------------
@pytest.fixture()
def prof_file(tmp_path):
    path = tmp_path / "syn.json"
    save_profile(synthetic_profile(num_blocks=6), path)
    return path


def test_cli_plan_writes_plan_and_prints_table(prof_file, tmp_path):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--cluster", "paper", "--epochs", "4",
                                 "--samples-per-epoch", "4096", "--batch", "256", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "predicted speedup" in r.output and "layers per stage" in r.output
    plan = load_plan(out)
    assert len(plan.phases) == 7 and len(plan.trajectory) == 4


@pytest.mark.parametrize("args,needle", [
    (["--alpha", "1.5"], "alpha"),
    (["--alpha", "0"], "alpha"),
    (["--batch", "7"], "does not split"),
    (["--cluster", "nosuch"], "unknown cluster preset"),
    (["--freeze", "manual"], "--manual"),
    (["--freeze", "manual", "--manual", "0,3,2"], "non-decreasing"),
])
def test_cli_plan_bad_input_exits_2_and_writes_nothing(prof_file, tmp_path, args, needle):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--out", str(out), "--epochs", "3",
                                 "--samples-per-epoch", "4096", "--batch", "256", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [prof_file]


def test_cli_cluster_file_with_unknown_key_exits_2(prof_file, tmp_path):
    cl = get_preset("paper").to_json()
    cl["gpu_mem"] = 5
    cpath = tmp_path / "cluster.json"
    cpath.write_text(json.dumps(cl))
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--cluster", str(cpath), "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "gpu_mem" in r.output
    assert not (tmp_path / "p.json").exists()


def test_cli_corrupt_profile_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "ptplan.profile/1", "model": ')
    r = CliRunner().invoke(cli, ["plan", str(bad), "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "not valid JSON" in r.output


def test_start_K_pins_the_first_phase_and_only_compresses():
    """The paper's mode: start with one pipeline per node (K=8) and compress as blocks freeze."""
    prof = synthetic_profile(num_blocks=12)
    cfg = TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512, start_K=8)
    plan = make_plan(prof, get_preset("paper"), cfg, GEOM)
    assert plan.phases[0].K == 8 and plan.baseline.phase.K == 8
    Ks = [plan.phases[t.phase].K for t in plan.trajectory]
    assert all(k <= 8 for k in Ks) and Ks[-1] < Ks[0]
    assert plan.totals["best_static_seconds"] <= plan.baseline.seconds
    assert plan.totals["speedup"] >= plan.totals["speedup_vs_best_static"]
    with pytest.raises(PtplanError, match="not both"):
        TrainingConfig(epochs=1, samples_per_epoch=8, batch=8, start_K=2, pin_K=2)


# ---- cost-model terms measured on this machine (bench/calibrate.py) ------------------------------
def _cpu_plan(prof, cluster, K: int, M: int):
    return make_plan(prof, cluster, TrainingConfig(epochs=1, samples_per_epoch=256, batch=16, pin_K=K, pin_M=M),
                     FreezePolicy(policy="none")).phases[0]


def test_receive_buffers_count_once_per_micro_batch_on_each_pipelined_stage():
    """torch.distributed.pipelining keeps one activation and one gradient receive buffer per micro-batch."""
    from dataclasses import replace

    prof = synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512)
    cluster = replace(get_preset("cpu:2"), action_overhead_s=0.0, step_overhead_s=0.0, concurrency_slowdown=1.0)
    t = CostTable(prof)
    for M in (2, 8):
        ph = _cpu_plan(prof, cluster, 2, M)
        b = ph.micro_batch_size
        (lo0, hi0), (lo1, hi1) = ph.partition
        boundary = t.out_per_sample[hi0 - 1] * b
        fixed0 = (t.train_state_bytes[lo0:hi0].sum() + M * boundary
                  + min(2, M) * (t.saved_per_sample[lo0:hi0].sum() * b + boundary))
        fixed1 = t.train_state_bytes[lo1:hi1].sum() + M * boundary + (t.saved_per_sample[lo1:hi1].sum()
                                                                      + t.out_per_sample[hi1 - 1]) * b
        assert ph.predicted.stage_peak_memory_bytes == pytest.approx((fixed0, fixed1), abs=4)


def test_optimizer_step_and_framework_overheads_lengthen_the_iteration():
    from dataclasses import replace

    prof = synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512)
    prof_opt = replace(prof, layers=tuple(replace(r, optimizer_s=1e-3) for r in prof.layers))
    bare = replace(get_preset("cpu:2"), action_overhead_s=0.0, step_overhead_s=0.0, concurrency_slowdown=1.0)
    base = _cpu_plan(prof, bare, 2, 4)
    # the optimizer steps after the last backward: the slower stage's step extends the iteration
    with_opt = _cpu_plan(prof_opt, bare, 2, 4)
    assert with_opt.partition == base.partition
    slow = max(hi - lo for lo, hi in base.partition)
    assert with_opt.predicted.iteration_s - base.predicted.iteration_s == pytest.approx(slow * 1e-3, rel=0.35)
    # the step overhead is paid once per step; the action overhead on every F and B of a K>1 pipeline
    step = _cpu_plan(prof, replace(bare, step_overhead_s=0.01), 2, 4)
    assert step.predicted.iteration_s == pytest.approx(base.predicted.iteration_s + 0.01)
    act = _cpu_plan(prof, replace(bare, action_overhead_s=0.01), 2, 4)
    assert act.predicted.iteration_s >= base.predicted.iteration_s + (4 + 1) * 2 * 0.01 - 1e-9  # (M+K-1)(f+b)
    one = _cpu_plan(prof, replace(bare, action_overhead_s=0.01), 1, 4)  # K=1: the runtime's own loop
    assert one.predicted.iteration_s == pytest.approx(_cpu_plan(prof, bare, 1, 4).predicted.iteration_s)


def test_concurrency_slowdown_scales_every_compute_time_not_communication():
    from dataclasses import replace

    prof = synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512)
    bare = replace(get_preset("cpu:2"), action_overhead_s=0.0, step_overhead_s=0.0, concurrency_slowdown=1.0,
                   intra_latency_s=0.0, intra_bandwidth=1e18, inter_latency_s=0.0, inter_bandwidth=1e18)
    base = _cpu_plan(prof, bare, 2, 4)
    slow = _cpu_plan(prof, replace(bare, concurrency_slowdown=1.25), 2, 4)
    assert slow.predicted.iteration_s == pytest.approx(1.25 * base.predicted.iteration_s)
    assert slow.predicted.stage_peak_memory_bytes == base.predicted.stage_peak_memory_bytes
    assert get_preset("cpu:1").concurrency_slowdown == 1.0 < get_preset("cpu:2").concurrency_slowdown
