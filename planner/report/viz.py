"""Plotly figures of a plan and the one-file, offline HTML report that ``ptplan show`` writes: the
assembly of the page (this module) from the figure modules beside it, whose public names it re-exports.

Legend used on every figure: f frozen blocks; K pipeline length (stages per pipeline); D
data-parallel width (pipelines); M micro-batches per pipeline per iteration; b micro-batch size;
α the freeze rate. Ranks are numbered node by node (rank r lives on node r // devices-per-node).
A rank is a GPU, or a CPU process on a ``cpu:N`` cluster (``Cluster.device_noun``): the report
says which.

Modules: ``style`` (names, colours, limits), ``text`` (words and units), ``layout`` (plotly look and
phase selectors), ``trajectory`` (figures 1-2), ``timeline`` (figure 3), ``throughput`` (figures 4-5),
``comparison`` (predicted against measured); this one: the report page and the ablation page.
"""
from __future__ import annotations

import html
import os
from importlib import metadata
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from ..errors import PtplanError
from ..jsonio import write_atomic
from ..plan import Phase, Plan
from .style import (BASE_COLOUR, CAPACITY_SHOWN_ABOVE, COMPARISON, EVALUATION, FIGURES, FILL_COLOUR, FONT,
                    FORWARD_KINDS, IDLE_COLOUR, KIND_STYLE, KIND_WORDS, MAX_GRID_CELLS, MAX_GRID_COLS,
                    MAX_TIMELINE_EVENTS, MEMORY_TERMS, MIXED_STYLE, PLAN_COLOUR, PLOTLY_CONFIG, SLIDER_MAX_PHASES,
                    STAGE_PALETTE, TIMELINE_BARS_PER_LANE)
from .text import (BYTE_UNITS, _bytes, _duration, _has_strategy, _noun, _nouns, _plural, _ranges, _schedule_name,
                   _strategy_words, _time_unit)
from .layout import _base_layout
from .trajectory import (cluster_figure, Run, trajectory_figure, trajectory_runs)
from .timeline import (Block, steady_state, SteadyState, timeline_blocks, timeline_figure)
from .throughput import (memory_figure, Segment, throughput_figure)
from .comparison import (comparison_figure, evaluation_figure, MEAS_COLOUR, PRED_COLOUR)

if TYPE_CHECKING:
    from ..ablate import Ablation
    from ..compare import Comparison


# ---- the report --------------------------------------------------------------------------------
def build_figures(plan: Plan, comparison: "Comparison | None" = None) -> dict[str, go.Figure]:
    """The five report figures, keyed by FIGURES, in page order; plus ``comparison`` when a run is given."""
    figs = {"trajectory": trajectory_figure(plan), "cluster": cluster_figure(plan),
            "timeline": timeline_figure(plan), "throughput": throughput_figure(plan), "memory": memory_figure(plan)}
    if comparison is not None:
        figs[COMPARISON] = comparison_figure(comparison)
        if comparison.evals:
            figs[EVALUATION] = evaluation_figure(comparison)
    return figs


