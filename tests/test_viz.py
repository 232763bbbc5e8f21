"""The plan report on plans made by the product: five figures, one self-contained HTML file, and `ptplan show`."""
from __future__ import annotations

import dataclasses
import json
import re
from html import escape

import numpy as np
import plotly
import pytest
from click.testing import CliRunner

from plan_fixtures import (cpu_plan, deep_plan, large_plan, many_microbatch_plan, no_freeze_plan,
                           step_freeze_plan, vit_paper_plan, wide_node_plan)
from ptplan.cli.main import cli
from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import save_plan
from ptplan.planner.runlog import SCHEMA as RUNLOG_SCHEMA
from ptplan.planner.report.viz import (FIGURES, MAX_GRID_CELLS, SLIDER_MAX_PHASES, TIMELINE_BARS_PER_LANE, build_figures,
                                report_html, timeline_blocks, trajectory_runs, write_report)

UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
READABLE = re.compile(r"^(\d[\d,]*(\.\d+)?) (B|KiB|MiB|GiB|TiB)$")


@pytest.fixture(scope="module")
def plan():
    return vit_paper_plan()


@pytest.fixture(scope="module")
def figs(plan):
    return build_figures(plan)


@pytest.fixture(scope="module")
def html(plan, figs):
    return report_html(plan, figs)


@pytest.fixture(scope="module")
def m64():
    return many_microbatch_plan()


def _n(v) -> int:
    """Length of a trace array, whether plain or plotly's typed-array form."""
    return 0 if v is None else len(v)


def _shown(fig, i: int) -> list:
    """The traces phase step i of the figure's selector shows (the always-shown idle legend entry left out)."""
    vis = fig.layout.sliders[0].steps[i].args[0]["visible"]
    return [t for t, v in zip(fig.data, vis) if v and t.name != "Idle (pipeline bubble)"]


def _body(html: str) -> str:
    """The report without the embedded plotly.js."""
    return html.replace(plotly.offline.get_plotlyjs(), "")


def test_fixtures_are_product_plans(plan):
    assert plan.world_size == 16 and plan.inputs.cluster.name == "paper"
    assert plan.inputs.profile.num_layers == 27
    Ks = [plan.phases[t.phase].K for t in plan.trajectory]
    assert Ks[0] == 8 and Ks[-1] < Ks[0]  # the pipeline compresses as blocks freeze ...
    assert all(ph.K * ph.D == 16 for ph in plan.phases)  # ... and the freed GPUs become pipelines
    assert plan.totals.fill_seconds > 0 and any(ph.notes for ph in plan.phases) and plan.warnings
    assert any(ph.timeline for ph in plan.phases) and any(not ph.timeline for ph in plan.phases)


def test_five_figures_with_data(figs):
    assert list(figs) == list(FIGURES)
    for name, fig in figs.items():
        assert fig.data, name
        assert any(_n(getattr(t, "x", None)) or _n(getattr(t, "z", None)) for t in fig.data), name
        assert fig.layout.title.text, name
        json.loads(fig.to_json())  # serialisable as the browser will get it


# ---- trajectory -------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [vit_paper_plan, step_freeze_plan], ids=["per-epoch", "every-10-steps"])
def test_trajectory_runs_tile_the_epochs_and_keep_every_second(make):
    p = make()
    runs = trajectory_runs(p)
    E = p.inputs.training.epochs
    assert runs[0].x0 == 0 and runs[-1].x1 == pytest.approx(E)
    for a, b in zip(runs, runs[1:]):
        assert a.x1 == pytest.approx(b.x0) and a.phase != b.phase  # contiguous, one run per phase visit
        assert b.step == a.step + a.iterations
    for r in runs:
        assert r.x0 <= r.x_fill <= r.x1 and (r.x_fill > r.x0) == (r.fill_iterations > 0)
    assert sum(r.seconds for r in runs) == pytest.approx(p.totals.seconds)
    assert sum(r.iterations for r in runs) == sum(t.iterations for t in p.trajectory)
    assert sum(r.fill_iterations for r in runs) == sum(t.fill_iterations for t in p.trajectory)


