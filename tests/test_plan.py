"""Plan assembly (planner/planner.py) and `ptplan plan`: structure, totals, the audit's reproductions, errors."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.costs import CostTable
from ptplan.planner.errors import InfeasibleError, PtplanError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.partition import greedy_param_partition, optimal_partition, stage_cost
from ptplan.planner.plan import load_plan, plan_from_json
from ptplan.planner.planner import TrainingConfig, make_plan
from ptplan.planner.profile import load_profile, save_profile
from ptplan.planner.synthetic import synthetic_profile

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted((ROOT / "profiles").glob("*.json"))
GEOM = FreezePolicy(policy="geometric", alpha=1 / 3)
GiB = 2**30


@pytest.fixture(scope="module")
def small_plan():
    prof = synthetic_profile(num_blocks=12)
    cfg = TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512, allow_extrapolation=True)
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
        assert tuple(m.total for m in ph.predicted.stage_memory) == ph.predicted.stage_peak_memory_bytes
    again = plan_from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan  # the JSON contract round-trips exactly, typed inputs included
    assert plan.warnings and {w.code for w in plan.warnings} >= {"synthetic-profile"}


def test_trajectory_and_totals_add_up_with_cache_fills(small_plan):
    _, plan = small_plan
    assert [t.frozen_blocks for t in plan.trajectory] == [0, 4, 7, 9, 10, 11, 11, 12, 12, 12]
    assert plan.freeze_steps == (0, 4, 7, 9, 10, 11, 11, 12)  # cut where the count settles
    assert [plan.frozen_at(T) for T in range(12)] == [0, 4, 7, 9, 10, 11, 11, 12, 12, 12, 12, 12]
    fills = 0.0
    for t in plan.trajectory:
        ph = plan.phases[t.phase]
        assert ph.frozen_blocks == t.frozen_blocks
        pr = ph.predicted
        assert t.seconds == pytest.approx(t.fill_iterations * pr.fill_iteration_s
                                          + (t.iterations - t.fill_iterations) * pr.iteration_s)
        assert t.fill_iterations == 0 or ph.cache
        fills += t.fill_iterations * (pr.fill_iteration_s - pr.iteration_s)
    assert plan.totals.seconds == pytest.approx(sum(t.seconds for t in plan.trajectory))
    assert plan.totals.fill_seconds == pytest.approx(fills)
    assert plan.totals.speedup == pytest.approx(plan.baseline.seconds / plan.totals.seconds)
    assert plan.totals.speedup > 1.2


def test_cached_phase_fills_once_then_reads():
    """A cached phase pays its fill on its first pass over the data only (the audit: fills were never charged)."""
    plan = make_plan(load_profile(ROOT / "profiles/vit-base_cpu_fp32.json"), get_preset("paper"),
                     TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512, start_K=8, cache="on"), GEOM)
    iters = 50_000 // 512
    for f in {t.frozen_blocks for t in plan.trajectory} - {0}:
        runs = [t for t in plan.trajectory if t.frozen_blocks == f]
        assert sum(t.fill_iterations for t in runs) == iters  # one pass, however many epochs the phase lasts
        ph = plan.phase_for(f)
        assert ph.cache and ph.predicted.fill_iteration_s > ph.predicted.iteration_s
    assert plan.totals.fill_seconds > 0


def test_auto_cache_is_never_slower_than_on_or_off():
    prof = load_profile(ROOT / "profiles/vit-base_cpu_fp32.json")
    seconds = {}
    for mode in ("off", "on", "auto"):
        plan = make_plan(prof, get_preset("paper"),
                         TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512, start_K=8, cache=mode), GEOM)
        seconds[mode] = plan.totals.seconds
    assert seconds["auto"] <= min(seconds["on"], seconds["off"]) * (1 + 1e-9)
    assert seconds["auto"] < seconds["off"]  # on this profile caching pays


def test_no_freezing_means_no_speedup():
    prof = synthetic_profile(num_blocks=6)
    plan = make_plan(prof, get_preset("paper"), TrainingConfig(epochs=3, samples_per_epoch=4096, batch=256),
                     FreezePolicy(policy="none"))
    assert [t.frozen_blocks for t in plan.trajectory] == [0, 0, 0]
    assert plan.totals.speedup == pytest.approx(1.0)


def test_step_based_freezing_is_planned_run_by_run():
    """A freeze decision every N optimizer steps: runs inside epochs, and the table a run replays."""
    prof = synthetic_profile(num_blocks=8)
    cfg = TrainingConfig(epochs=3, samples_per_epoch=4096, batch=256)  # 16 steps per epoch
    plan = make_plan(prof, get_preset("paper"), cfg, FreezePolicy(alpha=0.5, every=5))
    assert plan.freeze_steps[:4] == (0, 4, 6, 7)
    assert sum(t.iterations for t in plan.trajectory) == 48
    for t in plan.trajectory:  # a run never crosses a change of the frozen count
        assert {plan.frozen_at(s // 5) for s in range(t.step, t.step + t.iterations)} == {t.frozen_blocks}
    assert len([t for t in plan.trajectory if t.epoch == 0]) == 4  # steps 0-4, 5-9, 10-14, 15


def test_step_based_freezing_cuts_runs_only_where_the_count_changes():
    """The audit's case: a freeze step every optimizer step over 25 M steps. Runs are cut where the frozen
    count changes and at epoch ends, not at every freeze step, so the plan stays small."""
    prof = synthetic_profile(num_blocks=8)
    cfg = TrainingConfig(epochs=10, samples_per_epoch=5_000_000, batch=2)
    plan = make_plan(prof, get_preset("cpu:2"), cfg, FreezePolicy(alpha=0.5, every=1))
    assert sum(t.iterations for t in plan.trajectory) == 10 * 2_500_000
    assert len(plan.trajectory) <= 10 + len(plan.freeze_steps)
    for a, b in zip(plan.trajectory, plan.trajectory[1:]):
        assert a.epoch != b.epoch or a.frozen_blocks != b.frozen_blocks  # neighbours in an epoch differ
    assert len(json.dumps(plan.to_json())) < 200_000


def test_memory_bound_model_pipelines_first_and_compresses_as_blocks_freeze():
    prof = synthetic_profile(num_blocks=24, hidden=4096, batch_sizes=(1, 2, 4))
    cluster = Cluster.uniform(nodes=2, like="dgx-h100")  # 16 x 80 GB
    plan = make_plan(prof, cluster, TrainingConfig(epochs=10, samples_per_epoch=8192, batch=64), GEOM)
    Ks = [plan.phases[t.phase].K for t in plan.trajectory]
    Ds = [plan.phases[t.phase].D for t in plan.trajectory]
    assert Ks[0] > 1
    assert Ks[-1] < Ks[0] and Ds[-1] > Ds[0]


def test_a_19_7B_model_plans_because_cached_phases_hold_no_frozen_weights():
    """The audit's case: frozen weights were charged to stage 0 in cached phases, where the executor holds
    none. With all 61 blocks frozen the prefix alone (77.8 GB fp32) exceeds an 80 GiB GPU's usable
    90 %, so only a cached phase fits there. One node of 8 (the audit's 4 nodes plan the same phases at K = 32,
    whose longer pipelines make this test 12x slower to simulate, not different in what it shows)."""
    prof = synthetic_profile(num_blocks=61, hidden=5120, batch_sizes=(1, 2, 4))
    params = sum(r.params for r in prof.layers)
    assert 19.6e9 < params < 19.8e9
    cluster = Cluster.uniform(nodes=1, like="dgx-h100")
    n0 = prof.frozen_boundary(61)
    assert sum(r.param_bytes for r in prof.layers[:n0]) > 0.9 * cluster.gpu_memory_bytes
    cfg = TrainingConfig(epochs=12, samples_per_epoch=4096, batch=128)
    plan = make_plan(prof, cluster, cfg, GEOM)
    assert plan.trajectory[-1].frozen_blocks == 61
    last = plan.phase_for(61)
    assert last.cache and last.predicted.stage_memory[0].weights < GiB
    # without the AutoCache the prefix does not fit at the last counts: the plan stops freezing there (issue 22;
    # it used to raise InfeasibleError for the whole plan) and says why
    off = make_plan(prof, cluster, replace(cfg, cache="off"), GEOM)
    stopped = [w.message for w in off.warnings if w.code == "freezing-stopped"]
    assert len(stopped) == 1 and off.trajectory[-1].frozen_blocks < 61
    assert re.search(r"(?s)with (59|6[01]) frozen.*frozen prefix holds 7\d\.\d+ GiB", stopped[0]), stopped


def test_pinned_K_applies_where_it_fits_and_says_where_not():
    """The audit: -K was not "when it fits"; a pinned K=8 on ViT-B failed once fewer than 8 layers remained."""
    plan = make_plan(load_profile(ROOT / "profiles/vit-base_cpu_fp32.json"), get_preset("paper"),
                     TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512, pin_K=8), GEOM)
    assert [p.frozen_blocks for p in plan.phases] == list(range(13))
    pinned = [p for p in plan.phases if p.K == 8]
    free = [p for p in plan.phases if p.K != 8]
    assert pinned and free
    assert all(not p.notes for p in pinned) and all(any("pinned K=8" in n for n in p.notes) for p in free)
    assert "pinned-not-possible" in {w.code for w in plan.warnings}


def test_pinned_M_is_obeyed_where_it_splits_the_batch():
    prof = synthetic_profile(num_blocks=8)
    cfg = TrainingConfig(epochs=4, samples_per_epoch=4096, batch=256, pin_K=4, pin_M=8)
    plan = make_plan(prof, get_preset("paper"), cfg, GEOM)
    assert all(p.M == 8 for p in plan.phases if p.K == 4)


def test_more_micro_batches_than_8K_when_memory_needs_them():
    """The audit: M was capped at 8 K. A batch of 256 per pipeline whose activations fit only at b = 1
    needs M = 256 = 64 K on K = 4."""
    prof = synthetic_profile(num_blocks=8, hidden=1024, seq_len=512, batch_sizes=(1, 2, 4, 8))
    t = CostTable(prof)
    per_sample = float(t.saved_per_sample.sum())
    state = float(t.param_bytes.sum()) * 4
    gpu = int((state / 4 + 2.5 * per_sample) / 0.9)  # a quarter of the state and ~2 samples' activations
    cluster = Cluster(name="small", nodes=1, gpus_per_node=4, gpu_memory_bytes=gpu, gpu_name="toy",
                      intra_bandwidth=1e11, intra_latency_s=1e-5, inter_bandwidth=1e10, inter_latency_s=1e-5)
    plan = make_plan(prof, cluster, TrainingConfig(epochs=1, samples_per_epoch=1024, batch=256),
                     FreezePolicy(policy="none"))
    ph = plan.phases[0]
    assert ph.K == 4 and ph.M > 8 * ph.K


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


def test_micro_batch_sizes_stay_in_the_measured_range_unless_allowed():
    """The audit: b = 256 was extrapolated from sizes 1, 2, 4 without a word (predicted -55 %)."""
    prof = synthetic_profile(num_blocks=4, batch_sizes=(1, 2, 4))
    cfg = TrainingConfig(epochs=1, samples_per_epoch=4096, batch=512)
    cpu1 = get_preset("cpu:1")
    plan = make_plan(prof, cpu1, cfg, FreezePolicy(policy="none"))
    assert all(p.micro_batch_size <= 4 for p in plan.phases)
    assert "extrapolated-micro-batch" not in {w.code for w in plan.warnings}
    wide = make_plan(prof, cpu1, replace(cfg, allow_extrapolation=True), FreezePolicy(policy="none"))
    if any(p.micro_batch_size > 4 for p in wide.phases):
        assert "extrapolated-micro-batch" in {w.code for w in wide.warnings}
        assert any("outside the profile's measured 1..4" in n for p in wide.phases for n in p.notes)
    with pytest.raises(InfeasibleError, match="measured 8..16"):  # 7 samples: b = 7 or 1, both unmeasured
        make_plan(synthetic_profile(num_blocks=4, batch_sizes=(8, 16)), cpu1, replace(cfg, batch=7),
                  FreezePolicy(policy="none"))


def test_cpu_profile_for_a_gpu_cluster_warns_in_the_plan_itself():
    prof = load_profile(ROOT / "profiles/bert-tiny_cpu_fp32.json")
    plan = make_plan(prof, get_preset("dgx-h100"), TrainingConfig(epochs=2, samples_per_epoch=1024, batch=64), GEOM)
    assert "cpu-profile-for-gpu-cluster" in {w.code for w in plan.warnings}
    on_cpu = make_plan(prof, get_preset("cpu:2"), TrainingConfig(epochs=2, samples_per_epoch=1024, batch=64), GEOM)
    assert "cpu-profile-for-gpu-cluster" not in {w.code for w in on_cpu.warnings}


@pytest.mark.parametrize("split", [True, False])
def test_zero_bubble_from_a_profile_without_the_backward_split_warns(split):
    """ZB-H1 needs each layer's backward split into B and W; a profile written before ptplan measured it
    plans with W = 0 s, and the plan says so (a projected profile has the split: no warning)."""
    prof = load_profile(ROOT / "profiles" / "bert-base_h100_bf16.json")
    assert all(r.backward_weight_s is not None for r in prof.layers)
    if not split:
        prof = replace(prof, layers=tuple(replace(r, backward_weight_s=None) for r in prof.layers))
    cfg = TrainingConfig(epochs=1, samples_per_epoch=512, batch=64, schedule="zb-h1", pin_K=4, cache="off")
    plan = make_plan(prof, get_preset("dgx-h100"), cfg, FreezePolicy(policy="manual", manual=(0,)))
    assert {p.schedule for p in plan.phases} == {"zb-h1"}
    codes = {w.code for w in plan.warnings}
    assert ("missing-backward-split" in codes) is (not split), codes
    assert "missing-backward-stash" not in codes  # a projected profile records the stash


def test_zero_bubble_from_a_profile_without_the_stash_warns():
    """A profile written before ptplan measured the split backward's stash prices none, and the plan says so."""
    prof = load_profile(ROOT / "profiles" / "bert-base_h100_bf16.json")
    assert any(r.backward_stash_bytes_per_sample for r in prof.layers)
    old = replace(prof, layers=tuple(replace(r, backward_stash_bytes_per_sample=0) for r in prof.layers))
    cfg = TrainingConfig(epochs=1, samples_per_epoch=512, batch=64, schedule="zb-h1", pin_K=4, cache="off")
    plans = {k: make_plan(p, get_preset("dgx-h100"), cfg, FreezePolicy(policy="manual", manual=(0,)))
             for k, p in (("new", prof), ("old", old))}
    assert "missing-backward-stash" in {w.code for w in plans["old"].warnings}
    new, old_ = plans["new"].phases[0], plans["old"].phases[0]
    assert (new.K, new.M, new.micro_batch_size) == (old_.K, old_.M, old_.micro_batch_size) == (4, new.M, new.micro_batch_size)
    # the stash is priced on every position but the first (whose whole backward runs in W)
    a, b = new.predicted.device_peak_memory_bytes, old_.predicted.device_peak_memory_bytes
    assert a[0] == b[0] and all(x > y for x, y in zip(a[1:], b[1:])), (a, b)