_CSS = """
:root { --fg:#1f2933; --muted:#6b7280; --line:#e5e7eb; --accent:#4C78A8; --bg:#f8fafc; }
* { box-sizing: border-box; }
body { margin:0; font-family:%(font)s; color:var(--fg); background:var(--bg); font-size:14px; line-height:1.45; }
main { max-width:1240px; margin:0 auto; padding:24px 20px 48px; }
header h1 { font-size:24px; margin:0 0 4px; }
header .sub { color:var(--muted); margin:0 0 16px; }
.warnings { background:#FFF7E6; border:1px solid #F5A524; border-left:6px solid #F5A524; border-radius:8px;
            padding:10px 14px; margin:0 0 14px; }
.warnings h2 { font-size:15px; margin:0 0 4px; color:#8A5300; }
.warnings ul { margin:0; padding-left:20px; }
.warnings li { margin:3px 0; }
.warnings code { font-size:12px; color:#8A5300; }
.cards { display:grid; grid-template-columns:repeat(auto-fill, minmax(210px, 1fr)); gap:10px; margin:0 0 12px; }
.card { background:#fff; border:1px solid var(--line); border-radius:8px; padding:8px 12px; }
.card .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.03em; }
.card .v { font-size:15px; font-weight:600; overflow-wrap:anywhere; }
.card.hero { border-color:var(--accent); }
.card.hero .v { font-size:22px; color:var(--accent); }
.legend { color:var(--muted); font-size:13px; margin:6px 0 0; }
section { background:#fff; border:1px solid var(--line); border-radius:10px; padding:14px 16px 6px; margin:18px 0; }
section h2 { font-size:18px; margin:0 0 2px; }
section p.note { color:var(--muted); margin:0 0 6px; font-size:13px; }
.tablewrap { overflow-x:auto; }
table { border-collapse:collapse; width:100%%; font-size:13px; margin:6px 0 10px; }
th, td { text-align:right; padding:5px 6px; white-space:nowrap; border-bottom:1px solid var(--line);
         vertical-align:top; }
th { color:var(--muted); font-weight:600; background:#f9fafb; position:sticky; top:0; }
td.l, th.l { text-align:left; }
td.mono { font-family:ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size:12px; text-align:left;
          overflow-wrap:anywhere; white-space:normal; min-width:120px; max-width:240px; }
tr.notes td { border-bottom:1px solid var(--line); padding-top:0; }
td.notes { text-align:left; white-space:normal; color:#8A5300; font-size:12px; }
td.notes ul { display:inline; margin:0; padding:0 0 0 4px; list-style:none; }
td.notes li { display:inline; }
td.notes li + li::before { content:" · "; }
tr.has-notes td { border-bottom:none; }
td.wrap { white-space:normal; min-width:120px; }
td .sub { color:var(--muted); font-size:12px; }
tr.base td { color:var(--muted); font-style:italic; white-space:normal; }
.over { color:#D62728; font-weight:600; }
footer { color:var(--muted); font-size:12px; text-align:center; margin-top:24px; }
"""