def test_step_freezing_places_several_runs_in_one_epoch():
    p = step_freeze_plan()
    runs = trajectory_runs(p)
    assert len(runs) > p.inputs.training.epochs  # freezing every 10 steps: several runs per epoch
    assert any(r.x0 % 1 for r in runs)  # at fractional epoch positions
    fig = build_figures(p)["trajectory"]
    frozen = next(t for t in fig.data if t.name == "Frozen blocks f")
    assert list(frozen.x) == pytest.approx([r.x0 for r in runs] + [runs[-1].x1])
    assert list(frozen.y) == [r.frozen_blocks for r in runs] + [runs[-1].frozen_blocks]
    assert "every 10 steps" in fig.layout.title.text


def test_trajectory_has_frozen_K_D_and_the_fills(plan, figs):
    fig = figs["trajectory"]
    by_name = {t.name: t for t in fig.data}
    runs = trajectory_runs(plan)
    assert list(by_name["Frozen blocks f"].y) == [r.frozen_blocks for r in runs] + [runs[-1].frozen_blocks]
    Ks = [plan.phases[r.phase].K for r in runs]
    Ds = [plan.phases[r.phase].D for r in runs]
    assert list(by_name["K: stages per pipeline"].y) == Ks + Ks[-1:]
    assert list(by_name["D: parallel pipelines"].y) == Ds + Ds[-1:]
    fill = by_name["AutoCache fill (first pass over the data)"]
    spans = [(a, b) for a, b in zip(fill.x[0::3], fill.x[1::3])]
    assert spans == [(r.x0, r.x_fill) for r in runs if r.fill_iterations]
    assert fig.layout.xaxis2.title.text == "Epoch"


# ---- cluster grid --------------------------------------------------------------------------------
def _step_data(fig, i: int) -> dict:
    """What phase step i of a data-swapping selector (cluster, memory) puts into the figure's traces."""
    return fig.layout.sliders[0].steps[i].args[0]


def test_cluster_grid_one_view_per_phase_covering_every_rank(plan, figs):
    fig = figs["cluster"]
    assert len(fig.data) == 1  # one heatmap; each phase step swaps its data in
    steps = fig.layout.sliders[0].steps
    assert len(steps) == len(plan.phases)
    for i, ph in enumerate(plan.phases):
        d = _step_data(fig, i)
        z = np.asarray(d["z"][0], dtype=float)
        assert z.shape == (2, 8)  # 2 nodes x 8 GPUs
        assert np.isfinite(z).sum() == 16
        counts = np.bincount(z.astype(int).ravel(), minlength=ph.K)
        assert counts.tolist() == [ph.D] * ph.K  # every stage appears D times
        hover = d["hovertext"][0]
        assert "Rank 0" in hover[0][0] and "peak" in hover[0][0]
        assert f"K={ph.K}" in steps[i].args[1]["title.text"]
    assert np.asarray(fig.data[0].z, dtype=float).tolist() == np.asarray(_step_data(fig, 0)["z"][0]).tolist()


def test_wide_node_wraps():
    tr = build_figures(wide_node_plan())["cluster"].data[0]
    assert np.asarray(tr.z, dtype=float).shape == (2, 16)
    assert tr.y[1] == "Node 0 · GPUs 16–31"


