"""Plotly figures of a plan and the one-file, offline HTML report that ``ptplan show`` writes.

Legend used on every figure: f frozen blocks; K pipeline length (stages per pipeline); D
data-parallel width (pipelines); M micro-batches per pipeline per iteration; b micro-batch size;
α the freeze rate. Ranks are numbered node by node (rank r lives on node r // GPUs-per-node).
"""
from __future__ import annotations

import dataclasses
import html
import math
import os
from importlib import metadata
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from .errors import PtplanError
from .jsonio import write_atomic
from .plan import Phase, Plan

if TYPE_CHECKING:
    from .compare import Comparison

GIB = float(1 << 30)
FIGURES = ("trajectory", "cluster", "timeline", "throughput", "memory")
"""Keys of ``build_figures``' result, in page order."""
COMPARISON = "comparison"
"""Key of the extra figure ``build_figures(plan, comparison)`` adds: predicted against measured (last)."""

MAX_GRID_CELLS = 128
"""The GPU grid draws at most this many GPUs (whole rows); larger clusters repeat the same layout."""
MAX_GRID_COLS = 16
"""Nodes with more GPUs than this are wrapped over several rows."""
MAX_TIMELINE_EVENTS = 20_000
"""Per phase; a longer timeline is cut (earliest events kept) with a note."""
SLIDER_MAX_PHASES = 20
"""Up to this many phases get a slider; more get a dropdown."""

# Vega/Tableau-10 based; one hue family per concept: blue forward, orange backward, grey frozen.
KIND_STYLE: dict[str, tuple[str, str, str]] = {
    # kind: (legend name, colour, lane)
    "PREFIX": ("Frozen prefix (no-grad forward)", "#9D9D9D", "compute"),
    "CACHE": ("Frozen prefix read from cache", "#72B7B2", "compute"),
    "F": ("Forward", "#4C78A8", "compute"),
    "B": ("Backward", "#F58518", "compute"),
    "W": ("Weight gradient", "#E45756", "compute"),
    "SEND_F": ("Send activations", "#9ECAE9", "comm"),
    "RECV_F": ("Receive activations", "#2E5F8A", "comm"),
    "SEND_B": ("Send gradients", "#FFBF79", "comm"),
    "RECV_B": ("Receive gradients", "#B8590B", "comm"),
    "ALLREDUCE": ("Gradient all-reduce (data parallel)", "#B279A2", "comm"),
}
IDLE_COLOUR = "#EEF0F3"
STAGE_PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
                 "#9D755D", "#BAB0AC", "#1F77B4", "#2CA02C", "#D62728", "#9467BD", "#8C564B", "#17BECF")
PLAN_COLOUR, BASE_COLOUR = "#4C78A8", "#7F7F7F"
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True,
                 "toImageButtonOptions": {"format": "png", "scale": 2},
                 "modeBarButtonsToRemove": ["lasso2d", "select2d"]}


# ---- small formatting helpers ---------------------------------------------------------------
def _stage_colour(s: int) -> str:
    return STAGE_PALETTE[s % len(STAGE_PALETTE)]


def _time_unit(seconds: float) -> tuple[str, float]:
    """A unit for an axis whose largest value is ``seconds``: (name, seconds per unit)."""
    if seconds >= 3 * 3600:
        return "hours", 3600.0
    if seconds >= 180:
        return "minutes", 60.0
    return "seconds", 1.0


def _gib(b: float) -> str:
    return f"{b / GIB:.1f} GiB"


def _layers(lo: int, hi: int) -> str:
    """Half-open [lo, hi) as words."""
    return f"layer {lo}" if hi - lo == 1 else f"layers {lo}–{hi - 1}"


def _schedule_name(s: str) -> str:
    return {"gpipe": "GPipe", "1f1b": "1F1B"}.get(s, s)


def _phase_title(i: int, ph: Phase) -> str:
    return f"phase {i}: {ph.frozen_blocks} frozen blocks · K={ph.K} × D={ph.D} · M={ph.M}"


def _base_layout(fig: go.Figure, title: str, height: int, legend_right: bool = True) -> None:
    fig.update_layout(
        template="plotly_white", height=height, font=dict(family=FONT, size=13, color="#1f2933"),
        title=dict(text=title, x=0.0, xanchor="left", y=1.0, yanchor="top", pad=dict(t=12), font=dict(size=16)),
        margin=dict(l=70, r=30, t=70, b=60), hoverlabel=dict(font=dict(family=FONT, size=12)),
        legend=(dict(orientation="v", x=1.02, xanchor="left", y=1.0, yanchor="top", font=dict(size=12))
                if legend_right else dict(orientation="h", x=0, y=-0.18, yanchor="top")),
    )


def _cluster_info(plan: Plan) -> dict[str, Any]:
    return dataclasses.asdict(plan.inputs.cluster)


def _cluster_shape(plan: Plan) -> tuple[int, int]:
    """(nodes, GPUs per node), falling back to one node holding every rank."""
    world = plan.world_size
    c = _cluster_info(plan)
    gpn = c.get("gpus_per_node")
    nodes = c.get("nodes")
    if not isinstance(gpn, int) or gpn < 1:
        gpn = world if not isinstance(nodes, int) or nodes < 1 else math.ceil(world / nodes)
    nodes = max(math.ceil(world / gpn), nodes if isinstance(nodes, int) and nodes > 0 else 1)
    return nodes, gpn


