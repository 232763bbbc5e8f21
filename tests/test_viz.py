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
from ptplan.planner.viz import (FIGURES, MAX_GRID_CELLS, SLIDER_MAX_PHASES, TIMELINE_BARS_PER_LANE, build_figures,
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