# ---- timeline ------------------------------------------------------------------------------------
def test_timeline_draws_every_event_of_a_small_phase(plan, figs):
    fig = figs["timeline"]
    steps = fig.layout.sliders[0].steps
    assert len(steps) == len(plan.phases)
    small = [i for i, ph in enumerate(plan.phases) if ph.timeline and ph.M <= TIMELINE_BARS_PER_LANE // 2]
    assert small
    for i in small:
        ph = plan.phases[i]
        shown = _shown(fig, i)
        assert sum(_n(t.x) for t in shown) == len(ph.timeline)  # one bar per event
        names = {t.name for t in shown}
        assert {"Forward", "Backward"} <= names
        if ph.D > 1:
            assert "Gradient all-reduce (data parallel)" in names
    first = next(i for i, ph in enumerate(plan.phases) if ph.timeline)
    assert fig.layout.sliders[0].active == first  # the first view is a phase with a timeline


def test_timeline_at_64_micro_batches_is_blocks_covering_the_iteration(m64):
    fig = build_figures(m64)["timeline"]
    drawn = [i for i, ph in enumerate(m64.phases) if ph.timeline]
    assert drawn
    for i in drawn:
        ph = m64.phases[i]
        assert ph.M == 64 and len(ph.timeline) > 1000
        shown = _shown(fig, i)
        bars = sum(_n(t.x) for t in shown)
        assert bars <= 2 * ph.K * TIMELINE_BARS_PER_LANE and bars < len(ph.timeline) / 10, bars  # dozens, not 1,284
        assert sum(int(c[7]) for t in shown for c in t.customdata) == len(ph.timeline)  # every event counted once
        starts = np.concatenate([np.asarray(t.base, dtype=float) for t in shown])
        ends = np.concatenate([np.asarray(t.base, dtype=float) + np.asarray(t.x, dtype=float) for t in shown])
        span = (min(e.start for e in ph.timeline) * 1e3, max(e.end for e in ph.timeline) * 1e3)
        assert starts.min() == pytest.approx(span[0]) and ends.max() == pytest.approx(span[1])
        title = fig.layout.sliders[0].steps[i].args[1]["title.text"]
        assert f"{len(ph.timeline):,} events as {bars} blocks" in title
        assert {"Forwards and backwards interleaved (merged block)", "Forward", "Backward"} <= {t.name for t in shown}


def _lane_class(kind: str) -> str:
    return "allreduce" if kind == "ALLREDUCE" else "comm" if kind.startswith(("SEND", "RECV")) else "compute"


def test_timeline_blocks_hide_no_gap_longer_than_the_threshold(m64):
    ph = next(ph for ph in m64.phases if ph.timeline)
    blocks, tols = timeline_blocks(ph.timeline)
    assert set(tols) == {"compute", "comm"}
    lanes: dict[tuple[int, str], list] = {}
    for b in blocks:
        lanes.setdefault((b.rank, _lane_class(b.kinds[0][0])), []).append(b)
    for (rank, lane), bs in lanes.items():
        assert len(bs) <= TIMELINE_BARS_PER_LANE
        bs.sort(key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(bs, bs[1:]))  # blocks of a lane never overlap
        for b in bs:
            inside = sorted((e for e in ph.timeline if e.rank == rank and b.start <= e.start and e.end <= b.end
                             and _lane_class(e.kind) == lane), key=lambda e: e.start)
            assert len(inside) == b.events
            reach = inside[0].end
            for e in inside[1:]:  # inside a block every idle gap is at most the lane's threshold
                assert e.start - reach <= tols.get(lane, 0.0) + 1e-12
                reach = max(reach, e.end)
            assert 0 < b.busy <= b.end - b.start + 1e-12
    # small phases are not merged at all
    small = [e for e in ph.timeline if e.mb < TIMELINE_BARS_PER_LANE // 4]
    assert timeline_blocks(small)[1] == {}


def test_kind_colours_are_consistent_across_phases(figs, m64):
    for fig in (figs["timeline"], build_figures(m64)["timeline"]):
        colours: dict[str, set] = {}
        for t in fig.data:
            colours.setdefault(t.name, set()).add(t.marker.color)
        assert all(len(c) == 1 for c in colours.values())


def test_phases_without_a_timeline_say_why(plan, figs):
    steps = figs["timeline"].layout.sliders[0].steps
    on_path = {t.phase for t in plan.trajectory}
    for i, ph in enumerate(plan.phases):
        text = json.dumps(steps[i].args[1]["annotations"])
        assert ("No timeline recorded" in text) == (not ph.timeline)
        if not ph.timeline and i not in on_path:
            assert "not on the predicted trajectory" in text


# ---- throughput ------------------------------------------------------------------------------------
def test_throughput_and_cumulative_time_charge_the_fills(plan, figs):
    fig = figs["throughput"]
    t = plan.totals
    assert f"{t.speedup:.2f}×" in fig.layout.title.text and "AutoCache fills add" in fig.layout.title.text
    unit = fig.layout.yaxis2.title.text.split("(")[-1].rstrip(")")
    div = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0}[unit]
    plan_cum = [tr for tr in fig.data if tr.name == "Elastic plan (freezing)" and tr.xaxis == "x2"][0]
    base_cum = [tr for tr in fig.data if tr.name.startswith("Baseline") and tr.xaxis == "x2"][0]
    assert np.all(np.diff(np.asarray(plan_cum.y)) >= 0)
    assert plan_cum.y[-1] * div == pytest.approx(t.seconds)
    assert base_cum.y[-1] * div == pytest.approx(t.baseline_seconds)
    assert plan_cum.x[-1] == pytest.approx(plan.inputs.training.epochs)
    fills = [tr for tr in fig.data if tr.legendgroup == "fill"]
    assert len(fills) == 2  # the fill iterations on both panels
    runs = [r for r in trajectory_runs(plan) if r.fill_iterations]
    thr = fills[0]
    for r, y in zip(runs, thr.y[0::3]):  # a fill iteration is slower than the phase's steady one
        assert y == pytest.approx(r.fill_iterations * plan.phases[r.phase].global_batch / r.fill_seconds)
        assert y < plan.phases[r.phase].predicted.samples_per_s


def test_no_fill_no_fill_traces():
    fig = build_figures(no_freeze_plan())["throughput"]
    assert not [t for t in fig.data if t.legendgroup == "fill"] and "AutoCache" not in fig.layout.title.text


# ---- memory ---------------------------------------------------------------------------------------
def _memory_phase(fig, i):
    """(name, heights) of the bars phase i shows, and its peak labels (text, heights)."""
    d = _step_data(fig, i)
    bars = [(t.name, d["y"][k]) for k, t in enumerate(fig.data) if t.type == "bar" and d["visible"][k]]
    return bars, (d["text"][-1], d["y"][-1])


def test_memory_stacks_the_terms_up_to_each_stage_peak(plan, figs):
    fig = figs["memory"]
    for i, ph in enumerate(plan.phases):
        bars, peak = _memory_phase(fig, i)
        unit = fig.layout.sliders[0].steps[i].args[1]["yaxis.title.text"].split("(")[-1].rstrip(")")
        stacked = np.sum([np.asarray(y, dtype=float) for _, y in bars], axis=0) * UNIT[unit]
        assert stacked == pytest.approx(np.array(ph.predicted.stage_peak_memory_bytes, dtype=float), rel=1e-6)
        assert {name for name, _ in bars} >= {"Weights", "Gradients", "Optimizer state"}
        assert len(peak[0]) == ph.K
    assert len(fig.data) == 8  # six terms, the no-break-down bar and the labels, whatever the phase count


def test_interleaved_plan_shows_each_device_with_all_its_chunks():
    """With V > 1 a device runs V chunks: the memory figure has one bar per pipeline position whose stack
    adds up to the position's peak with all its chunks (``rank_peak_memory_bytes``, what the device holds),
    the cluster grid names every chunk's layers, and no chunk beyond the first K is dropped."""
    plan = vit_paper_plan("interleaved-1f1b")
    multi = [(i, ph) for i, ph in enumerate(plan.phases) if ph.V > 1]
    assert multi, [(ph.K, ph.V) for ph in plan.phases]
    figs = build_figures(plan)
    for i, ph in multi:
        assert len(ph.predicted.stage_peak_memory_bytes) == ph.K * ph.V
        assert len(ph.predicted.rank_peak_memory_bytes) == ph.K
        bars, peak = _memory_phase(figs["memory"], i)
        unit = figs["memory"].layout.sliders[0].steps[i].args[1]["yaxis.title.text"].split("(")[-1].rstrip(")")
        stacked = np.sum([np.asarray(y, dtype=float) for _, y in bars], axis=0) * UNIT[unit]
        assert stacked == pytest.approx(np.array(ph.predicted.rank_peak_memory_bytes, dtype=float), rel=1e-6)
        assert len(peak[0]) == ph.K
        assert ph.predicted.peak_memory_bytes == max(ph.predicted.rank_peak_memory_bytes)
        hover = " ".join(" ".join(row) for row in _step_data(figs["cluster"], i)["hovertext"][0])
        for lo, hi in ph.partition:  # every chunk's layers are named on its device
            assert f"{lo}–{hi - 1}" in hover or (hi - lo == 1 and f"layer {lo}" in hover), (lo, hi)


def test_small_model_memory_is_readable_never_zero():
    p = cpu_plan()
    assert max(max(ph.predicted.stage_peak_memory_bytes) for ph in p.phases) < 2**30  # MiB-sized stages
    fig = build_figures(p)["memory"]
    for i, ph in enumerate(p.phases):
        bars, peak = _memory_phase(fig, i)
        for label, b in zip(peak[0], ph.predicted.stage_peak_memory_bytes):
            m = READABLE.match(label)
            assert m and float(m.group(1).replace(",", "")) >= 1, label  # e.g. '2.93 MiB', never '0.0 GiB'
            assert float(m.group(1).replace(",", "")) * UNIT[m.group(3)] == pytest.approx(b, rel=0.01)
        layout = fig.layout.sliders[0].steps[i].args[1]
        unit = layout["yaxis.title.text"].split("(")[-1].rstrip(")")
        assert unit in ("KiB", "MiB") and max(peak[1]) >= 1  # the axis unit fits the numbers
        # capacity (GiB of host RAM per process) is far off this scale: said in words, not drawn
        assert not layout["shapes"] and "off this scale" in json.dumps(layout["annotations"])
    assert "0.0 GiB" not in _body(report_html(p))


def test_capacity_line_where_the_peak_is_on_its_scale():
    p = cpu_plan(memory_bytes=8 * 2**20)
    fig = build_figures(p)["memory"]
    layout = fig.layout.sliders[0].steps[0].args[1]
    assert layout["shapes"][0]["y0"] == pytest.approx(8.0) and "MiB" in layout["yaxis.title.text"]
    assert "capacity 8.00 MiB" in json.dumps(layout["annotations"])


# ---- the page ------------------------------------------------------------------------------------
def test_html_is_self_contained(html, plan):
    assert html.startswith("<!DOCTYPE html>")
    assert '<script src="http' not in html and "<script src='http" not in html
    assert "<link" not in html  # no external stylesheets or fonts
    assert html.count(plotly.offline.get_plotlyjs()[:200]) == 1  # plotly.js embedded exactly once
    for key in FIGURES:
        assert f'id="fig-{key}"' in html
    for words in ("vit-base", "Quadro RTX 5000", "α = 0.333", "constant-global", "1F1B", "16 GPUs",
                  f"{plan.totals.speedup:.2f}×", "AutoCache fills"):
        assert words in html, words
    # per-phase table: one row per phase plus the baseline (and a note row under each phase with notes)
    rows = re.findall(r"<tr class='([^']*)'>", html)
    assert len([r for r in rows if "notes" not in r.split() and "base" not in r.split()]) == len(plan.phases)
    assert len([r for r in rows if r.split()[:1] == ["base"]]) == 1


def test_warnings_lead_the_report_and_notes_sit_in_the_phase_table(plan, html):
    body = _body(html)
    box = body.index('id="warnings"')
    assert box < body.index('class="cards"') and f"{len(plan.warnings)} warnings" in body
    for w in plan.warnings:
        assert w.code in body[box:body.index('class="cards"')]
        assert escape(w.message) in body
    notes = [n for ph in plan.phases for n in ph.notes]
    assert notes and all(escape(n) in body[body.index('id="phases"'):] for n in notes)
    assert body.count("<tr class='notes") == sum(1 for ph in plan.phases if ph.notes) + bool(plan.baseline.phase.notes)


def test_a_cpu_cluster_is_never_called_gpus():
    p = cpu_plan()
    assert p.inputs.cluster.device_kind == "cpu" and p.warnings and any(ph.timeline for ph in p.phases)
    page = report_html(p)
    assert not re.search("gpu", _body(page), re.IGNORECASE)
    assert "4 CPU processes" in page and "CPU process assignment" in page and "Peak CPU process memory" in page


def test_html_escapes_plan_strings(plan):
    prof = dataclasses.replace(plan.inputs.profile, model="<script>alert(1)</script>")
    evil = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, profile=prof))
    assert "<script>alert(1)" not in report_html(evil)