def _capacity(plan: Plan) -> float | None:
    cap = _cluster_info(plan).get("gpu_memory_bytes")
    return float(cap) if isinstance(cap, (int, float)) and cap > 0 else None


def _add_selector(fig: go.Figure, labels: Sequence[str], groups: Sequence[Sequence[int]],
                  layouts: Sequence[dict[str, Any]], prefix: str, always: Sequence[int] = ()) -> None:
    """A phase selector: step i shows the traces in groups[i] (plus ``always``) and applies layouts[i]."""
    n = len(fig.data)
    masks = []
    for g in groups:
        vis = [False] * n
        for t in [*g, *always]:
            vis[t] = True
        masks.append(vis)
    for t, v in enumerate(masks[0]):
        fig.data[t].visible = v
    for key, value in layouts[0].items():  # the initial view is step 0 (plotly_relayout drops annotations)
        fig.layout[key] = value
    steps = [dict(method="update", label=lab, args=[{"visible": m}, dict(lay)])
             for lab, m, lay in zip(labels, masks, layouts)]
    if len(steps) <= SLIDER_MAX_PHASES:
        fig.update_layout(sliders=[dict(
            active=0, steps=steps, x=0.0, len=1.0, y=0, yanchor="top", pad=dict(t=40, b=0),
            currentvalue=dict(prefix=prefix, font=dict(size=13), xanchor="left"),
            font=dict(size=11))])
    else:
        fig.update_layout(updatemenus=[dict(
            type="dropdown", active=0, x=1.0, xanchor="right", y=1.12, yanchor="bottom",
            buttons=[dict(method=s["method"], label=prefix + s["label"], args=s["args"]) for s in steps])])


def _phase_labels(plan: Plan) -> list[str]:
    return [str(ph.frozen_blocks) for ph in plan.phases]


# ---- 1. freeze trajectory with K and D --------------------------------------------------------
def trajectory_figure(plan: Plan) -> go.Figure:
    """Frozen blocks per epoch (top) and K, D per epoch (bottom) on one shared epoch axis."""
    L = plan.inputs.profile.num_blocks
    traj = plan.trajectory
    ep = np.array([t.epoch for t in traj], dtype=float)
    frozen = np.array([t.frozen_blocks for t in traj], dtype=float)
    Ks = np.array([plan.phases[t.phase].K for t in traj], dtype=float)
    Ds = np.array([plan.phases[t.phase].D for t in traj], dtype=float)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.55, 0.45],
                        subplot_titles=("Frozen Transformer blocks", "Pipeline length K and data-parallel width D"))
    cd = np.column_stack([[t.phase for t in traj], Ks, Ds, [t.seconds for t in traj]]) if traj else None
    fig.add_trace(go.Scatter(
        x=ep, y=frozen, mode="lines+markers", line=dict(shape="hv", width=3, color="#54A24B"),
        marker=dict(size=8), name="Frozen blocks f", customdata=cd,
        hovertemplate="Epoch %{x}<br>%{y} of " + str(L) + " blocks frozen<br>Phase %{customdata[0]}: "
                      "K=%{customdata[1]} × D=%{customdata[2]}<br>%{customdata[3]:.1f} s this epoch<extra></extra>"),
        row=1, col=1)
    alpha = plan.inputs.freeze.alpha if plan.inputs.freeze.policy == "geometric" else None
    if isinstance(alpha, (int, float)) and 0 < alpha < 1 and len(ep):
        xs = np.linspace(ep.min(), ep.max(), 60)
        fig.add_trace(go.Scatter(
            x=xs, y=L * (1 - (1 - alpha) ** xs), mode="lines", line=dict(dash="dot", color="#9D9D9D", width=2),
            name=f"Bound L·(1−(1−α)^epoch), α={alpha:.3g}",
            hovertemplate="Epoch %{x:.1f}: bound %{y:.1f} blocks<extra></extra>"), row=1, col=1)
    # D first, wide and translucent, so K stays visible where the two coincide
    fig.add_trace(go.Scatter(
        x=ep, y=Ds, mode="lines+markers", line=dict(shape="hv", width=6, color="rgba(76,120,168,0.55)"),
        marker=dict(size=11, symbol="diamond", color="#4C78A8"), name="D: parallel pipelines",
        hovertemplate="Epoch %{x}: D = %{y} pipelines<extra></extra>"), row=2, col=1)
    fig.add_trace(go.Scatter(
        x=ep, y=Ks, mode="lines+markers", line=dict(shape="hv", width=2.5, color="#E45756"),
        marker=dict(size=7, symbol="square"), name="K: stages per pipeline",
        hovertemplate="Epoch %{x}: K = %{y} stages<extra></extra>"), row=2, col=1)
    vals = np.concatenate([Ks, Ds]) if traj else np.array([1.0])
    top = int(math.ceil(math.log2(max(vals.max(), 1))))
    ticks = [2 ** i for i in range(0, top + 1)]
    if len(ticks) > 12:
        ticks = ticks[::2]
    _base_layout(fig, "Freeze trajectory: frozen blocks, pipeline length and data-parallel width per epoch", 560)
    fig.update_yaxes(title_text=f"Frozen blocks (of {L})", range=[-0.5, L + 0.8], row=1, col=1)
    fig.update_yaxes(title_text="GPUs (log scale)", type="log", tickvals=ticks, ticktext=[str(t) for t in ticks],
                     range=[-0.15, math.log10(max(vals.max(), 1)) + 0.15], row=2, col=1)
    fig.update_xaxes(title_text="Epoch", dtick=1 if len(ep) <= 30 else None, row=2, col=1)
    fig.update_xaxes(dtick=1 if len(ep) <= 30 else None, row=1, col=1)
    fig.update_annotations(font_size=13, x=0, xanchor="left")
    return fig


