"""Strategies per pipeline stage (issue 14): each stage of a phase chooses FSDP and recomputation on its own
(``stage.StageChoice`` inside the exact split), checked against brute force over every split x every per-stage
assignment; the search's bounds stay below the simulation; a memory-bound case picks a mixed phase strictly
faster than the best uniform one, through ``ptplan plan`` (table, JSON, report) and ``ptplan run --dry-run``;
the plan contract stores per-stage lists, loads old plans unchanged and names the field of a bad list."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import numpy as np
import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.costs import CostTable
from ptplan.planner.errors import InfeasibleError, PtplanError
from ptplan.planner.jsonio import SchemaError
from ptplan.planner.partition import split_stages
from ptplan.planner.plan import load_plan, save_plan
from ptplan.planner.schedule import peak_inflight
import ptplan.planner.search as search_mod
from ptplan.planner.search import Choice, PhaseSearch, Visit, exhaustive
from ptplan.planner.stage import PhaseShape, StageChoice, StageModel, links_for
from ptplan.planner.strategy import Strategy, tp_allreduce_coeffs
from ptplan.planner.synthetic import synthetic_profile
from ptplan.planner.candidate import seconds_per_sample
from ptplan.planner.simulate import simulate
from tests.test_resplit import assignments
from tests.test_stage import random_profile

OPTIONS = [(False, False), (False, True), (True, False), (True, True)]
"""(fsdp, recompute) of the four strategies a stage chooses from, simplest first."""
LAYERWISE_OPTIONS = [(False, False, 0), (False, True, 1), (False, True, 2), (False, True, 0), (True, False, 0),
                     (True, True, 1), (True, True, 0)]
"""(fsdp, recompute, recomputed layers) with Galvatron's layer-wise choice: the first 1 or 2 layers, or all."""


def _models(prof, cluster, *, K, M, b, D, n0, schedule="1f1b", tp=1, optimizer="adamw", options=OPTIONS):
    out = []
    for fs, rc, *r in options:
        shape = PhaseShape(K=K, M=M, b=b, D=D, frozen=n0, cache=False, inflight=peak_inflight(schedule, K, M),
                           optimizer=optimizer, tp=tp, fsdp=fs, recompute=rc, recompute_layers=r[0] if r else 0,
                           tp_ar=tp_allreduce_coeffs(cluster, tp),
                           device_is_host=cluster.device_is_host, action_overhead_s=cluster.action_overhead_s)
        out.append(StageModel(CostTable(prof), shape, links_for(cluster, K)))
    return out


def _one(model, s, lo, hi):
    t, m = model.evaluate(s, model.prepare(np.array([lo]), np.array([hi])))
    return float(np.asarray(t).reshape(-1)[0]), float(np.asarray(m).reshape(-1)[0])