def _sections(plan: Plan) -> dict[str, tuple[str, str]]:
    """Each figure's heading and the note under it, in the plan's words (GPU or CPU process)."""
    noun, nouns = _noun(plan), _nouns(plan)
    ff = [ph for ph in plan.phases if ph.schedule == "2bw"]
    timeline_heading = ("Pipeline timeline of one iteration" if not ff else
                        "Pipeline timeline: one steady-state period (flush-free)" if len(ff) == len(plan.phases)
                        else "Pipeline timeline of one iteration or steady-state period")
    flush_free = ("" if not ff else
                  ". PipeDream-2BW runs without a flush, so it has no iteration of its own: its phases show the "
                  "continuous pipeline's steady state, one mini-batch per period (shaded), the iteration time "
                  "being the period; the fill and the drain happen once per phase and are left out")
    strategies = ("" if not any(_has_strategy(ph) for ph in plan.phases) else
                  f" With tensor parallelism (tp > 1) each stage of a pipeline runs on an outlined group of tp "
                  f"{nouns} inside one node (t is the tensor-parallel rank): the mesh is K × D × tp. Hover a "
                  f"{noun} for its phase's strategy (tp, FSDP, recomputation).")
    return {
        "trajectory": ("Freeze trajectory",
                       f"As bottom blocks freeze, the active layers fit in fewer stages (K falls) and the freed "
                       f"{nouns} become extra pipelines (D rises); K × D stays the world size. Each step of the "
                       f"lines is a run of optimizer steps at one frozen count; when freezing every N steps a run "
                       f"sits at its share of the epoch. The teal band marks AutoCache fill iterations (the first "
                       f"pass over the data after a freeze computes and stores the frozen prefix's outputs)."),
        "cluster": ("Cluster layout per phase",
                    f"Every {noun} coloured by the pipeline stage s it holds; p is its pipeline (data-parallel "
                    f"replica). Stage 0 also runs the frozen prefix. Hover a {noun} for its layers and predicted "
                    f"memory; move the slider to change phase.{strategies}"),
        "timeline": (timeline_heading,
                     f"Pipeline 0 only (the others are identical), a steady iteration (a fill iteration's time "
                     f"is in the title){flush_free}. Compute on each stage's upper lane (numbers are micro-batches), "
                     f"communication on the thin lower lane, idle (bubbles) light grey. At large M (more than "
                     f"{TIMELINE_BARS_PER_LANE} compute events on a rank) a rank's consecutive events merge into "
                     f"blocks where the idle gap between them is under a threshold, the smallest from 0.1 % of "
                     f"the iteration, doubling, that leaves at most {TIMELINE_BARS_PER_LANE} blocks per lane (the "
                     f"title gives it): a striped block interleaves forwards and backwards (1F1B's steady state), "
                     f"and a block is as opaque as the rank was busy in it (label and hover give the share). "
                     f"Longer gaps stay visible; the all-reduce never merges. Drag to zoom (blocks stay merged)."),
        "throughput": ("Throughput and training time",
                       "Predicted by the simulator against the baseline without freezing. AutoCache fill "
                       "iterations (teal) are charged at their own, slower time; phase transitions are not "
                       "included (ptplan compare measures them)."),
        "memory": ("Peak memory per stage",
                   f"Each stage's predicted peak, term by term: weights, gradients, optimizer state, buffers, "
                   f"and the larger of the activations in flight and the transient after the pipeline drains "
                   f"(they never coexist), against the {noun}'s capacity. Units follow the numbers."),
        COMPARISON: ("Predicted against measured",
                     "A real run of this plan (ptplan run --log) beside the prediction, phase by phase: the median "
                     "step time (first step of each phase and the memory-sampled step left out) and the sampled "
                     "peak memory of the fullest rank; labels give (predicted − measured) / measured."),
        EVALUATION: ("Held-out evaluation",
                     "The run's evaluations on its --eval-data set (at each epoch end and every --eval-every "
                     "steps), computed through the running pipeline: loss, and accuracy (classification) or "
                     "perplexity (language modelling)."),
    }


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _warnings_html(plan: Plan) -> str:
    if not plan.warnings:
        return ""
    items = "".join(f"<li><code>{_esc(w.code)}</code> {_esc(w.message)}</li>" for w in plan.warnings)
    n = len(plan.warnings)
    return (f'<div class="warnings" id="warnings" role="alert"><h2>{n} warning{"s" if n != 1 else ""}: read '
            f"before trusting the numbers</h2><ul>{items}</ul></div>")


def _profile_words(plan: Plan) -> str:
    p = plan.inputs.profile
    how = f"({p.device_kind}, {p.dtype}, seq {p.seq_len})"
    if p.source == "synthetic":
        return f"synthetic: analytic numbers, not measured {how}"
    if p.source == "projected":
        return f"projected for {p.device}, not measured {how}"
    return f"measured on {p.device} {how}"


