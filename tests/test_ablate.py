"""The ablation (planner/ablate.py) and `ptplan ablate`: every row on the shipped ViT-B/16 profile and the paper's
cluster, the full system never slower than the rows it searches beyond, row 1 = the plan's baseline, the freeze-only
stage costs against the one stage model, and the CLI's table, --json and errors."""
from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.ablate import (PAPER_M_TABLE, ROWS, HalvingSearch, ablate, fill_sources, fixed_width_cluster,
                                   freeze_only_costs, paper_micro_batches, reprice, start_K_for)
from ptplan.planner.cluster import get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.errors import PtplanError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import load_profile
from ptplan.planner.search import Candidate, PhaseSearch
from ptplan.planner.synthetic import synthetic_profile

ROOT = Path(__file__).resolve().parents[1]
VIT = ROOT / "profiles" / "vit-base_cpu_fp32.json"
FREEZE = FreezePolicy(policy="geometric", alpha=0.3333)
TRAIN = TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512)
KEYS = [k for k, _, _ in ROWS]


@pytest.fixture(scope="module")
def vit():
    return load_profile(VIT)


@pytest.fixture(scope="module")
def paper_ablation(vit):
    return ablate(vit, get_preset("paper"), TRAIN, FREEZE)


def test_every_row_is_priced_on_vit_and_the_paper_cluster(paper_ablation):
    ab = paper_ablation
    assert [r.key for r in ab.rows] == KEYS and [r.number for r in ab.rows] == list(range(1, 10))
    assert ab.start_K == 8 and ab.world_size == 16  # one pipeline per node, as the paper starts
    assert ab.freeze_steps == (0, 4, 7, 9, 10, 11, 11, 12)
    for r in ab.rows:
        assert r.error is None and r.seconds is not None and r.seconds > 0, r
        assert r.speedup == pytest.approx(ab.baseline_seconds / r.seconds)
        assert r.fits, r  # every phase of every row fits in the paper's 16 GB
        assert len(r.trajectory) == TRAIN.epochs and [s.epoch for s in r.trajectory] == list(range(10))
        assert sum(s.seconds for s in r.trajectory) == pytest.approx(r.seconds, rel=1e-12)
        assert r.summary().startswith("8x2 (e0")  # every row starts from the baseline's K=8 x D=2
    assert {r.key: r.paper_speedup for r in ab.rows if r.paper_speedup} == {
        "no-freeze": 1.0, "freeze-only": 0.95, "autopipe-autocache": 1.26, "autopipe-autodp": 2.27, "full": 2.83}
    json.dumps(ab.to_json())  # plain JSON


def test_full_system_is_never_slower_than_the_rows_it_searches_beyond(paper_ablation):
    full = paper_ablation.row("full").seconds
    for key in ("autopipe", "autopipe-autocache", "autopipe-autodp", "greedy-split", "k-halving", "paper-m-table"):
        assert full <= paper_ablation.row(key).seconds * (1 + 1e-12), key


def test_full_system_is_never_slower_than_the_greedy_split_under_gpipe(vit):
    """Was a strict xfail (the split minimised the slowest stage's forward + backward, GPipe's iteration grows
    with the slowest forward plus the slowest backward); the split is now chosen by simulated time
    (``planner/resplit.py``, issue 22 item 4)."""
    cfg = TrainingConfig(epochs=6, samples_per_epoch=20_000, batch=64, batch_policy="constant-pipeline",
                         schedule="gpipe")
    ab = ablate(vit, get_preset("cpu:4"), cfg, FreezePolicy(policy="geometric", alpha=0.2))
    # at 3 frozen blocks, K=2, M=32: the optimal split [8, 12] active layers simulates 48.06 s, greedy [9, 11] 47.94 s
    assert ab.row("full").seconds <= ab.row("greedy-split").seconds


def test_rows_1_5_6_are_the_planner_as_is(vit, paper_ablation):
    paper = get_preset("paper")
    cfg = replace(TRAIN, start_K=8)
    full = make_plan(vit, paper, cfg, FREEZE)
    off = make_plan(vit, paper, replace(cfg, cache="off"), FREEZE)
    ab = paper_ablation
    assert ab.row("no-freeze").seconds == full.baseline.seconds == off.baseline.seconds
    base = full.baseline.phase
    assert [(p.K, p.D, p.M) for p in ab.row("no-freeze").phases] == [(base.K, base.D, base.M)]
    assert (base.K, base.D) == (8, 2)  # one pipeline per node, as the paper starts
    assert ab.row("full").seconds == pytest.approx(full.totals.seconds, rel=1e-12)
    assert ab.row("autopipe-autodp").seconds == pytest.approx(off.totals.seconds, rel=1e-12)
    assert not any(p.cache for p in ab.row("autopipe-autodp").phases)
    assert (ab.best_static_K, ab.best_static_seconds) == (full.totals.best_static_K, full.totals.best_static_seconds)