def test_gpipe_and_no_freeze_plans():
    for p in (vit_paper_plan("gpipe"), no_freeze_plan()):
        figs = build_figures(p)
        assert all(f.data for f in figs.values())
        report_html(p, figs)


def test_many_phases_get_a_dropdown_that_swaps_data():
    p = deep_plan()
    assert len(p.phases) > SLIDER_MAX_PHASES
    figs = build_figures(p)
    for key in ("cluster", "timeline", "memory"):
        fig = figs[key]
        assert not fig.layout.sliders and len(fig.layout.updatemenus[0].buttons) == len(p.phases), key
    mem = figs["memory"]
    for k, button in enumerate(mem.layout.updatemenus[0].buttons):
        ph = p.phases[k]
        labels = button.args[0]["text"][-1]
        assert len(labels) == ph.K and all(READABLE.match(t) for t in labels)
    report_html(p, figs)


def test_large_plan_grid_is_capped_and_data_compact():
    p = large_plan()
    assert p.world_size == 1024
    figs = build_figures(p)
    for step in figs["cluster"].layout.sliders[0].steps:
        assert np.asarray(step.args[0]["z"][0], dtype=float).size <= MAX_GRID_CELLS
    assert "Showing the first 128 of 1,024 GPUs" in figs["cluster"].layout.title.text
    data_bytes = sum(len(f.to_json()) for f in figs.values())
    assert data_bytes < 1_000_000, data_bytes