@pytest.mark.parametrize("seed", range(6))
def test_per_stage_choice_is_the_best_over_every_split_and_every_assignment(seed):
    """Brute force: every contiguous split into K stages x every assignment of the 4 strategies (odd seeds: 7,
    with recomputing only the first 1 or 2 layers) to its stages, the least slowest stage among those whose
    every stage fits. ``split_stages`` over a
    ``StageChoice`` gives the same bottleneck (or both find nothing that fits), and the choice it records
    per stage fits and reaches it."""
    rng = random.Random(700 + seed)
    compared = infeasible = mixed = 0
    for _ in range(10):
        prof = random_profile(rng, rng.randint(2, 4))
        cluster = rng.choice([get_preset("paper"), Cluster.uniform(nodes=2, gpus_per_node=4), get_preset("cpu:4")])
        n0 = prof.frozen_boundary(rng.randint(0, 1))
        n = prof.num_layers
        K = rng.choice([k for k in (2, 4) if k <= n - n0])
        M = rng.choice([K, 2 * K, 8])
        layerwise = seed % 2 == 1  # odd seeds: the stages also choose how many first layers to recompute
        models = _models(prof, cluster, K=K, M=M, b=rng.choice([1, 2, 4]), D=cluster.world_size // K, n0=n0,
                         schedule=rng.choice(["1f1b", "gpipe"]), optimizer=rng.choice(["adamw", "sgd"]),
                         options=LAYERWISE_OPTIONS if layerwise else OPTIONS)
        one = {}
        for s, lo in itertools.product(range(K), range(n0, n)):
            for hi in range(lo + 1, n + 1):
                one[s, lo, hi] = [_one(m, s, lo, hi) for m in models]
        # a limit between the least and the largest peak any assignment of any split needs, so it binds
        peaks = sorted(max(min(x[1] for x in one[s, lo, hi]) for s, (lo, hi) in enumerate(zip(c[:-1], c[1:])))
                       for c in ([n0, *cuts, n] for cuts in itertools.combinations(range(n0 + 1, n), K - 1)))
        limit = rng.uniform(peaks[0] * 0.98, peaks[-1] * 1.3)
        best = np.inf
        for cuts in itertools.combinations(range(n0 + 1, n), K - 1):
            c = [n0, *cuts, n]
            stages = [one[s, lo, hi] for s, (lo, hi) in enumerate(zip(c[:-1], c[1:]))]
            for pick in itertools.product(range(len(models)), repeat=K):  # every per-stage assignment
                if all(st[i][1] <= limit * (1 + 1e-12) for st, i in zip(stages, pick)):
                    best = min(best, max(st[i][0] for st, i in zip(stages, pick)))
        fam = StageChoice(models, limit)
        if not np.isfinite(best):
            with pytest.raises(InfeasibleError):
                split_stages(fam, K, limit)
            infeasible += 1
            continue
        part = split_stages(fam, K, limit)
        assert part.bottleneck == pytest.approx(best, rel=1e-12), (seed, K, limit)
        picks = fam.choose(part.ranges)
        for s, ((lo, hi), i) in enumerate(zip(part.ranges, picks)):
            t, mem = one[s, lo, hi][i]
            assert mem <= limit * (1 + 1e-12) and t <= best * (1 + 1e-12)
            # the fastest that fits, the simplest on a tie
            assert all(one[s, lo, hi][j][1] > limit * (1 + 1e-12) or one[s, lo, hi][j][0] > t
                       or (one[s, lo, hi][j][0] == t and j >= i) for j in range(len(models)))
        costs, mem = fam.stage_costs(part.ranges), fam.stage_memory(part.ranges)
        for s, i in enumerate(picks):  # per stage, exactly what the chosen model alone gives
            assert costs[s] == models[i].stage_costs(part.ranges)[s]
            assert mem[s] == models[i].stage_memory(part.ranges)[s]
        # (a stage no longer than its recomputed layer count recomputes them all: recompute_layers 0)
        assert fam.stage_strategies(part.ranges) == tuple(models[i].stage_strategies(part.ranges)[s]
                                                          for s, i in enumerate(picks))
        mixed += len(set(picks)) > 1
        compared += 1
    assert compared >= 5 and infeasible + compared == 10
    print(f"seed {seed}: {compared} compared ({mixed} with mixed stages), {infeasible} infeasible")


def _squeezed(rng: random.Random):
    """A random small case on 4 toy devices whose memory makes some stages need recomputation or FSDP."""
    prof = random_profile(rng, rng.randint(3, 5))
    mem = rng.choice([2, 3, 4, 6, 8, 12]) << 20
    cluster = Cluster(name="small", nodes=1, gpus_per_node=4, gpu_memory_bytes=mem, gpu_name="toy",
                      intra_bandwidth=1e9, intra_latency_s=1e-5, inter_bandwidth=1e9, inter_latency_s=1e-5,
                      host_memory_bytes=64 << 30)
    cfg = TrainingConfig(epochs=2, samples_per_epoch=128, batch=rng.choice([16, 32]),
                         schedule=rng.choice(["1f1b", "gpipe", "auto"]), optimizer=rng.choice(["adamw", "sgd"]),
                         cache=rng.choice(["off", "auto"]), allow_extrapolation=True)
    return prof, cluster, cfg


