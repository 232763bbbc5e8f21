"""The plan report: five figures from a realistic plan, one self-contained HTML file, and `ptplan show`."""
from __future__ import annotations

import json
import math

import numpy as np
import plotly
import pytest
from click.testing import CliRunner

from plan_fixtures import (large_plan, make_plan, plan_without_timeline, single_phase_plan, vit_paper_plan,
                           vit_paper_plan_gpipe)
from ptplan.cli.main import cli
from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import save_plan
from ptplan.planner.viz import FIGURES, MAX_GRID_CELLS, build_figures, report_html, write_report


@pytest.fixture(scope="module")
def plan():
    return vit_paper_plan()


@pytest.fixture(scope="module")
def figs(plan):
    return build_figures(plan)


@pytest.fixture(scope="module")
def html(plan, figs):
    return report_html(plan, figs)


def _n(v) -> int:
    """Length of a trace array, whether plain or plotly's typed-array form."""
    return 0 if v is None else len(v)


def test_fixture_is_a_valid_plan(plan):
    assert [ph.frozen_blocks for ph in plan.phases] == [0, 4, 7, 9, 10, 11, 12]
    assert [ph.K for ph in plan.phases] == [8, 4, 4, 2, 2, 1, 1]
    assert all(ph.K * ph.D == 16 for ph in plan.phases)
    assert [t.frozen_blocks for t in plan.trajectory] == [0, 4, 7, 9, 10, 11, 11, 12, 12, 12]
    assert plan.inputs["profile"]["num_layers"] == 27
    assert all(ph.timeline for ph in plan.phases)


def test_five_figures_with_data(figs):
    assert list(figs) == list(FIGURES)
    for name, fig in figs.items():
        assert fig.data, name
        assert any(_n(getattr(t, "x", None)) or _n(getattr(t, "z", None)) for t in fig.data), name
        assert fig.layout.title.text, name
        # serialisable as the browser will get it
        json.loads(fig.to_json())


def test_trajectory_has_frozen_K_and_D_per_epoch(plan, figs):
    fig = figs["trajectory"]
    by_name = {t.name: t for t in fig.data}
    frozen = by_name["Frozen blocks f"]
    assert list(frozen.y) == [t.frozen_blocks for t in plan.trajectory]
    assert list(by_name["K: stages per pipeline"].y) == [8, 4, 4, 2, 2, 1, 1, 1, 1, 1]
    assert list(by_name["D: parallel pipelines"].y) == [2, 4, 4, 8, 8, 16, 16, 16, 16, 16]
    assert fig.layout.xaxis2.title.text == "Epoch"


def test_cluster_grid_one_heatmap_per_phase_covering_every_rank(plan, figs):
    fig = figs["cluster"]
    assert len(fig.data) == len(plan.phases)
    for ph, tr in zip(plan.phases, fig.data):
        z = np.asarray(tr.z, dtype=float)
        assert z.shape == (2, 8)  # 2 nodes x 8 GPUs
        assert np.isfinite(z).sum() == 16
        # every stage appears D times
        counts = np.bincount(z.astype(int).ravel(), minlength=ph.K)
        assert counts.tolist() == [ph.D] * ph.K
        assert "Predicted peak memory" in tr.hovertext[0][0] and "Rank 0" in tr.hovertext[0][0]
    steps = fig.layout.sliders[0].steps
    assert len(steps) == len(plan.phases)
    assert [sum(s.args[0]["visible"]) for s in steps] == [1] * len(plan.phases)
    assert [tr.visible for tr in fig.data].count(True) == 1


def test_timeline_bars_match_events_per_phase(plan, figs):
    fig = figs["timeline"]
    steps = fig.layout.sliders[0].steps
    assert len(steps) == len(plan.phases)
    for ph, step in zip(plan.phases, steps):
        shown = [t for t, v in zip(fig.data, step.args[0]["visible"]) if v and t.name != "Idle (pipeline bubble)"]
        assert sum(_n(t.x) for t in shown) == len(ph.timeline)
        names = {t.name for t in shown}
        assert {"Forward", "Backward"} <= names
        if ph.D > 1:
            assert "Gradient all-reduce (data parallel)" in names
        if ph.K > 1:
            assert {"Send activations", "Receive gradients"} <= names
    assert all("micro-batch" in t.hovertemplate for t in fig.data if t.name == "Forward")


def test_kind_colours_are_consistent_across_phases(figs):
    colours: dict[str, set] = {}
    for t in figs["timeline"].data:
        colours.setdefault(t.name, set()).add(t.marker.color)
    assert all(len(c) == 1 for c in colours.values())


def test_throughput_states_speedup_against_baseline(plan, figs):
    fig = figs["throughput"]
    assert f"{plan.totals['speedup']:.2f}×" in fig.layout.title.text
    names = [t.name for t in fig.data]
    assert any(n.startswith("Baseline") for n in names)
    cum = fig.data[2].y
    assert len(cum) == len(plan.trajectory)
    assert np.all(np.diff(np.asarray(cum)) >= 0)


def test_memory_per_stage_against_capacity(plan, figs):
    fig = figs["memory"]
    assert len(fig.data) == len(plan.phases)
    for ph, tr in zip(plan.phases, fig.data):
        assert np.allclose(np.asarray(tr.y) * 2 ** 30, ph.predicted.stage_peak_memory_bytes)
    cap = plan.inputs["cluster"]["gpu_memory_bytes"] / 2 ** 30
    assert any(s.type == "line" and math.isclose(s.y0, cap) for s in fig.layout.shapes)