def _header(plan: Plan) -> str:
    inp = plan.inputs
    prof, tr, fr, c = inp.profile, inp.training, inp.freeze, inp.cluster
    noun = _noun(plan)
    total = plan.totals.seconds
    unit, div = _time_unit(max(total, plan.baseline.seconds))
    ph0 = plan.phases[0]
    model_desc = f"{prof.model} · {prof.num_blocks} blocks → {prof.num_layers} layers"
    if prof.granularity:
        model_desc += f" ({'block halves' if prof.granularity == 'half' else 'whole blocks'})"
    cluster_desc = (f"{c.name}: {_plural(c.nodes, 'node')} × {_plural(c.gpus_per_node, noun)}"
                    + (f" ({c.gpu_name})" if c.gpu_name and c.gpu_name != noun else "")
                    + f", {_bytes(c.gpu_memory_bytes)} each")
    freeze = fr.policy + (f", α = {fr.alpha:.3g}" if fr.policy == "geometric" else "")
    if fr.policy == "manual":
        freeze += f" {list(fr.manual)}"
    if fr.policy != "none":
        freeze += ", per epoch" if fr.every == "epoch" else f", every {fr.every} steps"
    if fr.adaptive:
        freeze += ", adaptive"
    t = plan.totals
    items = [
        ("Predicted speedup", f"{t.speedup:.2f}×", True),
        ("Training time", f"{total / div:.3g} vs {plan.baseline.seconds / div:.3g} {unit} (baseline)", False),
    ]
    if t.best_static_seconds != plan.baseline.seconds:
        items.append(("Against the best static", f"{t.speedup_vs_best_static:.2f}× (K={t.best_static_K}, "
                                                 f"M={t.best_static_M}: {t.best_static_seconds / div:.3g} {unit})",
                      False))
    if t.fill_seconds > 0:
        items.append(("AutoCache fills", f"+{_duration(t.fill_seconds)} ({t.fill_seconds / total:.1%} of the "
                                         f"plan)" if total > 0 else f"+{_duration(t.fill_seconds)}", False))
    items += [
        ("Model", model_desc, False),
        ("Profile", _profile_words(plan), False),
        ("Cluster", cluster_desc, False),
        ("World size", _plural(plan.world_size, noun), False),
        ("Freeze policy", freeze, False),
        ("Epochs", f"{tr.epochs:,} × {tr.samples_per_epoch:,} samples", False),
        ("Batch policy", f"{tr.batch_policy}, " + (f"pipeline batch {ph0.pipeline_batch}"
                                                   if tr.batch_policy == "constant-pipeline"
                                                   else f"global batch {ph0.global_batch}"), False),
        ("Schedule", f"{_schedule_name(tr.schedule)} · {tr.optimizer} · cache {tr.cache}", False),
    ]
    cards = "".join(f'<div class="card{" hero" if hero else ""}"><div class="k">{_esc(k)}</div>'
                    f'<div class="v">{_esc(v)}</div></div>' for k, v, hero in items)
    return (f"<header><h1>ptplan report — {_esc(prof.model)}</h1>"
            f'<p class="sub">Elastic pipelined training plan (PipeTransformer-style freezing), '
            f"{len(plan.phases)} phases, {_esc(_plural(plan.world_size, noun))}.</p>"
            f"{_warnings_html(plan)}"
            f'<div class="cards">{cards}</div>'
            f'<p class="legend"><b>Legend:</b> f frozen blocks · K pipeline length (stages per pipeline) · '
            f"D data-parallel width (pipelines) · M micro-batches per pipeline per iteration · b micro-batch size "
            f"· α freeze rate. Layer ranges are inclusive indices into the profile's layer list.</p></header>")


def _phase_table(plan: Plan) -> str:
    cap = float(plan.inputs.cluster.gpu_memory_bytes)
    runs: dict[int, list[Run]] = {}
    for r in trajectory_runs(plan):
        runs.setdefault(r.phase, []).append(r)
    strat = any(_has_strategy(ph) for ph in [*plan.phases, plan.baseline.phase])
    head = ("<tr><th class='l'>Phase</th><th>Frozen</th><th>K</th><th>D</th><th>M × b</th>"
            + ("<th class='l'>Strategy (mesh K × D × tp)</th>" if strat else "")
            + "<th class='l'>Partition (layers per stage)</th><th>Cache</th><th>Iteration</th><th>Bubble</th>"
            "<th>Samples/s</th><th>Max peak memory</th><th class='l'>On the trajectory</th></tr>")

    def row(name: str, ph: Phase, where: str, cls: str = "") -> str:
        pr = ph.predicted
        part = " ".join(str(a) if b - 1 == a else f"{a}–{b - 1}" for a, b in ph.partition)
        peak = pr.peak_memory_bytes
        over = peak > cap
        memtxt = f"{_esc(_bytes(peak))}<br><span class='sub'>{peak / cap:.1%} of {_esc(_bytes(cap))}</span>"
        cache = "off"
        if ph.cache:
            cache = "on" + (f"<br><span class='sub'>{_esc(_bytes(pr.cache_host_bytes_per_node))} host/node</span>"
                            if pr.cache_host_bytes_per_node else "")
        it = _esc(_duration(pr.iteration_s)) + (f"<br><span class='sub'>fill {_esc(_duration(pr.fill_iteration_s))}"
                                                f"</span>" if pr.fill_iteration_s else "")
        if ph.schedule == "2bw":
            it += "<br><span class='sub'>steady-state period (flush-free)</span>"
        strategy = (f"<td class='l wrap'>{_esc(ph.strategy_label)}<br><span class='sub'>{ph.K} × {ph.D} × {ph.tp}: "
                    f"{_esc(_strategy_words(ph))}</span></td>" if strat else "")
        notes = "".join(f"<li>{_esc(n)}</li>" for n in ph.notes)
        tr_cls = f"{cls} has-notes" if ph.notes else cls
        note_row = (f"<tr class='notes {cls}'><td></td><td colspan='{11 + strat}' class='notes'><b>Note"
                    f"{'s' if len(ph.notes) > 1 else ''}:</b><ul>{notes}</ul></td></tr>" if notes else "")
        return (f"<tr class='{tr_cls}'><td class='l'>{_esc(name)}</td><td>{ph.frozen_blocks}</td><td>{ph.K}</td>"
                f"<td>{ph.D}</td><td>{ph.M} × {ph.micro_batch_size}</td>{strategy}<td class='mono'>{_esc(part)}</td>"
                f"<td class='wrap'>{cache}</td><td>{it}</td>"
                f"<td>{pr.bubble_fraction:.0%}</td><td>{pr.samples_per_s:,.0f}</td>"
                f"<td class='{'over' if over else ''}'>{memtxt}</td><td class='l wrap'>{where}</td></tr>{note_row}")

    def where(i: int) -> str:
        rs = runs.get(i)
        if not rs:
            return "— (adaptive only)"
        eps = sorted({e for r in rs for e in r.epochs})
        n = sum(r.iterations for r in rs)
        fill = sum(r.fill_iterations for r in rs)
        return (f"epoch{'s' if len(eps) > 1 else ''} {_ranges(eps)}<br><span class='sub'>{n:,} iterations"
                + (f", {fill:,} fill" if fill else "") + "</span>")

    rows = [row(str(i), ph, where(i)) for i, ph in enumerate(plan.phases)]
    rows.append(row("baseline", plan.baseline.phase, "every epoch (no freezing)", "base"))
    return f"<div class='tablewrap'><table><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table></div>"