# ---- 2. GPU grid per phase ---------------------------------------------------------------------
def cluster_figure(plan: Plan) -> go.Figure:
    """Each GPU as a cell (rows: nodes), coloured by the pipeline stage it holds; one view per phase."""
    world = plan.world_size
    nodes, gpn = _cluster_shape(plan)
    cols = min(gpn, MAX_GRID_COLS)
    rows_per_node = math.ceil(gpn / cols)
    total_rows = nodes * rows_per_node
    shown_rows = max(1, min(total_rows, MAX_GRID_CELLS // cols))
    cap = _capacity(plan)
    show_text = shown_rows * cols <= 128
    ylabels = []
    for r in range(shown_rows):
        node, part = divmod(r, rows_per_node)
        span = f" · GPUs {part * cols}–{part * cols + cols - 1}" if rows_per_node > 1 else ""
        ylabels.append(f"Node {node}{span}")
    xlabels = [f"GPU {c}" for c in range(cols)] if rows_per_node == 1 else [f"+{c}" for c in range(cols)]
    fig = go.Figure()
    groups, layouts = [], []
    for i, ph in enumerate(plan.phases):
        where = {}
        for p, row in enumerate(ph.ranks):
            for s, r in enumerate(row):
                where[r] = (p, s)
        z = np.full((shown_rows, cols), np.nan)
        text = [[""] * cols for _ in range(shown_rows)]
        hover = [["no rank (unused GPU)"] * cols for _ in range(shown_rows)]
        mem = ph.predicted.stage_peak_memory_bytes
        for r in range(world):
            node, local = divmod(r, gpn)
            row, col = node * rows_per_node + local // cols, local % cols
            if row >= shown_rows:
                continue
            p, s = where[r]
            lo, hi = ph.partition[s]
            z[row, col] = ph.K - 1 - s  # reversed, so the colour bar lists stage 0 at the top
            text[row][col] = f"s={s}<br>p={p}"
            prefix = ""
            if s == 0 and ph.frozen_layers:
                how = "read from cache" if ph.cache else "recomputed under no_grad"
                prefix = f"<br>Frozen prefix {_layers(0, ph.frozen_layers)} ({how})"
            memtxt = f"{_gib(mem[s])}" + (f" of {_gib(cap)} ({mem[s] / cap:.0%})" if cap else "")
            hover[row][col] = (f"<b>Rank {r}</b> · node {node}, GPU {local}<br>Pipeline p={p} of D={ph.D} · "
                               f"stage s={s} of K={ph.K}<br>Active {_layers(lo, hi)}{prefix}"
                               f"<br>Predicted peak memory {memtxt}")
        K = ph.K
        scale = []
        for v in range(K):
            c = _stage_colour(K - 1 - v)
            scale += [[v / K, c], [(v + 1) / K, c]]
        stages = list(range(K)) if K <= 16 else list(range(0, K, math.ceil(K / 16)))
        tickvals, ticktext = [], []
        for s in stages:
            lo, hi = ph.partition[s]
            extra = " + frozen prefix" if s == 0 and ph.frozen_layers else ""
            tickvals.append(K - 1 - s)
            ticktext.append(f"Stage {s}: {_layers(lo, hi)}{extra}")
        fig.add_trace(go.Heatmap(
            z=z, x=xlabels, y=ylabels, zmin=-0.5, zmax=K - 0.5, colorscale=scale, xgap=3, ygap=3,
            text=text, texttemplate="%{text}" if show_text else None, textfont=dict(size=11),
            hovertext=hover, hovertemplate="%{hovertext}<extra></extra>", name=f"phase {i}",
            colorbar=dict(title=dict(text=f"Stage (K={K})", side="top"), tickvals=tickvals, ticktext=ticktext,
                          thickness=14, len=1.0, y=0.5, yanchor="middle", outlinewidth=0)))
        groups.append([i])
        note = ""
        if shown_rows < total_rows:
            note = (f"<br><sup>Showing the first {shown_rows * cols} of {nodes * gpn} GPUs; the other nodes "
                    f"repeat the same stage layout</sup>")
        layouts.append({"title.text": f"GPU assignment — {_phase_title(i, ph)}{note}"})
    height = int(min(900, max(200, 130 + 34 * shown_rows * (1.6 if show_text else 1))))
    _base_layout(fig, "GPU assignment", height + 90)
    fig.update_layout(margin=dict(l=130 if rows_per_node > 1 else 80, r=30, t=80 if shown_rows < total_rows else 60,
                                  b=40))
    fig.update_xaxes(side="top", showgrid=False)
    fig.update_yaxes(autorange="reversed", showgrid=False, title_text="")
    _add_selector(fig, _phase_labels(plan), groups, layouts, "Frozen blocks: ")
    return fig


# ---- 3. pipeline timeline (Gantt) ----------------------------------------------------------------
def _placeholder(msg: str) -> dict[str, Any]:
    return dict(text=msg, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                font=dict(size=15, color="#6b7280"))


def timeline_figure(plan: Plan) -> go.Figure:
    """One iteration of pipeline 0 per phase: compute on the upper lane of each rank, communication below."""
    fig = go.Figure()
    # the idle legend entry: rows are drawn on an idle-coloured band, so gaps read as bubbles
    fig.add_trace(go.Bar(x=[None], y=[None], orientation="h", marker_color=IDLE_COLOUR, name="Idle (pipeline bubble)",
                         hoverinfo="skip", showlegend=True))
    groups, layouts = [], []
    Kmax = max(ph.K for ph in plan.phases)
    for i, ph in enumerate(plan.phases):
        tl = sorted(ph.timeline, key=lambda e: (e.start, e.rank))
        cut = len(tl) > MAX_TIMELINE_EVENTS
        tl = tl[:MAX_TIMELINE_EVENTS]
        first = len(fig.data)
        ranks0 = ph.ranks[0]
        span = max((e.end for e in tl), default=0.0)
        # micro-batch numbers inside bars only where every bar is wide enough (~18 px of a ~700 px axis)
        compute = [e.end - e.start for e in tl if KIND_STYLE.get(e.kind, ("", "", ""))[2] == "compute"]
        label_mbs = bool(compute) and span > 0 and float(np.median(compute)) / span * 700 >= 18 and ph.M <= 99
        for kind, (name, colour, lane) in KIND_STYLE.items():
            ev = [e for e in tl if e.kind == kind]
            if not ev:
                continue
            start = np.array([e.start for e in ev]) * 1e3
            end = np.array([e.end for e in ev]) * 1e3
            pos = np.array([e.rank for e in ev], dtype=float)
            comm = lane == "comm"
            y = pos + (0.27 if comm else -0.12)
            cd = np.column_stack([[e.mb for e in ev], [e.stage for e in ev],
                                  [ranks0[e.rank] if e.rank < len(ranks0) else e.rank for e in ev],
                                  start, end, end - start])
            mbtxt = "" if kind == "ALLREDUCE" else " · micro-batch %{customdata[0]}"
            fig.add_trace(go.Bar(
                x=end - start, base=start, y=y, width=0.22 if comm else 0.6, orientation="h", name=name,
                legendgroup=kind, marker=dict(color=colour, line=dict(width=0.5, color="white")),
                customdata=cd,
                text=np.array([e.mb for e in ev]) if label_mbs and not comm else None, textposition="inside",
                insidetextanchor="middle", textfont=dict(color="white", size=10),
                hovertemplate=(f"<b>{name}</b>{mbtxt}<br>Stage %{{customdata[1]}} (rank %{{customdata[2]}})<br>"
                               "%{customdata[3]:.2f} → %{customdata[4]:.2f} ms (%{customdata[5]:.2f} ms)"
                               "<extra></extra>")))
        groups.append(list(range(first, len(fig.data))))
        K = ph.K
        end_ms = (span or ph.predicted.iteration_s) * 1e3
        shapes = [dict(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=s - 0.45, y1=s + 0.42,
                       fillcolor=IDLE_COLOUR, line=dict(width=0), layer="below") for s in range(K)]
        anns = []
        if not tl:
            anns.append(_placeholder("No timeline recorded for this phase"))
        elif cut:
            anns.append(dict(text=f"showing the first {MAX_TIMELINE_EVENTS} of {len(ph.timeline)} events",
                             x=1, y=1.0, xref="paper", yref="paper", xanchor="right", yanchor="bottom",
                             showarrow=False, font=dict(size=11, color="#6b7280")))
        pr = ph.predicted
        layouts.append({
            "title.text": (f"Iteration timeline of pipeline 0 — {_phase_title(i, ph)} · "
                           f"{_schedule_name(ph.schedule)}<br><sup>{pr.iteration_s * 1e3:.1f} ms per iteration · "
                           f"bubble {pr.bubble_fraction:.0%}"
                           + (f" · exposed all-reduce {pr.allreduce_s * 1e3:.1f} ms" if ph.D > 1 else "")
                           + "</sup>"),
            "yaxis.tickvals": list(range(K)),
            "yaxis.ticktext": [f"Stage {s} · rank {ph.ranks[0][s]}" for s in range(K)],
            "yaxis.range": [K - 0.5, -0.5],
            "xaxis.range": [0, end_ms * 1.02 if end_ms > 0 else 1],
            "shapes": shapes if tl else [],
            "annotations": anns,
            "xaxis.visible": bool(tl), "yaxis.visible": bool(tl),
        })
    kinds = {e.kind for ph in plan.phases for e in ph.timeline}
    legend_px = 27 * (len(kinds) + 1)  # the legend must fit beside the plot without scrolling
    height = int(min(800, max(260 + legend_px, 190 + 56 * Kmax)))
    _base_layout(fig, "Iteration timeline", height)
    fig.update_layout(barmode="overlay", bargap=0, uniformtext=dict(minsize=8, mode="hide"),
                      margin=dict(l=130, r=30, t=72, b=60), hovermode="closest")
    fig.update_xaxes(title_text="Time within one iteration (ms)", zeroline=False)
    fig.update_yaxes(showgrid=False, zeroline=False)
    _add_selector(fig, _phase_labels(plan), groups, layouts, "Frozen blocks: ", always=[0])
    return fig


# ---- 4. throughput and cumulative time against the baseline ------------------------------------
def throughput_figure(plan: Plan) -> go.Figure:
    """Samples/s per epoch and cumulative training time, elastic plan versus the static baseline."""
    traj = plan.trajectory
    spe = plan.inputs.training.samples_per_epoch
    ep = np.array([t.epoch for t in traj], dtype=float)
    thr = []
    for t in traj:
        ph = plan.phases[t.phase]
        if isinstance(spe, (int, float)) and spe > 0 and t.seconds > 0:
            thr.append(spe / t.seconds)
        else:
            thr.append(ph.predicted.samples_per_s)
    thr = np.array(thr, dtype=float)
    base_thr = plan.baseline.phase.predicted.samples_per_s
    n = max(len(traj), 1)
    base_epoch_s = plan.baseline.seconds / n
    cum = np.cumsum([t.seconds for t in traj])
    base_cum = base_epoch_s * np.arange(1, len(traj) + 1)
    total = plan.totals.seconds
    speedup = plan.totals.speedup
    unit, div = _time_unit(max(plan.baseline.seconds, total))
    bph = plan.baseline.phase
    base_name = f"Baseline: no freezing, static K={bph.K} × D={bph.D}"
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("Throughput per epoch", "Cumulative training time"))
    cd = np.column_stack([[t.frozen_blocks for t in traj], [plan.phases[t.phase].K for t in traj],
                          [plan.phases[t.phase].D for t in traj], [t.seconds for t in traj],
                          thr / base_thr if base_thr > 0 else np.zeros_like(thr)]) if traj else None
    fig.add_trace(go.Scatter(
        x=ep, y=thr, mode="lines+markers", name="Elastic plan (freezing)", line=dict(color=PLAN_COLOUR, width=3),
        marker=dict(size=8), legendgroup="plan", customdata=cd,
        hovertemplate="Epoch %{x}: %{y:,.0f} samples/s (%{customdata[4]:.1f}× baseline)<br>f=%{customdata[0]} "
                      "frozen · K=%{customdata[1]} × D=%{customdata[2]}<br>%{customdata[3]:.1f} s this epoch"
                      "<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(
        x=ep, y=np.full(len(ep), base_thr), mode="lines", line=dict(color=BASE_COLOUR, dash="dash", width=2.5),
        name=base_name, legendgroup="base",
        hovertemplate=f"Baseline: {base_thr:,.0f} samples/s<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(
        x=ep, y=cum / div, mode="lines+markers", line=dict(color=PLAN_COLOUR, width=3), marker=dict(size=7),
        name="Elastic plan (freezing)", legendgroup="plan", showlegend=False,
        hovertemplate=f"After epoch %{{x}}: %{{y:.2f}} {unit}<extra>plan</extra>"), row=1, col=2)
    fig.add_trace(go.Scatter(
        x=ep, y=base_cum / div, mode="lines+markers", line=dict(color=BASE_COLOUR, dash="dash", width=2.5),
        marker=dict(size=6), name=base_name, legendgroup="base", showlegend=False,
        hovertemplate=f"After epoch %{{x}}: %{{y:.2f}} {unit}<extra>baseline</extra>"), row=1, col=2)
    if len(cum):
        fig.add_annotation(x=ep[-1], y=cum[-1] / div, xref="x2", yref="y2", text=f"{speedup:.2f}× faster",
                           showarrow=True, arrowhead=0, ax=-40, ay=-40, font=dict(size=13, color=PLAN_COLOUR))
    log = len(thr) and thr.min() > 0 and max(thr.max(), base_thr) / max(min(thr.min(), base_thr), 1e-12) > 20
    title = (f"Throughput and training time — predicted speedup {speedup:.2f}× "
             f"({total / div:.2f} vs {plan.baseline.seconds / div:.2f} {unit} for the baseline)")
    _base_layout(fig, title, 470, legend_right=False)
    fig.update_layout(margin=dict(l=70, r=30, t=80, b=110), legend=dict(y=-0.22))
    fig.update_yaxes(title_text="Samples per second" + (" (log scale)" if log else ""),
                     type="log" if log else "linear", dtick=1 if log else None, rangemode="tozero",
                     tickformat="~s", row=1, col=1)
    fig.update_yaxes(title_text=f"Elapsed training time ({unit})", rangemode="tozero", row=1, col=2)
    for c in (1, 2):
        fig.update_xaxes(title_text="Epoch", dtick=1 if len(ep) <= 30 else None, row=1, col=c)
    fig.update_annotations(selector=dict(text="Throughput per epoch"), font_size=13)
    fig.update_annotations(selector=dict(text="Cumulative training time"), font_size=13)
    return fig


# ---- 5. per-stage peak memory against capacity ---------------------------------------------------
def memory_figure(plan: Plan) -> go.Figure:
    """Predicted peak memory of each stage's GPU against the GPU's capacity, per phase."""
    cap = _capacity(plan)
    fig = go.Figure()
    groups, layouts = [], []
    top = max([cap or 0.0] + [m for ph in plan.phases for m in ph.predicted.stage_peak_memory_bytes]) / GIB
    for i, ph in enumerate(plan.phases):
        mem = np.array(ph.predicted.stage_peak_memory_bytes, dtype=float) / GIB
        over = [cap is not None and m * GIB > cap for m in mem]
        colours = ["#D62728" if o else _stage_colour(s) for s, o in enumerate(over)]
        lo = np.array([a for a, _ in ph.partition])
        hi = np.array([b - 1 for _, b in ph.partition])
        frac = mem * GIB / cap if cap else np.zeros_like(mem)
        cd = np.column_stack([lo, hi, frac * 100])
        captxt = "<br>%{customdata[2]:.0f}% of capacity" if cap else ""
        fig.add_trace(go.Bar(
            x=np.arange(ph.K), y=mem, marker=dict(color=colours), name=f"Peak memory, phase {i}",
            showlegend=False, customdata=cd, text=[f"{m:.1f}" for m in mem], textposition="outside",
            cliponaxis=False, textfont=dict(size=11),
            hovertemplate="<b>Stage %{x}</b>: layers %{customdata[0]}–%{customdata[1]}<br>"
                          "Predicted peak %{y:.2f} GiB" + captxt + "<extra></extra>"))
        groups.append([len(fig.data) - 1])
        anns = []
        if cap:
            anns.append(dict(text=f"GPU capacity {_gib(cap)}", x=1, xref="paper", xanchor="right", y=cap / GIB,
                             yref="y", yanchor="bottom", showarrow=False, font=dict(size=11, color="#D62728")))
        nover = sum(over)
        if nover:
            anns.append(dict(text=f"{nover} stage(s) over capacity", x=0, xref="paper", xanchor="left", y=1,
                             yref="paper", yanchor="bottom", showarrow=False, font=dict(size=12, color="#D62728")))
        ticks = list(range(ph.K)) if ph.K <= 24 else list(range(0, ph.K, math.ceil(ph.K / 24)))
        layouts.append({
            "title.text": (f"Peak GPU memory per stage — {_phase_title(i, ph)}"
                           + (" · stage 0 also holds the frozen prefix" if ph.frozen_layers else "")),
            "xaxis.tickvals": ticks, "xaxis.ticktext": [f"Stage {s}" for s in ticks],
            "xaxis.range": [-0.6, ph.K - 0.4], "annotations": anns,
        })
    _base_layout(fig, "Peak GPU memory per stage", 460, legend_right=False)
    fig.update_layout(bargap=0.35, margin=dict(l=70, r=30, t=70, b=60), showlegend=False,
                      uniformtext=dict(minsize=8, mode="hide"))
    if cap:
        fig.add_shape(type="line", xref="paper", x0=0, x1=1, y0=cap / GIB, y1=cap / GIB,
                      line=dict(color="#D62728", dash="dash", width=2))
    fig.update_yaxes(title_text="Predicted peak memory (GiB)", range=[0, top * 1.15 if top else 1])
    fig.update_xaxes(title_text="Pipeline stage (one GPU each; every pipeline has the same layout)")
    _add_selector(fig, _phase_labels(plan), groups, layouts, "Frozen blocks: ")
    return fig


# ---- 6. predicted against measured (``ptplan show --run``) -------------------------------------
PRED_COLOUR, MEAS_COLOUR = "#4C78A8", "#F58518"


def _err_text(e: float | None) -> str:
    return "not measured" if e is None or not math.isfinite(e) else f"{e:+.0%}"


def comparison_figure(comparison: "Comparison") -> go.Figure:
    """Per phase: predicted and measured iteration time (left) and peak memory (right), errors on the bars."""
    rows = comparison.phases
    x = [f"phase {r.phase}<br>f={r.frozen_blocks} K={r.K} D={r.D}" for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("Iteration time", "Peak memory (fullest stage)"))
    pt = np.array([r.predicted_iteration_s for r in rows]) * 1e3
    mt = np.array([r.measured_iteration_s for r in rows]) * 1e3
    fig.add_trace(go.Bar(x=x, y=pt, name="Predicted", marker_color=PRED_COLOUR, legendgroup="pred",
                         hovertemplate="%{x}<br>predicted %{y:.1f} ms<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=mt, name="Measured", marker_color=MEAS_COLOUR, legendgroup="meas",
                         text=[_err_text(r.iteration_error) for r in rows], textposition="outside", cliponaxis=False,
                         customdata=[[r.steps, _err_text(r.iteration_error)] for r in rows],
                         hovertemplate="%{x}<br>measured %{y:.1f} ms (median of %{customdata[0]} steps)<br>"
                                       "prediction error %{customdata[1]}<extra></extra>"), row=1, col=1)
    has_mem = any(r.measured_peak_memory_bytes is not None for r in rows)
    pm = np.array([r.predicted_peak_memory_bytes for r in rows], dtype=float) / 2**20
    mm = np.array([r.measured_peak_memory_bytes if r.measured_peak_memory_bytes is not None else np.nan
                   for r in rows], dtype=float) / 2**20
    fig.add_trace(go.Bar(x=x, y=pm, name="Predicted", marker_color=PRED_COLOUR, legendgroup="pred", showlegend=False,
                         hovertemplate="%{x}<br>predicted %{y:.1f} MiB<extra></extra>"), row=1, col=2)
    fig.add_trace(go.Bar(x=x, y=mm, name="Measured", marker_color=MEAS_COLOUR, legendgroup="meas", showlegend=False,
                         text=[_err_text(r.memory_error) for r in rows], textposition="outside", cliponaxis=False,
                         customdata=[[_err_text(r.memory_error)] for r in rows],
                         hovertemplate="%{x}<br>measured %{y:.1f} MiB<br>prediction error %{customdata[0]}"
                                       "<extra></extra>"), row=1, col=2)
    mem_part = (f", peak memory {comparison.median_abs_memory_error:.1%}"
                if comparison.median_abs_memory_error is not None else ", peak memory not measured")
    _base_layout(fig, f"Predicted against measured — median |error|: iteration time "
                      f"{comparison.median_abs_iteration_error:.1%}{mem_part}", 470, legend_right=False)
    fig.update_layout(barmode="group", bargap=0.25, margin=dict(l=70, r=30, t=80, b=110), legend=dict(y=-0.25))
    top_t = float(np.nanmax(np.concatenate([pt, mt]))) if len(rows) else 1.0
    fig.update_yaxes(title_text="Milliseconds per iteration", range=[0, top_t * 1.2], row=1, col=1)
    top_m = float(np.nanmax(np.concatenate([pm, mm]))) if len(rows) and has_mem else float(pm.max(initial=1.0))
    fig.update_yaxes(title_text="MiB", range=[0, top_m * 1.2], row=1, col=2)
    if not has_mem:
        fig.add_annotation(text="memory not measured in this run", x=0.78, xref="paper", y=0.5, yref="paper",
                           showarrow=False, font=dict(size=13, color="#6b7280"))
    return fig


# ---- the report --------------------------------------------------------------------------------
def build_figures(plan: Plan, comparison: "Comparison | None" = None) -> dict[str, go.Figure]:
    """The five report figures, keyed by FIGURES, in page order; plus ``comparison`` when a run is given."""
    figs = {"trajectory": trajectory_figure(plan), "cluster": cluster_figure(plan),
            "timeline": timeline_figure(plan), "throughput": throughput_figure(plan), "memory": memory_figure(plan)}
    if comparison is not None:
        figs[COMPARISON] = comparison_figure(comparison)
    return figs


_CSS = """
:root { --fg:#1f2933; --muted:#6b7280; --line:#e5e7eb; --accent:#4C78A8; --bg:#f8fafc; }
* { box-sizing: border-box; }
body { margin:0; font-family:%(font)s; color:var(--fg); background:var(--bg); font-size:14px; line-height:1.45; }
main { max-width:1240px; margin:0 auto; padding:24px 20px 48px; }
header h1 { font-size:24px; margin:0 0 4px; }
header .sub { color:var(--muted); margin:0 0 16px; }
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
table { border-collapse:collapse; width:100%%; font-size:13px; margin:6px 0 10px; }
th, td { text-align:right; padding:5px 8px; white-space:nowrap; border-bottom:1px solid var(--line);
         vertical-align:top; }
th { color:var(--muted); font-weight:600; background:#f9fafb; position:sticky; top:0; }
td.l, th.l { text-align:left; }
td.mono { font-family:ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size:12px; text-align:left;
          overflow-wrap:anywhere; white-space:normal; max-width:420px; }
tr.base td { color:var(--muted); font-style:italic; white-space:normal; }
.over { color:#D62728; font-weight:600; }
footer { color:var(--muted); font-size:12px; text-align:center; margin-top:24px; }
"""

_SECTIONS = {
    "trajectory": ("Freeze trajectory",
                   "As bottom blocks freeze, the active layers fit in fewer stages (K falls) and the freed GPUs "
                   "become extra pipelines (D rises); K × D stays the world size."),
    "cluster": ("Cluster layout per phase",
                "Every GPU coloured by the pipeline stage s it holds; p is its pipeline (data-parallel replica). "
                "Stage 0 also runs the frozen prefix. Hover a GPU for its layers and predicted memory; "
                "move the slider to change phase."),
    "timeline": ("Pipeline timeline of one iteration",
                 "Pipeline 0 only (the others are identical). Each stage's row shows compute on the upper lane "
                 "(numbers are micro-batches) and communication on the thin lower lane; light grey gaps are idle "
                 "bubbles."),
    "throughput": ("Throughput and training time", "Predicted by the simulator, including phase transitions, "
                   "against the baseline without freezing."),
    "memory": ("Peak memory per stage", "Weights, gradients, optimizer state and activations in flight, against "
               "the GPU's capacity."),
    COMPARISON: ("Predicted against measured", "A real run of this plan (ptplan run --log) beside the prediction, "
                 "phase by phase: the median step time (first step of each phase and the memory-sampled step left "
                 "out) and the sampled peak memory of the fullest rank; labels give (predicted − measured) / "
                 "measured."),
}


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _header(plan: Plan) -> str:
    inp = plan.inputs
    prof, tr, fr = dataclasses.asdict(inp.profile), inp.training.to_json(), dataclasses.asdict(inp.freeze)
    c = _cluster_info(plan)
    nodes, gpn = _cluster_shape(plan)
    cap = _capacity(plan)
    total = plan.totals.seconds
    speedup = plan.totals.speedup
    unit, div = _time_unit(max(total, plan.baseline.seconds))
    ph0, policy = plan.phases[0], tr.get("batch_policy", "?")
    alpha = fr.get("alpha")
    model = prof.get("model", "?")
    gran = prof.get("granularity")
    model_desc = f"{model} · {prof.get('num_blocks', '?')} blocks → {prof.get('num_layers', '?')} layers"
    if gran:
        model_desc += f" ({'block halves' if gran == 'half' else 'whole blocks'})"
    cluster_desc = (f"{c.get('name', 'cluster')}: {nodes} node{'s' if nodes != 1 else ''} × {gpn} "
                    f"{c.get('gpu_name', 'GPU')}" + (f", {_gib(cap)}" if cap else ""))
    items = [
        ("Predicted speedup", f"{speedup:.2f}×", True),
        ("Training time", f"{total / div:.2f} vs {plan.baseline.seconds / div:.2f} {unit} (baseline)", False),
        ("Model", model_desc, False),
        ("Profiled on", f"{prof.get('device', '?')} ({prof.get('device_kind', '?')}, {prof.get('dtype', '?')}, "
                        f"seq {prof.get('seq_len', '?')})", False),
        ("Cluster", cluster_desc, False),
        ("World size", f"{plan.world_size} GPUs", False),
        ("Freeze policy", f"{fr.get('policy', '?')}" + (f", α = {alpha:.3g}" if isinstance(alpha, (int, float))
                                                        else ""), False),
        ("Epochs", f"{tr.get('epochs', len(plan.trajectory))} × {tr.get('samples_per_epoch', '?'):,} samples"
         if isinstance(tr.get("samples_per_epoch"), int) else f"{tr.get('epochs', len(plan.trajectory))}", False),
        ("Batch policy", f"{policy}, " + (f"pipeline batch {ph0.pipeline_batch}" if policy == "constant-pipeline"
                                          else f"global batch {ph0.global_batch}"), False),
        ("Schedule", _schedule_name(str(tr.get("schedule", plan.phases[0].schedule))), False),
    ]
    cards = "".join(f'<div class="card{" hero" if hero else ""}"><div class="k">{_esc(k)}</div>'
                    f'<div class="v">{_esc(v)}</div></div>' for k, v, hero in items)
    return (f"<header><h1>ptplan report — {_esc(model)}</h1>"
            f'<p class="sub">Elastic pipelined training plan (PipeTransformer-style freezing), '
            f"{len(plan.phases)} phases, {plan.world_size} GPUs.</p>"
            f'<div class="cards">{cards}</div>'
            f'<p class="legend"><b>Legend:</b> f frozen blocks · K pipeline length (stages per pipeline) · '
            f"D data-parallel width (pipelines) · M micro-batches per pipeline per iteration · b micro-batch size "
            f"· α freeze rate. Layer ranges are inclusive indices into the profile's layer list.</p></header>")


def _phase_table(plan: Plan) -> str:
    cap = _capacity(plan)
    epochs: dict[int, list[int]] = {}
    for t in plan.trajectory:
        epochs.setdefault(t.phase, []).append(t.epoch)
    head = ("<tr><th class='l'>Phase</th><th>Frozen blocks</th><th>K</th><th>D</th><th>M × b</th>"
            "<th class='l'>Partition (layers per stage)</th><th>Cache</th><th>Iteration</th><th>Bubble</th>"
            "<th>Samples/s</th><th>Max peak memory</th><th class='l'>Epochs</th></tr>")

    def row(name: str, ph: Phase, eps: str, cls: str = "") -> str:
        pr = ph.predicted
        part = " ".join(f"{a}–{b - 1}" for a, b in ph.partition)
        peak = max(pr.stage_peak_memory_bytes) if pr.stage_peak_memory_bytes else 0
        over = cap is not None and peak > cap
        memtxt = _gib(peak) + (f" ({peak / cap:.0%})" if cap else "")
        return (f"<tr class='{cls}'><td class='l'>{_esc(name)}</td><td>{ph.frozen_blocks}</td><td>{ph.K}</td>"
                f"<td>{ph.D}</td><td>{ph.M} × {ph.micro_batch_size}</td><td class='mono'>{_esc(part)}</td>"
                f"<td>{'on' if ph.cache else 'off'}</td><td>{pr.iteration_s * 1e3:,.1f} ms</td>"
                f"<td>{pr.bubble_fraction:.0%}</td><td>{pr.samples_per_s:,.0f}</td>"
                f"<td class='{'over' if over else ''}'>{_esc(memtxt)}</td><td class='l'>{_esc(eps)}</td></tr>")

    rows = [row(str(i), ph, ", ".join(map(str, epochs.get(i, []))) or "— (adaptive only)")
            for i, ph in enumerate(plan.phases)]
    rows.append(row("baseline", plan.baseline.phase, "all (no freezing)", "base"))
    return f"<table><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>"


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
    parts = []
    for key in FIGURES + ((COMPARISON,) if COMPARISON in figs else ()):
        title, note = _SECTIONS[key]
        div = figs[key].to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{key}",
                                config=PLOTLY_CONFIG, default_width="100%")
        parts.append(f'<section id="{key}"><h2>{_esc(title)}</h2><p class="note">{_esc(note)}</p>{div}</section>')
        if key == "trajectory":
            parts.append('<section id="phases"><h2>Phases</h2><p class="note">One phase per frozen-block count '
                         "that can occur; predictions per iteration of one global batch.</p>"
                         f"{_phase_table(plan)}</section>")
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