def test_html_is_self_contained(html, plan):
    assert html.startswith("<!DOCTYPE html>")
    assert '<script src="http' not in html and "<script src='http" not in html
    assert "<link" not in html  # no external stylesheets or fonts
    assert html.count(plotly.offline.get_plotlyjs()[:200]) == 1  # plotly.js embedded exactly once
    for key in FIGURES:
        assert f'id="fig-{key}"' in html
    for words in ("vit-base-patch16", "Quadro RTX 5000", "α = 0.333", "constant-global", "1F1B", "16 GPUs",
                  f"{plan.totals['speedup']:.2f}×"):
        assert words in html, words
    # per-phase table: one row per phase plus the baseline
    assert html.count("<tr class=''>") == len(plan.phases) and html.count("<tr class='base'>") == 1


def test_html_escapes_plan_strings():
    plan = vit_paper_plan()
    plan.inputs["profile"]["model"] = "<script>alert(1)</script>"
    assert "<script>alert(1)" not in report_html(plan)


def test_empty_timeline_says_so():
    plan = plan_without_timeline()
    fig = build_figures(plan)["timeline"]
    steps = fig.layout.sliders[0].steps
    assert all("No timeline recorded" in json.dumps(s.args[1]["annotations"]) for s in steps)
    assert "No timeline recorded" in fig.layout.annotations[0].text


def test_gpipe_and_single_phase_plans():
    for plan in (vit_paper_plan_gpipe(), single_phase_plan()):
        figs = build_figures(plan)
        assert all(f.data for f in figs.values())


def test_wide_node_wraps_and_missing_cluster_fields_fall_back():
    wide = make_plan(nodes=1, gpus_per_node=32, global_batch=1024)
    tr = build_figures(wide)["cluster"].data[0]
    assert np.asarray(tr.z, dtype=float).shape == (2, 16)
    assert tr.y[1] == "Node 0 · GPUs 16–31"
    bare = vit_paper_plan()
    bare.inputs["cluster"] = {}
    figs = build_figures(bare)
    assert np.asarray(figs["cluster"].data[0].z, dtype=float).shape == (1, 16)
    assert not figs["memory"].layout.shapes  # no capacity known, no capacity line
    report_html(bare, figs)


def test_large_plan_grid_is_capped_and_data_compact():
    plan = large_plan()
    assert plan.world_size == 1024
    figs = build_figures(plan)
    for tr in figs["cluster"].data:
        assert np.asarray(tr.z, dtype=float).size <= MAX_GRID_CELLS
    assert "Showing the first 128 of 1024 GPUs" in figs["cluster"].layout.title.text
    data_bytes = sum(len(f.to_json()) for f in figs.values())
    assert data_bytes < 3_000_000, data_bytes


def test_write_report_is_atomic(tmp_path, plan, monkeypatch):
    out = tmp_path / "r.html"
    write_report(plan, out)
    assert out.stat().st_size > 3_000_000  # plotly.js alone is ~4.5 MB
    with pytest.raises(PtplanError, match="output folder does not exist"):
        write_report(plan, tmp_path / "missing" / "r.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


# ---- the CLI ------------------------------------------------------------------------------------
def test_cli_show_writes_report(tmp_path, plan):
    src, out = tmp_path / "plan.json", tmp_path / "report.html"
    save_plan(plan, src)
    res = CliRunner().invoke(cli, ["show", str(src), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert str(out) in res.output and "MB" in res.output
    assert out.read_text().count('class="plotly-graph-div"') == len(FIGURES)


def _bad_plans(plan):
    good = json.loads(json.dumps(plan.to_json()))
    wrong_schema = dict(good, schema="ptplan.plan/2")
    not_a_plan = dict(good, schema="ptplan.profile/1")
    empty = dict(good, phases=[])
    missing_field = {k: v for k, v in good.items() if k != "baseline"}
    return {
        "wrong-version.json": (json.dumps(wrong_schema), "ptplan.plan/2"),
        "profile.json": (json.dumps(not_a_plan), "schema"),
        "empty.json": (json.dumps(empty), "no phase"),
        "no-baseline.json": (json.dumps(missing_field), "baseline"),
        "broken.json": ('{"schema": "ptplan.plan/1", "phases": [', "not valid JSON"),
        "list.json": ("[1, 2]", "expected an object"),
    }


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, plan):
    runner = CliRunner()
    cases = _bad_plans(plan)
    for name, (text, needle) in cases.items():
        src, out = tmp_path / name, tmp_path / f"{name}.html"
        src.write_text(text)
        res = runner.invoke(cli, ["show", str(src), "--out", str(out)])
        assert res.exit_code == 2, (name, res.output)
        assert res.output.startswith("error: ") and needle in res.output, (name, res.output)
        assert not out.exists(), name
    res = runner.invoke(cli, ["show", str(tmp_path / "nope.json"), "--out", str(tmp_path / "nope.html")])
    assert res.exit_code == 2 and "not found" in res.output
    res = runner.invoke(cli, ["show", str(tmp_path / "empty.json"), "--out", str(tmp_path / "x" / "r.html")])
    assert res.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)  # no report, no temp file