def test_cache_beyond_host_memory_is_refused_or_turned_off():
    """The audit: a 2,818 GiB cache was planned against 2,048 GiB of host RAM."""
    prof = synthetic_profile(num_blocks=12, hidden=2048, seq_len=2048, batch_sizes=(1, 2, 4, 8))
    cluster = get_preset("dgx-h100")  # 2 TiB host RAM
    out = prof.layers[3].output_bytes_per_sample
    n = int(2818 * GiB / out)
    cfg = TrainingConfig(epochs=3, samples_per_epoch=n // 64 * 64, batch=64, cache="on")
    with pytest.raises(InfeasibleError, match=r"host memory per node"):
        make_plan(prof, cluster, cfg, GEOM)
    plan = make_plan(prof, cluster, replace(cfg, cache="auto"), GEOM)
    assert not any(p.cache for p in plan.phases)


def test_cli_cache_beyond_host_memory_exits_2_and_writes_nothing(tmp_path):
    """The same case through ``ptplan plan --cache on --report``: one message with the numbers and the fix,
    exit code 2, neither the plan nor the report written."""
    from ptplan.planner.profile import save_profile
    prof = synthetic_profile(num_blocks=12, hidden=2048, seq_len=2048, batch_sizes=(1, 2, 4, 8))
    save_profile(prof, tmp_path / "big.json")
    n = int(2818 * GiB / prof.layers[3].output_bytes_per_sample) // 64 * 64
    out, rep = tmp_path / "plan.json", tmp_path / "report.html"
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "big.json"), "--cluster", "dgx-h100", "--cache", "on",
                                 "--epochs", "3", "--samples-per-epoch", str(n), "--batch", "64", "--out", str(out),
                                 "--report", str(rep)])
    assert r.exit_code == 2, r.output
    assert "host memory per node" in r.output and "GiB" in r.output and "Fix" in r.output, r.output
    assert "Traceback" not in r.output
    assert not out.exists() and not rep.exists()