def test_restricted_rows_keep_their_restriction(paper_ablation):
    ab = paper_ablation
    base_it = ab.row("no-freeze").phases[0].iteration_s
    for key in ("freeze-only", "autopipe", "autopipe-autocache"):
        phases = ab.row(key).phases
        assert all(p.D == 2 and p.K <= 8 for p in phases), key  # D stays the baseline's
        assert phases[0].frozen_blocks == 0 and phases[0].iteration_s == pytest.approx(base_it, rel=1e-12), key
    fo = ab.row("freeze-only").phases
    first = ab.row("no-freeze").phases[0]
    assert {(p.K, p.M, p.partition) for p in fo} == {(8, first.M, first.partition)}
    assert all(b.iteration_s <= a.iteration_s * (1 + 1e-12) for a, b in zip(fo, fo[1:]))  # freezing never slows it
    assert not any(p.cache for p in ab.row("autopipe").phases)
    assert any(p.cache for p in ab.row("autopipe-autocache").phases)
    assert all(p.K in (8, 4, 2, 1) for p in ab.row("k-halving").phases)
    # the paper's M table wherever its M is valid here (K=8: M=16 gives b=16, which the profile measured)
    for p in ab.row("paper-m-table").phases:
        if p.M != PAPER_M_TABLE[p.K]:
            assert any("nearest valid" in n for n in p.notes), p
    assert ab.row("paper-m-table").phases[0].M == PAPER_M_TABLE[8]
    # the greedy balancer reproduces the paper's released code at T=0 (research: counts [4,2,3,3,3,3,4,5])
    g0 = ab.row("greedy-split").phases[0]
    assert [hi - lo for lo, hi in g0.partition] == [4, 2, 3, 3, 3, 3, 4, 5]
    full = ab.row("full").phases
    assert [(p.K, p.D, p.M, p.cache) for p in ab.row("greedy-split").phases] == [(p.K, p.D, p.M, p.cache) for p in full]