def _version() -> str:
    try:
        return metadata.version("ptplan")
    except metadata.PackageNotFoundError:
        return "dev"


def report_html(plan: Plan, figures: dict[str, go.Figure] | None = None,
                comparison: "Comparison | None" = None) -> str:
    """The whole report as one self-contained HTML string (plotly.js embedded once, no network needed).

    With ``comparison`` (``planner.compare.compare`` of a run of this plan) the report ends with the
    predicted-against-measured figure.
    """
    figs = figures if figures is not None else build_figures(plan, comparison)
    sections = _sections(plan)
    parts = []
    for key in FIGURES + tuple(k for k in (COMPARISON, EVALUATION) if k in figs):
        title, note = sections[key]
        div = figs[key].to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{key}",
                                config=PLOTLY_CONFIG, default_width="100%")
        parts.append(f'<section id="{key}"><h2>{_esc(title)}</h2><p class="note">{_esc(note)}</p>{div}</section>')
        if key == "trajectory":
            parts.append('<section id="phases"><h2>Phases</h2><p class="note">One phase per frozen-block count '
                         "that can occur; predictions per iteration of one global batch (with the AutoCache, a fill "
                         "iteration's time below). Notes say where a phase departs from what was asked."
                         f"</p>{_phase_table(plan)}</section>")
    model = plan.inputs.profile.model
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>ptplan report — {_esc(model)}</title><style>{_CSS % {'font': FONT}}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body><main>"
            f"{_header(plan)}{''.join(parts)}"
            f"<footer>Generated by ptplan {_esc(_version())} from a {_esc(plan.schema)} plan. "
            f"Works offline: plotly.js is embedded.</footer></main></body></html>\n")


def write_report(plan: Plan, path: str | os.PathLike, comparison: "Comparison | None" = None) -> None:
    """Write the report to ``path`` atomically (no half-written file on failure)."""
    parent = os.path.dirname(os.fspath(path)) or "."
    if not os.path.isdir(parent):
        raise PtplanError(f"output folder does not exist: {parent}")
    write_atomic(path, report_html(plan, comparison=comparison))