@pytest.mark.parametrize("seed", range(3))
def test_search_with_per_stage_choices_picks_what_exhaustive_simulation_picks_and_bounds_hold(seed):
    """Squeezed memory, so that stages choose differently: every bound of a per-stage candidate stays below
    its simulation, and the bounded search picks what splitting and simulating every candidate picks."""
    rng = random.Random(900 + seed)
    checked = compared = mixed = 0
    for _ in range(8):
        prof, cluster, cfg = _squeezed(rng)
        s = PhaseSearch(prof, cluster, cfg, strategies="auto")
        f = rng.randint(0, prof.num_blocks - 1)
        n0 = prof.frozen_boundary(f)
        visit = Visit(samples=float(cfg.samples_per_epoch), fill_from=0)
        for c in s.candidates(f, n0)[0]:
            if not c.per_stage:
                continue
            got = s.evaluate(c, n0, visit)
            if not isinstance(got, Choice):
                continue
            sim = got.sim.iteration_s
            assert s.lower_bound(c, n0) <= sim * (1 + 1e-9), c
            assert s.split_bound(c, got.costs) <= sim * (1 + 1e-9), c
            assert s.objective_bound(c, n0, visit) <= got.objective * (1 + 1e-9), c
            assert len(got.strategies) == c.S and all(st in s.stage_options(c, n0) for st in got.strategies)
            mixed += len(set(got.strategies)) > 1
            checked += 1
        ref = exhaustive(PhaseSearch(prof, cluster, cfg, strategies="auto"), f, visit)
        if ref is None:
            with pytest.raises(InfeasibleError):
                PhaseSearch(prof, cluster, cfg, strategies="auto").search(f, visit)
            continue
        got = PhaseSearch(prof, cluster, cfg, strategies="auto").search(f, visit)
        assert (got.cand, got.ranges, got.strategies) == (ref.cand, ref.ranges, ref.strategies), (seed, f)
        compared += 1
    print(f"seed {seed}: {checked} per-stage candidates checked ({mixed} mixed), {compared} searches compared")
    assert checked >= 20 and mixed >= 1 and compared >= 3


def _toy(mem_mib: int) -> Cluster:
    return Cluster(name="toy4", nodes=1, gpus_per_node=4, gpu_memory_bytes=mem_mib << 20, gpu_name="toy",
                   intra_bandwidth=50e9, intra_latency_s=1e-5, inter_bandwidth=50e9, inter_latency_s=1e-5,
                   host_memory_bytes=64 << 30)


def _uniform_only(s: PhaseSearch) -> PhaseSearch:
    s.modes = tuple(m for m in s.modes if 2 not in m[1:])
    return s


def test_memory_bound_case_picks_a_mixed_phase_strictly_faster_than_every_uniform_one(monkeypatch):
    """An activation-heavy model (hidden 512, 1,024 tokens) on 4 devices of 800 MiB: in 1F1B stage 0 of
    K=2 keeps 2 micro-batches in flight and needs recomputation, the last stage does not. The per-stage
    search gives stage 0 more layers with recomputation and the last stage none (rc | dp); the best
    uniform phase recomputes everywhere."""
    prof = synthetic_profile(num_blocks=8, hidden=512, seq_len=1024, vocab=1024, batch_sizes=(1, 2, 4, 8))
    cfg = TrainingConfig(epochs=1, samples_per_epoch=256, batch=32)
    got = PhaseSearch(prof, _toy(800), cfg, strategies="auto").search(0, Visit(samples=256.0))
    uni = _uniform_only(PhaseSearch(prof, _toy(800), cfg, strategies="auto")).search(0, Visit(samples=256.0))
    labels = [st.label for st in got.strategies]
    assert labels == ["rc", "dp"] and got.cand.K == 2, (labels, got.cand)
    assert all(len(set(u.strategies)) == 1 for u in [uni])
    assert uni.cand.recompute  # the uniform one must recompute on every stage to fit
    assert got.objective < uni.objective / 1.1, (got.objective, uni.objective)  # measured 1.17x
    peak = max(m.total for m in got.memory)
    assert peak <= 800 * 2**20 * cfg.memory_fraction
    # K pinned to 4, 900 MiB: only stage 0 (4 micro-batches in flight) recomputes, and only its first 2 of 5
    # layers (Galvatron's layer-wise choice); recomputing whole stages, the same stage 0 recomputes all of its
    # 4 layers (measured 1.590 vs 1.725 ms per sample; uniform 1.894)
    cfg4 = dataclasses.replace(cfg, pin_K=4)
    got4 = PhaseSearch(prof, _toy(900), cfg4, strategies="auto").search(0, Visit(samples=256.0))
    uni4 = _uniform_only(PhaseSearch(prof, _toy(900), cfg4, strategies="auto")).search(0, Visit(samples=256.0))
    assert [st.label for st in got4.strategies] == ["rc2", "dp", "dp", "dp"], got4.label
    monkeypatch.setattr(search_mod, "LAYERWISE", ())
    whole4 = PhaseSearch(prof, _toy(900), cfg4, strategies="auto").search(0, Visit(samples=256.0))
    assert [st.label for st in whole4.strategies] == ["rc", "dp", "dp", "dp"], whole4.label
    assert got4.objective < whole4.objective / 1.05 < uni4.objective / 1.05