@pytest.mark.parametrize("bad", [dict(epochs=0), dict(epochs=10**9), dict(samples_per_epoch=10**15), dict(batch=0),
                                 dict(batch_policy="grow"), dict(schedule="zb"), dict(memory_fraction=1.5),
                                 dict(cache="maybe"), dict(optimizer="lamb"), dict(host_read_bandwidth=1e-300)])
def test_training_config_checks(bad):
    args = dict(epochs=2, samples_per_epoch=100, batch=8)
    args.update(bad)
    with pytest.raises(PtplanError):
        TrainingConfig(**args)  # refused by the record itself, before any planning


def test_extreme_but_finite_numbers_are_refused_with_the_field():
    """The audit: times of 1e300 and a bandwidth of 1e-300 reached an AssertionError in the partitioner."""
    prof = synthetic_profile(num_blocks=4)
    huge = replace(prof, layers=tuple(replace(r, forward_s=tuple(1e300 for _ in r.forward_s)) for r in prof.layers))
    with pytest.raises(PtplanError, match=r"forward_s\[0\].*maximum"):
        make_plan(huge, get_preset("paper"), TrainingConfig(epochs=1, samples_per_epoch=512, batch=64), GEOM)
    with pytest.raises(PtplanError, match="intra_bandwidth"):
        replace(get_preset("paper"), intra_bandwidth=1e-300)


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_autopipe_never_worse_than_the_papers_greedy_balancer(path):
    """On every shipped profile, for K in 2..8 and several frozen counts, slowest stage <= greedy's."""
    prof = load_profile(path)
    tm = CostTable(prof).at(prof.batch_sizes[-1])
    compared = 0
    for f in sorted({0, prof.num_blocks // 2, prof.num_blocks - 1}):
        n0 = prof.frozen_boundary(f)
        costs = (tm.fwd + tm.bwd)[n0:]
        extra = float(tm.cum_nograd[n0])
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
    if compared == 0 and prof.model.family == "llama":  # 2 x 262 M of 1.5 B parameters in the embedding and head
        pytest.skip("the paper's greedy parameter balancer leaves a stage empty at every K here")
    assert compared > 0


def test_start_K_pins_the_first_phase_and_only_compresses():
    prof = synthetic_profile(num_blocks=12)
    cfg = TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512, start_K=8, allow_extrapolation=True)
    plan = make_plan(prof, get_preset("paper"), cfg, GEOM)
    assert plan.phases[0].K == 8 and plan.baseline.phase.K == 8
    Ks = [plan.phases[t.phase].K for t in plan.trajectory]
    assert all(k <= 8 for k in Ks) and Ks[-1] < Ks[0]
    assert plan.totals.best_static_seconds <= plan.baseline.seconds
    assert plan.totals.speedup >= plan.totals.speedup_vs_best_static
    with pytest.raises(PtplanError, match="not both"):
        TrainingConfig(epochs=1, samples_per_epoch=8, batch=8, start_K=2, pin_K=2)


# ---- CLI -------------------------------------------------------------------------------------
@pytest.fixture()
def prof_file(tmp_path):
    path = tmp_path / "syn.json"
    save_profile(synthetic_profile(num_blocks=6, batch_sizes=(1, 2, 4, 8, 16, 32)), path)
    return path


def test_cli_plan_writes_plan_and_prints_table(prof_file, tmp_path):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--cluster", "paper", "--epochs", "4",
                                 "--samples-per-epoch", "4096", "--batch", "256", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "predicted speedup" in r.output and "layers per stage" in r.output and "iteration" in r.output
    plan = load_plan(out)
    assert len(plan.phases) == 7 and len(plan.trajectory) == 4


def test_cli_cache_auto_and_on_work(prof_file, tmp_path):
    """The audit: `ptplan plan --cache auto` crashed on every input (a numpy bool reached json.dumps)."""
    for mode in ("auto", "on", "off"):
        out = tmp_path / f"plan-{mode}.json"
        r = CliRunner().invoke(cli, ["plan", str(prof_file), "--cache", mode, "--epochs", "4",
                                     "--samples-per-epoch", "4096", "--batch", "256", "--out", str(out)])
        assert r.exit_code == 0, r.output
        assert load_plan(out).inputs.training.cache == mode


def test_cli_warnings_survive_quiet(tmp_path):
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "dgx-h100", "--batch", "64", "--epochs", "2",
                                 "--samples-per-epoch", "1024", "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "warning:" in r.output and "CPU" in r.output and "layers per stage" not in r.output


def test_cli_finds_a_shipped_profile_by_model_name(tmp_path):
    r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "cpu:2", "--batch", "8", "--epochs", "2",
                                 "--samples-per-epoch", "64", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert load_plan(tmp_path / "p.json").inputs.profile.model == "bert-tiny"
    assert "CPU process" in r.output and "GPUs" not in r.output.split("\n")[0]


def test_cli_help_lists_presets_and_profiles():
    r = CliRunner().invoke(cli, ["plan", "--help"])
    assert r.exit_code == 0 and "dgx-h100" in r.output and "cpu:N" in r.output
    assert "vit-base" in r.output and "cpu_fp32" in r.output and "h100_bf16 (projected)" in r.output


@pytest.mark.parametrize("args,needle", [
    (["--alpha", "1.5"], "alpha"),
    (["--alpha", "0"], "alpha"),
    (["--batch", "7"], "does not split"),
    (["--cluster", "nosuch"], "unknown cluster preset"),
    (["--freeze", "manual"], "--manual"),
    (["--freeze", "manual", "--manual", "0,3,2"], "non-decreasing"),
    (["--epochs", "1000000000"], "epochs"),
    (["--freeze-every", "0"], "every"),
])
def test_cli_plan_bad_input_exits_2_and_writes_nothing(prof_file, tmp_path, args, needle):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--out", str(out), "--epochs", "3",
                                 "--samples-per-epoch", "4096", "--batch", "256", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert list(tmp_path.iterdir()) == [prof_file]


def test_cli_outputs_never_overwrite_inputs_and_come_all_or_none(prof_file, tmp_path):
    before = prof_file.read_bytes()
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--out", str(prof_file)])
    assert r.exit_code == 2 and "also an input" in r.output
    assert prof_file.read_bytes() == before
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--out", str(tmp_path / "p.json"), "--report",
                                 str(tmp_path / "nosuchdir" / "r.html")])
    assert r.exit_code == 2 and "does not exist" in r.output
    assert not (tmp_path / "p.json").exists()