# ---- the ablation (ptplan ablate --report) -------------------------------------------------------
def ablation_figure(ab: "Ablation") -> go.Figure:
    """Predicted speedup of every ablation row over the no-freezing baseline, with the paper's published
    bars beside the rows it has (PyTorch blog Fig. 9: ViT-B/16, ImageNet, 2 x 8 Quadro RTX 5000), and the
    classic layouts without freezing (``Ablation.baselines``; grey where they do not fit in memory)."""
    rows = [r for r in ab.rows if r.speedup is not None]
    labels = [f"{r.number}. {r.label}" for r in rows]
    fig = go.Figure()
    fig.add_trace(go.Bar(
        y=labels, x=[r.speedup for r in rows], orientation="h", name=f"ptplan ({ab.model}, {ab.cluster})",
        marker_color=[PLAN_COLOUR if r.number <= 6 else "#72B7B2" for r in rows],
        text=[f"{r.speedup:.2f}×" for r in rows], textposition="outside",
        customdata=[[(r.seconds or 0.0) / 3600, r.speedup_vs or 0.0, r.versus] for r in rows],
        hovertemplate="%{y}<br>%{x:.2f}× the baseline<br>%{customdata[0]:.2f} h predicted<br>"
                      "%{customdata[1]:.2f}× over row %{customdata[2]}<extra></extra>"))
    base = [(b, ab.baseline_speedup(b)) for b in ab.baselines if b.seconds]
    if base:  # the classic layouts without freezing (planner/baselines.py), memory in the hover
        fig.add_trace(go.Bar(
            y=[f"B. {b.label}" for b, _ in base], x=[x for _, x in base], orientation="h",
            name="baselines, no freezing", marker_color=[BASE_COLOUR if b.fits else "#BAB0AC" for b, _ in base],
            text=[f"{x:.2f}×" + ("" if b.fits else " (does not fit)") for b, x in base], textposition="outside",
            customdata=[[(b.seconds or 0.0) / 3600, b.peak_memory_bytes / 2**30, b.fit_text] for b, _ in base],
            hovertemplate="%{y}<br>%{x:.2f}× the baseline<br>%{customdata[0]:.2f} h predicted<br>"
                          "%{customdata[1]:.2f} GiB per GPU: %{customdata[2]}<extra></extra>"))
        labels = labels + [f"B. {b.label}" for b, _ in base]
    paper = [(lab, r.paper_speedup) for lab, r in zip(labels, rows) if r.paper_speedup is not None]
    if paper:
        fig.add_trace(go.Scatter(y=[p[0] for p in paper], x=[p[1] for p in paper], mode="markers",
                                 marker=dict(symbol="diamond", size=12, color="#E45756"),
                                 name="the paper's bar (ViT-B/16 ImageNet, 2 x 8 RTX 5000)",
                                 hovertemplate="paper: %{x:.2f}×<extra></extra>"))
    fig.add_vline(x=1.0, line_dash="dot", line_color=BASE_COLOUR)
    _base_layout(fig, f"Where the speedup comes from — {ab.model} on {ab.cluster}", 120 + 42 * len(labels),
                 legend_right=False)
    fig.update_layout(xaxis_title="predicted speedup over no freezing (×)", bargap=0.35,
                      yaxis=dict(autorange="reversed"))
    return fig


def ablation_html(ab: "Ablation", table_text: str) -> str:
    """The ablation as one self-contained HTML page: the figure and the table the CLI prints."""
    fig = ablation_figure(ab).to_html(full_html=False, include_plotlyjs=False, div_id="fig-ablation",
                                      config=PLOTLY_CONFIG, default_width="100%")
    warn = "".join(f"<li>{_esc(w)}</li>" for w in ab.warnings)
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>ptplan ablation — {_esc(ab.model)}</title><style>{_CSS % {'font': FONT}}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body><main>"
            f"<header><h1>Ablation — {_esc(ab.model)} on {_esc(ab.cluster)}</h1>"
            + (f"<div class='warnings'><ul>{warn}</ul></div>" if warn else "")
            + f"</header><section>{fig}</section><section><h2>Table</h2><pre>{_esc(table_text)}</pre></section>"
            f"<footer>Generated by ptplan {_esc(_version())}. Works offline: plotly.js is embedded.</footer>"
            f"</main></body></html>\n")