def _eight(rng: random.Random):
    """A random small case on 8 toy devices (one or two nodes; D = 2 or 4 replicas at K = 4 or 2) whose memory
    makes some stages need recomputation or FSDP."""
    prof = random_profile(rng, rng.randint(2, 4))
    mem = rng.choice([4, 8, 16, 32, 64]) << 20
    nodes = rng.choice([1, 2])
    cluster = Cluster(name="small", nodes=nodes, gpus_per_node=8 // nodes, gpu_memory_bytes=mem, gpu_name="toy",
                      intra_bandwidth=rng.choice([1e9, 1e10]), intra_latency_s=1e-5, inter_bandwidth=1e9,
                      inter_latency_s=1e-5, host_memory_bytes=64 << 30)
    cfg = TrainingConfig(epochs=2, samples_per_epoch=128, batch=rng.choice([16, 32, 64]),
                         schedule=rng.choice(["1f1b", "gpipe", "zb-h1"]), optimizer=rng.choice(["adamw", "sgd"]),
                         cache=rng.choice(["off", "auto"]), allow_extrapolation=True)
    return prof, cluster, cfg


@pytest.mark.parametrize("seed", [14, 19, 34])
def test_each_stages_strategy_minimises_the_simulated_iteration(seed, monkeypatch):
    """Every per-stage candidate (K = 2..4) of random 8-device cases: its objective is the least over every split x
    every assignment of the 4 strategies to its stages, each simulated one by one (issue 22, item 4). Each stage's
    fastest busy time that fits (``StageChoice``'s choice for the partitioner) lost here by up to 2.3 % (seed 14:
    1F1B, K = 4, the AutoCache; 8 of 2,098 candidates over 40 seeds): FSDP on stage 0 removes the all-reduce and
    shards the optimizer step that end a flushed iteration. The choice's stage costs are the chosen models'."""
    monkeypatch.setattr(search_mod, "LAYERWISE", ())  # 4 strategies a stage: 4^4 assignments of each split
    rng = random.Random(5000 + seed)
    prof, cluster, cfg = _eight(rng)
    s = PhaseSearch(prof, cluster, cfg, strategies="auto")
    f = rng.randint(0, prof.num_blocks - 1)
    n0 = prof.frozen_boundary(f)
    visit = Visit(samples=float(cfg.samples_per_epoch), fill_from=0)
    compared = fsdp = 0
    for c in s.candidates(f, n0)[0]:
        if not c.per_stage or not 2 <= c.K <= 4:
            continue
        got = s.evaluate(c, n0, visit)
        if not isinstance(got, Choice):
            continue
        model, limit = s.model(c, n0), s.stage_limit(c, n0) * (1 + 1e-12)
        best = math.inf
        for inner in itertools.combinations(range(n0 + 1, s.n), c.S - 1):
            ranges = tuple(zip([n0, *inner], [*inner, s.n]))
            for costs, fill_costs in assignments(model, ranges, limit, fill=c.cache):
                steady = simulate(s.schedule(c), costs, step_overhead_s=cluster.step_overhead_s).iteration_s
                fill = simulate(s.schedule(c), fill_costs, step_overhead_s=cluster.step_overhead_s
                                ).iteration_s if c.cache else steady
                best = min(best, seconds_per_sample(c, steady, fill, visit, cfg.samples_per_epoch))
        assert got.objective == pytest.approx(best, rel=1e-12), (c.tag, got.objective / best)
        for st, (cost, mem) in enumerate(zip(got.costs, got.memory)):  # each stage: its chosen model's own numbers
            assert any(m.stage_strategies(got.ranges)[st] == got.strategies[st]
                       and m.stage_costs(got.ranges)[st] == cost and m.stage_memory(got.ranges)[st] == mem
                       for m in model.models), (c.tag, st)
        fsdp += got.strategies[0].fsdp and not all(x.fsdp for x in got.strategies)
        compared += 1
    assert compared >= 3 and fsdp >= 1, (compared, fsdp)