def test_write_report_is_atomic(tmp_path, plan):
    out = tmp_path / "r.html"
    write_report(plan, out)
    assert out.stat().st_size > 3_000_000  # plotly.js alone is ~4.5 MB
    with pytest.raises(PtplanError, match="output folder does not exist"):
        write_report(plan, tmp_path / "missing" / "r.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


# ---- the CLI ------------------------------------------------------------------------------------
def test_cli_show_writes_report_and_prints_the_warnings(tmp_path, plan):
    src, out = tmp_path / "plan.json", tmp_path / "report.html"
    save_plan(plan, src)
    res = CliRunner().invoke(cli, ["show", str(src), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert str(out) in res.stdout and "MB" in res.stdout
    assert res.stderr.count("warning: ") == len(plan.warnings)
    assert all(w.message in res.stderr for w in plan.warnings)
    assert out.read_text().count('class="plotly-graph-div"') == len(FIGURES)


def test_cli_show_refuses_to_overwrite_its_inputs(tmp_path, plan):
    src = tmp_path / "plan.json"
    save_plan(plan, src)
    before = src.read_bytes()
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"type": "header", "schema": RUNLOG_SCHEMA, "model": "m", "world_size": 16,
                               "phases": []}) + "\n")
    runner = CliRunner()
    for out, what in ((src, "plan"), (tmp_path / "." / "plan.json", "plan"), (log, "run log")):
        res = runner.invoke(cli, ["show", str(src), "--run", str(log), "--out", str(out)])
        assert res.exit_code == 2, res.output
        assert res.output.startswith("error: ") and f"is the {what} itself" in res.output and "--out" in res.output
        assert res.output.count("\n") == 1  # one message, with the fix
    assert src.read_bytes() == before and log.read_text().startswith("{")