def test_freeze_only_costs_equal_the_stage_model_with_nothing_frozen(vit):
    for name, K, M in (("paper", 8, 16), ("paper", 4, 8), ("dgx-h100", 2, 4), ("cpu", 2, 4)):
        search = PhaseSearch(vit, get_preset(name), replace(TRAIN, optimizer="adamw"))
        D = search.W // K
        cand = Candidate(K=K, D=D, M=M, b=512 // D // M, cache=False)
        ranges = [(0, 4)] + [(4 + 23 * s // (K - 1), 4 + 23 * (s + 1) // (K - 1)) for s in range(K - 1)] \
            if K > 1 else [(0, 27)]
        ours = freeze_only_costs(search, cand, ranges, 0)
        theirs = search.model(cand, 0).stage_costs(ranges)
        for a, b in zip(ours, theirs):
            for f in ("forward_s", "backward_s", "prefix_s", "setup_s", "send_forward_s", "send_backward_s",
                      "allreduce_s", "optimizer_s", "backward_weight_s"):  # W: issue 22 (ZB-H1's freeze-only row)
                assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-12, abs=1e-15), (name, K, f)
            for f in ("fixed_bytes", "activation_bytes_per_mb", "after_bytes"):
                assert abs(getattr(a, f) - getattr(b, f)) <= 1, (name, K, f)


def test_freeze_only_costs_drop_the_frozen_layers_work(vit):
    search = PhaseSearch(vit, get_preset("paper"), TRAIN)
    cand = Candidate(K=4, D=4, M=4, b=8, cache=False)
    ranges = [(0, 7), (7, 14), (14, 21), (21, 27)]
    n0 = vit.frozen_boundary(7)  # 15: stages 0 and 1 wholly frozen, stage 2 partly
    assert n0 == 15
    c0, c = freeze_only_costs(search, cand, ranges, 0), freeze_only_costs(search, cand, ranges, n0)
    ovh, tm = search.c.action_overhead_s, search.t.at(8)
    for s in (0, 1):
        lo, hi = ranges[s]
        assert c[s].forward_s == pytest.approx(float(tm.nograd[lo:hi].sum()) + ovh, rel=1e-12)  # no-grad forward
        assert c[s].backward_s == ovh and c[s].allreduce_s == 0 and c[s].optimizer_s == 0
        assert c[s].activation_bytes_per_mb == 0 and c[s].after_bytes == 0
        assert c[s].fixed_bytes < c0[s].fixed_bytes  # weights only: no gradients or optimizer state
    assert c[1].send_backward_s == 0 and c[2].send_backward_s == 0  # no gradient into frozen layers
    assert c[3].send_backward_s == c0[3].send_backward_s
    assert c[2].backward_s < c0[2].backward_s
    for f in fields(c[3]):  # a wholly trained stage is unchanged (up to the prefix sums' rounding)
        assert getattr(c[3], f.name) == pytest.approx(getattr(c0[3], f.name), rel=1e-12, abs=1e-15), f.name
    with pytest.raises(PtplanError, match="not a static split"):
        freeze_only_costs(search, cand, ranges[1:], n0)


def test_repricing_the_plans_own_split_reproduces_it(vit):
    """The greedy row's re-pricing (and its AutoCache fill source) is exact: the plan's split gives the plan's times."""
    cfg = replace(TRAIN, start_K=8)
    plan = make_plan(vit, get_preset("paper"), cfg, FREEZE)
    search = PhaseSearch(vit, get_preset("paper"), cfg)
    used = [plan.phases[i] for i in sorted({p.phase for p in plan.trajectory})]
    assert any(ph.cache for ph in used)
    for ph, src in zip(used, fill_sources(used)):
        it, fill, peak = reprice(search, ph, ph.partition, src)
        assert it == pytest.approx(ph.predicted.iteration_s, rel=1e-12)
        assert fill == pytest.approx(ph.predicted.fill_iteration_s, rel=1e-12)
        assert peak == max(ph.predicted.stage_peak_memory_bytes)


def test_helpers_start_K_sub_clusters_halving_and_the_m_table(vit):
    paper = get_preset("paper")
    assert start_K_for(paper, TRAIN) == 8 and start_K_for(paper, replace(TRAIN, start_K=16)) == 16
    with pytest.raises(PtplanError, match=r"start K=3 must divide the 16 GPUs.*valid: 1, 2, 4, 8, 16"):
        start_K_for(paper, replace(TRAIN, start_K=3))
    sub = fixed_width_cluster(paper, 8, 4)
    assert sub is not None and (sub.nodes, sub.gpus_per_node) == (2, 4)  # one 4-GPU pipeline per node, in place
    assert fixed_width_cluster(paper, 8, 8) is paper
    one = fixed_width_cluster(paper, 16, 8)
    assert one is not None and (one.nodes, one.gpus_per_node) == (1, 8)  # a 2-node pipeline shrinks onto its first
    assert fixed_width_cluster(paper, 16, 16) is paper
    assert [paper_micro_batches(k) for k in (1, 2, 4, 8)] == [4, 16, 16, 16]
    assert paper_micro_batches(16) == 32 and paper_micro_batches(6) == 12  # 2K beyond the table, as at K=8
    h = HalvingSearch(vit, paper, replace(TRAIN, start_K=8))
    assert h.k_options(5, 20, free=False)[0] == [1, 2, 4, 8]
    assert h.k_options(0, 27, free=False)[0] == [8]
    h16 = HalvingSearch(vit, replace(paper, gpus_per_node=12), replace(TRAIN, start_K=12))
    assert h16.k_options(5, 20, free=False)[0] == [3, 6, 12]


def test_no_freezing_makes_every_row_the_baseline_but_the_replaced_split_and_m():
    prof = synthetic_profile(num_blocks=6)
    cfg = TrainingConfig(epochs=3, samples_per_epoch=4096, batch=256, allow_extrapolation=True)
    ab = ablate(prof, get_preset("dgx-h100"), cfg, FreezePolicy(policy="none"))
    for r in ab.rows:
        if r.key in ("greedy-split", "paper-m-table"):  # these replace parts the static phase has too
            assert r.seconds >= ab.baseline_seconds * (1 - 1e-12), r.key
        else:
            assert r.seconds == pytest.approx(ab.baseline_seconds, rel=1e-12), r.key


def test_bad_input_is_refused_with_the_fix(vit):
    with pytest.raises(PtplanError, match="drop the pinned K"):
        ablate(vit, get_preset("paper"), replace(TRAIN, pin_K=4), FREEZE)
    with pytest.raises(PtplanError, match="start K=5"):
        ablate(vit, get_preset("paper"), replace(TRAIN, start_K=5), FREEZE)


# ---- the CLI ----------------------------------------------------------------------------------
def test_cli_prints_every_row_and_writes_json(tmp_path):
    out = tmp_path / "ab.json"
    res = CliRunner().invoke(cli, ["ablate", "vit-base_cpu_fp32", "--cluster", "paper", "--alpha", "0.3333",
                                   "--epochs", "10", "--json", str(out)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    for i, (_, label, _) in enumerate(ROWS, start=1):
        row = [ln for ln in lines if ln.startswith(f"{i:>3}") and label in ln]
        assert len(row) == 1, (label, res.output)
        assert "x" in row[0] and "8x2 (e0" in row[0]
    assert "2.83x" in res.output and "0.95x" in res.output  # the paper's bars beside ours
    assert "warning: the profile was measured on" in res.output  # CPU profile on a GPU cluster, said
    d = json.loads(out.read_text())
    assert d["schema"] == "ptplan.ablation/1" and [r["key"] for r in d["rows"]] == KEYS
    assert all(r["seconds"] > 0 and r["summary"] for r in d["rows"])
    assert d["training"]["start_K"] == 8


@pytest.mark.parametrize("args, message", [
    (["--start-K", "5"], "start K=5 must divide the 16 GPUs"),
    (["--alpha", "1.5"], "alpha is 1.5"),
    (["--epochs", "0"], "epochs is 0"),
    (["--freeze", "manual"], "--freeze manual needs --manual"),
    (["--cluster", "nosuch"], "unknown cluster preset"),
    (["nosuch-profile"], "no shipped profile"),
    (["--json", "{tmp}/missing/ab.json"], "output folder does not exist"),
    (["--json", str(VIT)], "is also an input"),
])
def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = tmp_path / "ab.json"
    extra = [] if "--json" in args else ["--json", str(out)]
    before = VIT.read_bytes()
    res = CliRunner().invoke(cli, ["ablate", *args, *extra])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not out.exists() and not (tmp_path / "missing").exists()
    assert VIT.read_bytes() == before


def test_cli_writes_the_ablation_report(tmp_path):
    from click.testing import CliRunner

    from ptplan.cli.main import cli

    out = tmp_path / "ablation.html"
    r = CliRunner().invoke(cli, ["ablate", "vit-base_cpu_fp32", "--cluster", "paper", "--report", str(out)])
    assert r.exit_code == 0, r.output
    html = out.read_text()
    assert "fig-ablation" in html and "freeze only" in html.lower()
    import plotly

    assert '<script src="http' not in html and "<script src='http" not in html  # works offline
    assert html.count(plotly.offline.get_plotlyjs()[:200]) == 1  # plotly.js embedded exactly once


def test_the_greedy_split_row_splits_every_chunk_of_an_interleaved_plan(vit):
    """With V = 2 chunks per position the greedy row splits the active layers over K·V stages (it split over K and
    was refused: "not a split ... into K*V"), and ``reprice`` gives a device's memory, all its chunks together, as
    every other row's (``Prediction.peak_memory_bytes``); found by an audit."""
    train = replace(TRAIN, schedule="interleaved-1f1b")
    paper = get_preset("paper")
    ab = ablate(vit, paper, train, FREEZE)
    greedy = ab.row("greedy-split")
    assert greedy.seconds is not None and greedy.error is None, greedy.error
    assert any(len(p.partition) == 2 * p.K for p in greedy.phases), "no phase of the plan interleaves"
    cfg = replace(train, start_K=start_K_for(paper, train), cache="auto")  # the ablation's full plan
    search = PhaseSearch(vit, paper, cfg)
    chunked = [ph for ph in make_plan(vit, paper, cfg, FREEZE).phases if ph.V > 1 and not ph.cache]
    assert chunked
    for ph in chunked:
        _, _, peak = reprice(search, ph, ph.partition, 0)
        assert abs(peak - ph.predicted.peak_memory_bytes) <= 8, (ph.frozen_blocks, peak)