def test_strategies_off_has_no_per_stage_candidates_and_auto_adds_them():
    prof = synthetic_profile(num_blocks=4, hidden=256, seq_len=64, vocab=1024)
    cfg = TrainingConfig(epochs=1, samples_per_epoch=256, batch=32)
    off = PhaseSearch(prof, _toy(800), cfg)
    auto = PhaseSearch(prof, _toy(800), cfg, strategies="auto")
    assert off.modes == ((1, 0, 0, False),) and all(not c.per_stage for c in off.candidates(0, 0)[0])
    cands = auto.candidates(0, 0)[0]
    modes = {(c.mode, c.D > 1) for c in cands}
    # every uniform strategy; per stage: both, or rc with FSDP on every stage (D > 1), or rc alone (D = 1)
    assert {m for m, many in modes if many} == {(0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (1, 2)}
    assert {m for m, many in modes if not many} == {(0, 0), (0, 1), (0, 2)}  # nothing to shard over at D = 1
    c = next(c for c in cands if c.fsdp_per_stage and c.recompute_per_stage)
    assert c.options == tuple(Strategy(tp=c.tp, fsdp=f, recompute=r) for f, r in OPTIONS)


# ---- the CLI and the plan contract ------------------------------------------------------------------
SMALL = ["--batch", "64", "-K", "2", "--samples-per-epoch", "256", "--epochs", "2", "--cache", "off"]


@pytest.fixture(scope="module")
def bert_small(tmp_path_factory):
    """The shipped bert-tiny CPU profile planned for 4 processes of 8 MiB each, K pinned to 2."""
    d = tmp_path_factory.mktemp("per_stage")
    cl = dataclasses.replace(get_preset("cpu:4"), name="cpu4-8MiB", gpu_memory_bytes=8 << 20)
    (d / "cluster.json").write_text(json.dumps(cl.to_json()))
    prof = "profiles/bert-tiny_cpu_fp32.json"
    res = CliRunner().invoke(cli, ["plan", prof, "--cluster", str(d / "cluster.json"), *SMALL, "--strategies", "auto",
                                   "--out", str(d / "auto.json"), "--report", str(d / "auto.html")])
    return d, res


def test_plan_prints_and_stores_per_stage_strategies_and_run_accepts_them(bert_small):
    d, res = bert_small
    assert res.exit_code == 0, res.output
    plan = load_plan(d / "auto.json")
    ph = plan.phases[0]
    assert ph.K == 2 and ph.mixed and ph.stage_recompute == (True, False) and not ph.any_fsdp, ph.strategy_label
    assert ph.strategy_label == "stages rc | dp"
    raw = json.loads((d / "auto.json").read_text())["phases"][0]
    assert raw["recompute"] == [True, False] and raw["fsdp"] is False  # per-stage list only where stages differ
    assert "stages rc | dp" in res.output  # the table's strategy column
    html = (d / "auto.html").read_text()
    assert "stages rc | dp" in html and "activation recomputation on stage 0" in html
    # the same plan checked by `ptplan run` before launch (workers, model, strategies)
    r = CliRunner().invoke(cli, ["run", str(d / "auto.json"), "--model", "bert-tiny", "--nproc-per-node", "4",
                                 "--dry-run"])
    assert r.exit_code == 0, r.output


def test_per_stage_lists_round_trip_old_plans_load_and_bad_lists_name_the_field(bert_small, tmp_path):
    d, _ = bert_small
    plan = load_plan(d / "auto.json")
    save_plan(plan, tmp_path / "again.json")
    assert load_plan(tmp_path / "again.json").phases == plan.phases
    raw = json.loads((d / "auto.json").read_text())

    def bad(edit, match):
        obj = json.loads(json.dumps(raw))
        edit(obj["phases"][0])
        (tmp_path / "bad.json").write_text(json.dumps(obj))
        with pytest.raises(SchemaError, match=match):
            load_plan(tmp_path / "bad.json")
        r = CliRunner().invoke(cli, ["show", str(tmp_path / "bad.json"), "--out", str(tmp_path / "bad.html")])
        assert r.exit_code == 2 and "phases[0]" in r.output, r.output
        r = CliRunner().invoke(cli, ["run", str(tmp_path / "bad.json"), "--model", "bert-tiny", "--nproc-per-node", "4",
                                     "--dry-run"])
        assert r.exit_code == 2 and "phases[0]" in r.output, r.output

    bad(lambda ph: ph.update(recompute=[True]), r"phases\[0\]\.recompute'.*1 entries for K\*V=2 stages")
    bad(lambda ph: ph.update(recompute=[True, 1]), r"phases\[0\]\.recompute\[1\]'.*true/false")
    bad(lambda ph: ph.update(fsdp="yes"), r"phases\[0\]\.fsdp'.*true/false or a list")
    bad(lambda ph: ph.update(fsdp=[True, False], D=1, ranks=[[0, 1]]), r"phases\[0\]\.(fsdp|ranks)")
    bad(lambda ph: ph.update(recompute_layers=[1]), r"phases\[0\]\.recompute_layers'.*1 entries for K\*V=2")
    bad(lambda ph: ph.update(recompute_layers=[0, 1]), r"phases\[0\]\.recompute_layers\[1\]'.*does not recompute")
    bad(lambda ph: ph.update(recompute_layers=[4, 0]), r"phases\[0\]\.recompute_layers\[0\]'.*has 4 layers")
    bad(lambda ph: ph.update(recompute_layers=[-1, 0]), r"phases\[0\]\.recompute_layers\[0\]'.*>= 0")
    # a stage recomputing only its first layers round-trips; plans without the field load with 0 everywhere
    obj = json.loads(json.dumps(raw))
    obj["phases"][0]["recompute_layers"] = [2, 0]
    (tmp_path / "lw.json").write_text(json.dumps(obj))
    ph = load_plan(tmp_path / "lw.json").phases[0]
    assert ph.recompute_layers_at(0) == 2 and ph.strategy_label == "stages rc2 | dp"
    save_plan(load_plan(tmp_path / "lw.json"), tmp_path / "lw2.json")
    assert json.loads((tmp_path / "lw2.json").read_text())["phases"][0]["recompute_layers"] == [2, 0]
    assert not any("recompute_layers" in p for p in raw["phases"])  # written only where a stage uses it
    # an old plan (one bool per phase) loads unchanged; an all-equal list is the same as its one value
    obj = json.loads(json.dumps(raw))
    obj["phases"][0]["recompute"] = True
    (tmp_path / "old.json").write_text(json.dumps(obj))
    assert load_plan(tmp_path / "old.json").phases[0].recompute is True
    obj["phases"][0]["recompute"] = [False, False]
    (tmp_path / "eq.json").write_text(json.dumps(obj))
    ph = load_plan(tmp_path / "eq.json").phases[0]
    assert ph.recompute is False and not ph.mixed and ph.strategy_label == "dp"


def test_phase_accessors_and_labels(bert_small):
    plan = load_plan(bert_small[0] / "auto.json")
    ph = dataclasses.replace(plan.phases[0], K=4, D=1, V=1, tp=2, fsdp=(True, True, False, False),
                             recompute=(True, False, False, False))
    assert ph.fsdp_at(0) and not ph.fsdp_at(3) and ph.recompute_at(0) and not ph.recompute_at(1)
    assert ph.any_fsdp and ph.any_recompute and ph.mixed
    assert ph.stage_label(0) == "fsdp·rc" and ph.stage_label(2) == "dp"
    assert ph.strategy_label == "tp2 · stages fsdp·rc | fsdp | dp×2"
    uniform = dataclasses.replace(ph, fsdp=(False,) * 4, recompute=(True,) * 4)
    assert uniform.fsdp is False and uniform.recompute is True and uniform.strategy_label == "tp2·rc"
    with pytest.raises(PtplanError, match="one per stage"):
        dataclasses.replace(ph, fsdp=(True, False))



def test_run_check_accepts_layerwise_recomputation_in_every_schedule(bert_small):
    """``ptplan run``'s check: a stage recomputing its first layers runs with every schedule, PipeDream-2BW's own
    loop included (it was refused there until its rerun bound the micro-batch's weight version:
    ``tests/test_twobw.py``)."""
    from ptplan.executor.training.validate import check_strategies

    plan = load_plan(bert_small[0] / "auto.json")
    lw = dataclasses.replace(plan.phases[0], recompute_layers=(2, 0))
    check_strategies(dataclasses.replace(plan, phases=(lw, *plan.phases[1:])))
    two_bw = dataclasses.replace(lw, schedule="2bw")
    check_strategies(dataclasses.replace(plan, phases=(two_bw, *plan.phases[1:])))


@pytest.mark.parametrize("seed", range(4))
def test_best_assignments_branch_and_bound_equals_every_assignment_simulated(seed, monkeypatch):
    """``assign.best_assignments`` on random stage times (3 models, 4 stages, random fits, the AutoCache's fill in
    half the cases), with ``MAX_COLUMNS`` at 27 so that it bounds and branches stage by stage rather than listing
    the 81 assignments (at least 3 of 30 cases branch and end proven): where it says proven, its least entry is the
    least over every split and every fitting assignment simulated one by one, and each entry is what its assignment
    simulates to."""
    import ptplan.planner.assign as assign
    from ptplan.planner.schedule import build_schedule
    from ptplan.planner.simulate import StageTimes, iterations

    monkeypatch.setattr(assign, "MAX_COLUMNS", 27)
    rng = np.random.default_rng(seed)
    proven = 0
    for trial in range(30):
        name = ["1f1b", "gpipe", "zb-h1", "interleaved-1f1b"][trial % 4]
        K, V = (2, 2) if name == "interleaved-1f1b" else (4, 1)
        sched, P, S, N = build_schedule(name, K, 4, V), 3, 4, int(rng.integers(1, 4))

        def times():
            x = {f: rng.uniform(0.0, 1.0, (N, S)) * rng.choice([0.0, 1.0]) for f in StageTimes._fields}
            x["backward_weight_s"] = x["backward_s"] * rng.uniform(0.0, 1.0, (N, S))
            return StageTimes(**x)
        steady = [times() for _ in range(P)]
        fill = [times() for _ in range(P)] if trial % 2 else None
        fits = rng.random((P, N, S)) < 0.8
        fits[rng.integers(0, P, (N, S)), np.arange(N)[:, None], np.arange(S)[None, :]] = True

        def objective(st, fl):
            return 0.25 * st + 0.75 * fl

        def simulated(rows, picks):  # each (row, assignment) simulated as its own column
            def pick(xs):
                return StageTimes(*(np.array([[getattr(xs[p], f)[r, s] for s, p in enumerate(pk)]
                                              for r, pk in zip(rows, picks)]) for f in StageTimes._fields))
            st = iterations(sched, pick(steady))
            return objective(st, st if fill is None else iterations(sched, pick(fill)))
        start = np.argmax(fits, axis=0)
        o = assign.options(steady, fill, fits)
        got, picks, ok = assign.best_assignments(sched, o, start, objective)
        assert np.array_equal(got, simulated(range(N), picks.tolist()))
        every = [(r, pk) for r in range(N)
                 for pk in itertools.product(*(np.flatnonzero(fits[:, r, s]) for s in range(S)))]
        ref = simulated([r for r, _ in every], [pk for _, pk in every])
        for r in range(N):
            assert got[r] >= min(v for (rr, _), v in zip(every, ref) if rr == r) * (1 - 1e-12)
        if ok:
            assert got.min() == pytest.approx(ref.min(), rel=1e-12), (seed, trial)
            proven += o.keep.sum(axis=0).prod(axis=1).sum() > assign.MAX_COLUMNS  # it branched
    assert proven >= 3, proven