def _bad_plans(plan):
    good = json.loads(json.dumps(plan.to_json()))
    return {
        "old-version.json": (json.dumps(dict(good, schema="ptplan.plan/1")), "ptplan.plan/2"),
        "profile.json": (json.dumps(dict(good, schema="ptplan.profile/1")), "schema"),
        "empty.json": (json.dumps(dict(good, phases=[])), "no phase"),
        "no-baseline.json": (json.dumps({k: v for k, v in good.items() if k != "baseline"}), "baseline"),
        "broken.json": ('{"schema": "ptplan.plan/2", "phases": [', "not valid JSON"),
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


# ---- schedules and strategies the report must show (issues 13, 14, 15) -----------------------------
def _pinned_plan(profile: str, cluster: str, schedule: str, K: int, M: int, batch: int):
    """One phase that matters (no freezing), K and M pinned, made by the product's planner."""
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import make_plan
    from ptplan.planner.profile import load_profile
    from ptplan.profiles import shipped

    return make_plan(load_profile(shipped(profile)), get_preset(cluster),
                     TrainingConfig(epochs=1, samples_per_epoch=8 * batch, batch=batch, pin_K=K, pin_M=M,
                                    schedule=schedule), FreezePolicy(policy="none"))


def test_two_bw_report_shows_one_steady_state_period():
    """PipeDream-2BW has no flush, so no iteration of its own: the timeline shows the continuous pipeline's
    steady state with one period (one mini-batch) shaded, the simulator's period, and says so -- where the
    flushed schedules' timeline is one iteration."""
    from ptplan.planner.schedule import TWOBW_WINDOW
    from ptplan.planner.report.viz import _duration, steady_state

    plan = _pinned_plan("gpt2_cpu_fp32", "cpu:4", "2bw", K=4, M=8, batch=32)
    ph = plan.phases[0]
    assert (ph.schedule, ph.K, ph.M) == ("2bw", 4, 8) and ph.timeline
    overhead = plan.inputs.cluster.step_overhead_s
    st = steady_state(ph, overhead)
    assert st is not None and st.minibatches == TWOBW_WINDOW and st.iteration_s == ph.predicted.iteration_s
    # the period is the spacing of the pipeline's mini-batches once it has settled (simulate's S0[t])
    s0 = [min(e.start for e in ph.timeline if e.stage == 0 and e.kind == "F" and e.mb == t * ph.M)
          for t in range(st.minibatches)]
    assert st.start == s0[st.minibatch]
    assert s0[st.minibatch + 1] - s0[st.minibatch] == pytest.approx(ph.predicted.iteration_s - overhead, rel=1e-9)
    # in the shaded period every rank runs one mini-batch: M forwards and M backwards, no fill, no drain (the next
    # mini-batch's first forward starts at the period's end up to the float rounding of the simulator's sums, which
    # the assertion above bounds by 1e-9 of the period)
    tol = 1e-9 * st.period
    for r in range(ph.K):
        for kind in ("F", "B"):
            n = sum(1 for e in ph.timeline if e.rank == r and e.kind == kind
                    and st.start - tol <= e.start < st.end - tol)
            assert n == ph.M, (r, kind, n)
    figs = build_figures(plan)
    lay = figs["timeline"].layout.sliders[0].steps[0].args[1]
    title = lay["title.text"]
    assert title.startswith(f"Flush-free steady state of pipeline 0: one period = {_duration(st.iteration_s)}")
    assert f"{_duration(ph.predicted.iteration_s)} per iteration" in title and "Iteration timeline" not in title
    shaded = [s for s in lay["shapes"] if s["type"] == "rect" and s["xref"] == "x"]
    assert len(shaded) == 1
    assert shaded[0]["x0"] == pytest.approx(st.start * 1e3)
    assert shaded[0]["x1"] - shaded[0]["x0"] == pytest.approx((ph.predicted.iteration_s - overhead) * 1e3)
    lo, hi = lay["xaxis.range"]
    assert lo < shaded[0]["x0"] and shaded[0]["x1"] < hi and hi - lo == pytest.approx(1.5 * st.period * 1e3)
    shown = _shown(figs["timeline"], 0)
    starts = np.concatenate([np.asarray(t.base, dtype=float) for t in shown])
    assert starts.min() > s0[1] * 1e3  # the fill is not drawn as if it were an iteration
    body = _body(report_html(plan, figs))
    assert "one steady-state period (flush-free)" in body and "Pipeline timeline of one iteration" not in body
    assert "steady-state period (flush-free)</span>" in body  # the phase table's iteration time says what it is


def test_flushed_plans_keep_the_one_iteration_timeline(plan, figs):
    from ptplan.planner.report.viz import steady_state

    assert all(steady_state(ph) is None for ph in plan.phases)
    first = next(i for i, ph in enumerate(plan.phases) if ph.timeline)
    lay = figs["timeline"].layout.sliders[0].steps[first].args[1]
    assert lay["title.text"].startswith("Iteration timeline of pipeline 0")
    assert not [s for s in lay["shapes"] if s["xref"] == "x"]


def test_zero_bubble_timeline_draws_the_weight_gradients():
    """ZB-H1 splits each backward into B (input gradient) and W (weight gradient): at small K and M every
    W action of the plan is its own bar, after its micro-batch's B on the same stage."""
    plan = _pinned_plan("bert-tiny_cpu_fp32", "cpu:4", "zb-h1", K=4, M=4, batch=16)
    ph = plan.phases[0]
    assert (ph.schedule, ph.K, ph.M) == ("zb-h1", 4, 4)
    assert all(f"{s}W{m}" in ph.actions[s].split() for s in range(ph.K) for m in range(ph.M))
    ws = [e for e in ph.timeline if e.kind == "W"]
    assert len(ws) == ph.K * ph.M and all(e.end > e.start for e in ws)
    for w in ws:
        b = next(e for e in ph.timeline if e.kind == "B" and e.stage == w.stage and e.mb == w.mb)
        assert b.end <= w.start + 1e-12
    fig = build_figures(plan)["timeline"]
    bars = {t.name: t for t in _shown(fig, 0)}
    assert {"Forward", "Backward", "Weight gradient"} <= set(bars)
    w_bars = bars["Weight gradient"]
    drawn = sorted(zip(np.asarray(w_bars.base, dtype=float), np.asarray(w_bars.x, dtype=float)))
    expect = sorted((e.start * 1e3, (e.end - e.start) * 1e3) for e in ws)
    assert np.allclose(drawn, expect)
    assert sum(_n(t.x) for t in bars.values()) == len(ph.timeline)


@pytest.fixture(scope="module")
def tp_plan():
    """A model whose layer does not fit on one H100 (2 blocks of width 32,768), planned with strategies on
    4 nodes of 8 H100s: tensor parallel (tp4, tp2) with FSDP, phase by phase."""
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import make_plan
    from ptplan.planner.synthetic import synthetic_profile

    prof = synthetic_profile(num_blocks=2, hidden=32768, seq_len=1024, vocab=32000, batch_sizes=(1, 2, 4))
    return make_plan(prof, get_preset("h100-4node"),
                     TrainingConfig(epochs=2, samples_per_epoch=1024, batch=32, allow_extrapolation=True),
                     FreezePolicy(alpha=1 / 3), strategies="auto")


def test_report_shows_each_phase_strategy_and_mesh(tp_plan):
    """Titles name each phase's strategy and mesh; the rank grid outlines every tensor-parallel group (tp
    cells of one node, one pipeline stage) and numbers its ranks t; hovers say what the strategy does."""
    p = tp_plan
    gpn = p.inputs.cluster.gpus_per_node
    # (tp8 with stage 0 recomputing its first 2 layers since the stages choose: issue 14, per stage)
    assert any(ph.tp > 1 for ph in p.phases) and any(ph.any_fsdp or ph.any_recompute for ph in p.phases)
    figs = build_figures(p)
    # the last phase trains only the head and runs its frozen prefix split over tp2 (cheaper than caching it)
    assert all(ph.tp > 1 for ph in p.phases) and not p.phases[-1].cache
    for i, ph in enumerate(p.phases):
        mesh = f"{ph.strategy_label} (mesh K × D × tp = {ph.K} × {ph.D} × {ph.tp})"
        for key in ("cluster", "timeline", "memory"):
            assert mesh in figs[key].layout.sliders[0].steps[i].args[1]["title.text"], (key, i)
        d = _step_data(figs["cluster"], i)
        text, hover = d["text"][0], d["hovertext"][0]
        assert f"strategy {ph.strategy_label}" in d["hovertemplate"][0]
        outlines = figs["cluster"].layout.sliders[0].steps[i].args[1]["shapes"]
        assert len(outlines) == ph.K * ph.D  # one per tp group: every stage of every pipeline
        covered = set()
        for o in outlines:
            row, c0 = round(o["y0"] + 0.47), round(o["x0"] + 0.47)
            assert round(o["x1"] + 0.53) - c0 == ph.tp
            cells = [text[row][c] for c in range(c0, c0 + ph.tp)]
            assert len({c.rsplit("<br>t=", 1)[0] for c in cells}) == 1  # one (stage, pipeline) per group
            assert [c.rsplit("<br>t=", 1)[1] for c in cells] == [str(t) for t in range(ph.tp)]
            assert all("tensor-parallel rank" in hover[row][c] for c in range(c0, c0 + ph.tp))
            covered |= {row * gpn + c for c in range(c0, c0 + ph.tp)}  # the grid is node by node here
        assert covered == set(range(ph.world))
    body = _body(report_html(p, figs))
    assert "Strategy (mesh K × D × tp)" in body
    assert all(escape(ph.strategy_label) in body for ph in p.phases)


def test_plain_data_parallel_plans_name_no_strategy(plan, figs):
    assert all(ph.strategy_label == "dp" for ph in plan.phases)
    assert "mesh" not in figs["cluster"].layout.sliders[0].steps[0].args[1]["title.text"]
    assert not figs["cluster"].layout.sliders[0].steps[0].args[1]["shapes"]
    assert "Strategy (mesh" not in _body(report_html(plan, figs))