def test_cli_cluster_file_with_unknown_key_exits_2(prof_file, tmp_path):
    cl = get_preset("paper").to_json()
    cl["gpu_mem"] = 5
    cpath = tmp_path / "cluster.json"
    cpath.write_text(json.dumps(cl))
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--cluster", str(cpath), "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "gpu_mem" in r.output
    assert not (tmp_path / "p.json").exists()


def test_cli_extreme_cluster_numbers_exit_2(prof_file, tmp_path):
    cl = get_preset("paper").to_json()
    cl["inter_bandwidth"] = 1e-300
    cpath = tmp_path / "cluster.json"
    cpath.write_text(json.dumps(cl))
    r = CliRunner().invoke(cli, ["plan", str(prof_file), "--cluster", str(cpath), "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "inter_bandwidth" in r.output and "Traceback" not in r.output


def test_cli_corrupt_profile_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "ptplan.profile/1", "model": ')
    r = CliRunner().invoke(cli, ["plan", str(bad), "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "not valid JSON" in r.output


@pytest.mark.parametrize("args", [["plan", "{bin}", "--out", "{tmp}/p.json"],
                                  ["plan", "bert-tiny", "--cluster", "{bin}", "--out", "{tmp}/p.json"],
                                  ["show", "{bin}", "--out", "{tmp}/r.html"], ["ablate", "{bin}"],
                                  ["run", "{bin}", "--dry-run"]],
                         ids=["profile", "cluster", "plan-show", "ablate", "plan-run"])
def test_a_binary_file_given_as_json_is_one_message_not_a_traceback(tmp_path, args):
    """Every JSON input goes through ``jsonio.read_json``: a file that is not UTF-8 (a train.pt passed as the plan)
    was a UnicodeDecodeError traceback, exit 1."""
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00PK")
    r = CliRunner().invoke(cli, [a.format(bin=tmp_path / "bin.json", tmp=tmp_path) for a in args])
    assert r.exit_code == 2 and "is not a JSON text file: byte 0 (0xff) is not UTF-8" in r.output, r.output
    assert r.output.count("\n") == 1 and not (tmp_path / "p.json").exists() and not (tmp_path / "r.html").exists()


def test_phase_rank_tables_are_memoised_per_links_object():
    """``planner._phase_ranks`` builds a phase's rank table once per pipeline shape (4,096 ranks x 385
    phases were rebuilt per phase): the memoised table equals one built afresh, for every K and tp, asked
    again or for another Links object of the same shape."""
    import numpy as np

    from ptplan.planner import planner as pl
    from ptplan.planner.stage import links_for

    cl = Cluster.uniform(nodes=4, gpus_per_node=8, like="dgx-h100")
    for K in (1, 2, 4, 8, 32):
        for tp in (1, 2, 8):
            links = links_for(cl, K)
            fresh = tuple(tuple(int(r) * tp for r in row) for row in links.ranks)
            for again in (links, links, links_for(cl, K)):
                got = pl._phase_ranks(again, tp)
                assert got == fresh and all(type(r) is int for row in got for r in row)
    pl._RANKS.clear()
    assert pl._phase_ranks(links_for(cl, 4), 2) == tuple(map(tuple, (np.asarray(links_for(cl, 4).ranks) * 2).tolist()))
    odd = replace(links_for(cl, 4), ranks=tuple(tuple(np.int64(r) for r in row) for row in links_for(cl, 4).ranks))
    got = pl._phase_ranks(odd, 1)  # numpy ranks become plain ints
    assert got == links_for(cl, 4).ranks and all(type(r) is int for row in got for r in row)


@pytest.mark.parametrize("args, message", [
    (["-K", "3"], "-K 3 fits no phase: a pipeline length must divide the 2 GPUs and be at most the model's 11 layers; "
                  "valid: 1, 2"),
    (["-K", "99"], "-K 99 fits no phase"),
    (["-M", "100000"], "-M 100000 fits no phase: M micro-batches must divide a pipeline's batch (256, 512 samples"),
    (["-M", "3"], "-M 3 fits no phase"),
])
def test_a_pin_no_phase_can_take_is_refused_before_the_search(tmp_path, args, message):
    """-K 3 on 2 GPUs (or -M over the batch) was accepted: every phase noted "pinned ... not possible; chosen freely"
    and the plan ran (a CLI audit). A pin that fits no phase is now refused like --start-K (``check_pins``)."""
    r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "cpu:2", *args, "--epochs", "2", "--out",
                                 str(tmp_path / "p.json"), "--quiet"])
    assert r.exit_code == 2 and message in r.output and r.output.count("\n") == 1, r.output
    assert not (tmp_path / "p.json").exists()


def test_cache_on_with_freeze_none_is_refused(tmp_path):
    """--cache on caches the frozen prefix; with --freeze none there is none (a CLI audit: accepted, no note)."""
    args = ["plan", "bert-tiny", "--cluster", "cpu:2", "--freeze", "none", "--out", str(tmp_path / "p.json")]
    r = CliRunner().invoke(cli, args + ["--cache", "on"])
    assert r.exit_code == 2 and "--cache on caches the frozen prefix's outputs, but --freeze none never freezes" \
        in r.output, r.output
    assert not (tmp_path / "p.json").exists()
    r = CliRunner().invoke(cli, args + ["--cache", "off", "--quiet"])
    assert r.exit_code == 0, r.output
