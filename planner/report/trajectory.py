"""Figures 1 and 2: the freeze trajectory as runs on a fractional-epoch axis, and the cluster's ranks per phase."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..plan import Phase, Plan
from .style import FILL_COLOUR, MAX_GRID_CELLS, MAX_GRID_COLS, _stage_colour
from .text import (_bytes, _duration, _has_strategy, _noun, _nouns, _phase_title, _plural, _position_strategy,
                   _ranges, _strategy_words)
from .layout import _add_data_selector, _base_layout, _phase_labels
from .positions import _position_layers, _position_memory


# ---- the trajectory as runs on a fractional-epoch axis ------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Run:
    """Consecutive trajectory points of one phase merged into one run, placed on an epoch axis where
    epoch e spans [e, e + 1) and a step sits at its share of the epoch's iterations."""

    phase: int
    frozen_blocks: int
    step: int
    """First optimizer step of the run."""
    iterations: int
    fill_iterations: int
    """Of ``iterations``, how many fill the AutoCache (always the run's first ones)."""
    seconds: float
    fill_seconds: float
    """Seconds of the fill iterations (fill_iterations x the phase's fill_iteration_s)."""
    x0: float
    x_fill: float
    """Where the fill iterations end (= x0 without a fill)."""
    x1: float
    epochs: tuple[int, ...]


def trajectory_runs(plan: Plan) -> list[Run]:
    """The plan's trajectory as runs of one phase each (consecutive points merged), on an epoch axis."""
    traj = plan.trajectory
    if not traj:
        return []
    first: dict[int, int] = {}
    iters: dict[int, int] = {}
    for t in traj:
        first[t.epoch] = min(first.get(t.epoch, t.step), t.step)
        iters[t.epoch] = iters.get(t.epoch, 0) + t.iterations
    epochs = sorted(first)
    xs = [float(e) for e in epochs] + [float(epochs[-1] + 1)]
    steps = [float(first[e]) for e in epochs] + [float(first[epochs[-1]] + iters[epochs[-1]])]
    if any(b <= a for a, b in zip(steps, steps[1:])):  # an epoch without iterations: place by epoch only
        def at(step: float, epoch: int) -> float:
            return float(epoch)
    else:
        def at(step: float, epoch: int) -> float:
            return float(np.interp(step, steps, xs))

    groups: list[list[Any]] = []
    for t in traj:
        if groups and groups[-1][0].phase == t.phase:
            groups[-1].append(t)
        else:
            groups.append([t])
    runs = []
    for g in groups:
        ph = plan.phases[g[0].phase]
        n = sum(t.iterations for t in g)
        fill = sum(t.fill_iterations for t in g)
        start, end = g[0].step, g[0].step + n
        runs.append(Run(phase=g[0].phase, frozen_blocks=g[0].frozen_blocks, step=start, iterations=n,
                        fill_iterations=fill, seconds=sum(t.seconds for t in g),
                        fill_seconds=fill * ph.predicted.fill_iteration_s,
                        x0=at(start, g[0].epoch), x_fill=at(start + fill, g[0].epoch), x1=at(end, g[-1].epoch + 1),
                        epochs=tuple(sorted({t.epoch for t in g}))))
    return runs


def _epoch_axis(n_epochs: int) -> dict[str, Any]:
    return dict(title_text="Epoch", dtick=1 if n_epochs <= 30 else None, rangemode="tozero")


def _run_words(r: Run) -> str:
    eps = f"epoch {r.epochs[0]}" if len(r.epochs) == 1 else f"epochs {_ranges(r.epochs)}"
    fill = f" ({r.fill_iterations:,} fill the AutoCache)" if r.fill_iterations else ""
    return f"{eps}, steps {r.step:,}–{r.step + r.iterations - 1:,}: {r.iterations:,} iterations{fill}"


# ---- 1. freeze trajectory with K and D --------------------------------------------------------
def _fill_trace(plan: Plan, runs: Sequence[Run]) -> go.Scatter | None:
    """The AutoCache's fill iterations as a thick translucent stretch at the start of each run that has them."""
    fills = [r for r in runs if r.fill_iterations]
    if not fills:
        return None
    fx: list[float | None] = []
    fy: list[float | None] = []
    fcd: list[list[Any] | None] = []
    for r in fills:
        ph = plan.phases[r.phase]
        row = [r.fill_iterations, _duration(ph.predicted.fill_iteration_s), _duration(ph.predicted.iteration_s),
               _duration(r.fill_iterations * ph.predicted.fill_extra_s)]
        fx += [r.x0, max(r.x_fill, r.x0), None]
        fy += [r.frozen_blocks, r.frozen_blocks, None]
        fcd += [row, row, None]
    return go.Scatter(
        x=fx, y=fy, mode="lines", line=dict(width=11, color=FILL_COLOUR), opacity=0.55,
        name="AutoCache fill (first pass over the data)", customdata=fcd,
        hovertemplate="AutoCache fill: %{customdata[0]} iterations at %{customdata[1]} each (steady: "
                      "%{customdata[2]}), %{customdata[3]} extra<extra></extra>")


def _bound_trace(plan: Plan, runs: Sequence[Run]) -> go.Scatter | None:
    """The paper's geometric bound L·(1−(1−α)^T) on the epoch axis (geometric freezing only)."""
    fr = plan.inputs.freeze
    if not (fr.policy == "geometric" and 0 < fr.alpha < 1 and runs):
        return None
    L, E = plan.inputs.profile.num_blocks, plan.inputs.training.epochs
    last_step = runs[-1].step + runs[-1].iterations
    per = 1 if fr.every == "epoch" else int(fr.every)
    T_end = E if fr.every == "epoch" else last_step / per
    Ts = np.linspace(0, T_end, 80)
    if fr.every == "epoch":
        bx = Ts
    else:
        first: dict[int, int] = {}
        for t in plan.trajectory:
            first.setdefault(t.epoch, t.step)
        bx = np.interp(Ts * per, [first[e] for e in sorted(first)] + [last_step],
                       [float(e) for e in sorted(first)] + [float(max(first) + 1)])
    step_words = "epoch" if fr.every == "epoch" else f"freeze step (every {per} steps)"
    return go.Scatter(
        x=bx, y=L * (1 - (1 - fr.alpha) ** Ts), mode="lines", line=dict(dash="dot", color="#9D9D9D", width=2),
        name=f"Bound L·(1−(1−α)^T), α={fr.alpha:.3g}, T = {step_words}",
        hovertemplate="Epoch %{x:.2f}: bound %{y:.1f} blocks<extra></extra>")


def trajectory_figure(plan: Plan) -> go.Figure:
    """Frozen blocks (top) and K, D (bottom) over training, one step per run of the trajectory."""
    L = plan.inputs.profile.num_blocks
    runs = trajectory_runs(plan)
    E = plan.inputs.training.epochs
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.55, 0.45],
                        subplot_titles=("Frozen Transformer blocks", "Pipeline length K and data-parallel width D"))
    # a step line: one point at each run's start and one at the end of the last run
    xs = np.array([r.x0 for r in runs] + ([runs[-1].x1] if runs else []))

    def stepped(vals: list[float]) -> np.ndarray:
        return np.array(vals + vals[-1:], dtype=float)

    frozen = stepped([r.frozen_blocks for r in runs])
    Ks = stepped([plan.phases[r.phase].K for r in runs])
    Ds = stepped([plan.phases[r.phase].D for r in runs])
    words = [_run_words(r) for r in runs]
    cd = [[r.phase, plan.phases[r.phase].K, plan.phases[r.phase].D, _duration(r.seconds), w]
          for r, w in zip(runs, words)]
    cd += cd[-1:]
    sizes = [8] * len(runs) + [0]
    fig.add_trace(go.Scatter(
        x=xs, y=frozen, mode="lines+markers", line=dict(shape="hv", width=3, color="#54A24B"),
        marker=dict(size=sizes), name="Frozen blocks f", customdata=cd,
        hovertemplate="Epoch %{x:.2f}: %{y} of " + str(L) + " blocks frozen<br>%{customdata[4]}<br>Phase "
                      "%{customdata[0]}: K=%{customdata[1]} × D=%{customdata[2]} · %{customdata[3]}<extra></extra>"),
        row=1, col=1)
    for extra in (_fill_trace(plan, runs), _bound_trace(plan, runs)):
        if extra is not None:
            fig.add_trace(extra, row=1, col=1)
    # D first, wide and translucent, so K stays visible where the two coincide
    fig.add_trace(go.Scatter(
        x=xs, y=Ds, mode="lines+markers", line=dict(shape="hv", width=6, color="rgba(76,120,168,0.55)"),
        marker=dict(size=[11] * len(runs) + [0], symbol="diamond", color="#4C78A8"), name="D: parallel pipelines",
        hovertemplate="Epoch %{x:.2f}: D = %{y} pipelines<extra></extra>"), row=2, col=1)
    fig.add_trace(go.Scatter(
        x=xs, y=Ks, mode="lines+markers", line=dict(shape="hv", width=2.5, color="#E45756"),
        marker=dict(size=[7] * len(runs) + [0], symbol="square"), name="K: stages per pipeline",
        hovertemplate="Epoch %{x:.2f}: K = %{y} stages<extra></extra>"), row=2, col=1)
    vals = np.concatenate([Ks, Ds]) if runs else np.array([1.0])
    top = int(math.ceil(math.log2(max(vals.max(), 1))))
    ticks = [2 ** i for i in range(0, top + 1)]
    if len(ticks) > 12:
        ticks = ticks[::2]
    fr = plan.inputs.freeze
    cadence = "per epoch" if fr.every == "epoch" else f"every {fr.every} steps"
    _base_layout(fig, f"Freeze trajectory ({cadence}): frozen blocks, pipeline length and data-parallel width", 560)
    fig.update_yaxes(title_text=f"Frozen blocks (of {L})", range=[-0.5, L + 0.8], row=1, col=1)
    fig.update_yaxes(title_text="Count (log scale)", type="log", tickvals=ticks, ticktext=[str(t) for t in ticks],
                     range=[-0.15, math.log10(max(vals.max(), 1)) + 0.15], row=2, col=1)
    fig.update_xaxes(**_epoch_axis(E), row=2, col=1)
    fig.update_xaxes(dtick=1 if E <= 30 else None, row=1, col=1)
    fig.update_annotations(font_size=13, x=0, xanchor="left")
    return fig


# ---- 2. device grid per phase ------------------------------------------------------------------
@dataclass(frozen=True)
class _Grid:
    """The device grid's shape: ``cols`` cells per row, ``rows_per_node`` rows per node, the first
    ``shown_rows`` rows drawn (MAX_GRID_CELLS)."""

    cols: int
    rows_per_node: int
    shown_rows: int
    total_rows: int


def _grid(plan: Plan) -> _Grid:
    c = plan.inputs.cluster
    cols = min(c.gpus_per_node, MAX_GRID_COLS)
    rows_per_node = math.ceil(c.gpus_per_node / cols)
    total_rows = c.nodes * rows_per_node
    return _Grid(cols, rows_per_node, max(1, min(total_rows, MAX_GRID_CELLS // cols)), total_rows)


def _grid_cells(plan: Plan, ph: Phase, g: _Grid) -> tuple[np.ndarray, list[list[str]], list[list[str]],
                                                          dict[tuple[int, int], list[int]]]:
    """One phase's grid: colour values (stage, reversed), cell texts, hover texts, and the tensor-parallel
    groups' columns per (group's first rank, grid row)."""
    noun, gpn, cap = _noun(plan), plan.inputs.cluster.gpus_per_node, float(plan.inputs.cluster.gpu_memory_bytes)
    where = {}
    for p, pipeline in enumerate(ph.ranks):
        for s, r in enumerate(pipeline):
            for t in range(ph.tp):  # a tp group: the tp ranks from its first one (issue 14)
                where[r + t] = (p, s, t)
    z = np.full((g.shown_rows, g.cols), np.nan)
    text = [[""] * g.cols for _ in range(g.shown_rows)]
    hover = [[f"no rank (unused {noun})"] * g.cols for _ in range(g.shown_rows)]
    mem = _position_memory(ph)[0]
    stage_words = []  # short: one per device of the grid, per phase
    for s in range(ph.K):
        prefix = f" + prefix 0–{ph.frozen_layers - 1}" if s == 0 and ph.frozen_layers else ""
        stage_words.append(f"{_position_layers(ph, s)}{prefix}{_position_strategy(ph, s)} · peak {_bytes(mem[s])} "
                           f"({mem[s] / cap:.0%})")
    groups: dict[tuple[int, int], list[int]] = {}  # (tp group's first rank, grid row) -> its columns there
    for r in range(plan.world_size):
        node, local = divmod(r, gpn)
        row, col = node * g.rows_per_node + local // g.cols, local % g.cols
        if row >= g.shown_rows:
            continue
        p, s, t = where[r]
        z[row, col] = ph.K - 1 - s  # reversed, so the colour bar lists stage 0 at the top
        text[row][col] = f"s={s}<br>p={p}" + (f"<br>t={t}" if ph.tp > 1 else "")
        hover[row][col] = f"<b>Rank {r}</b> · node {node}, {noun} {local}<br>p={p}, s={s}: {stage_words[s]}"
        if ph.tp > 1:
            first = r - t
            hover[row][col] += (f"<br>tensor-parallel rank t={t} of the tp group {_nouns(plan)} {first}–"
                                f"{first + ph.tp - 1} (node {node})")
            groups.setdefault((first, row), []).append(col)
    return z, text, hover, groups


def _stage_colourbar(ph: Phase) -> tuple[list[list[Any]], list[int], list[str]]:
    """The discrete colour scale of a phase's K stages and the colour bar's ticks (at most 16 labelled)."""
    K = ph.K
    scale: list[list[Any]] = []
    for v in range(K):
        colour = _stage_colour(K - 1 - v)
        scale += [[v / K, colour], [(v + 1) / K, colour]]
    stages = list(range(K)) if K <= 16 else list(range(0, K, math.ceil(K / 16)))
    tickvals, ticktext = [], []
    for s in stages:
        extra = " + frozen prefix" if s == 0 and ph.frozen_layers else ""
        tickvals.append(K - 1 - s)
        ticktext.append(f"{'Stage' if ph.V == 1 else 'Position'} {s}: {_position_layers(ph, s)}{extra}"
                        f"{_position_strategy(ph, s)}")
    return scale, tickvals, ticktext


def _cluster_phase(plan: Plan, i: int, ph: Phase, g: _Grid) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """One phase's heatmap data and layout (title, tensor-parallel outlines) for the selector."""
    z, text, hover, groups = _grid_cells(plan, ph, g)
    scale, tickvals, ticktext = _stage_colourbar(ph)
    K = ph.K
    how = ""
    if ph.frozen_layers:
        how = ("<br>stage 0 reads the frozen prefix from the AutoCache" if ph.cache
               else "<br>stage 0 recomputes the frozen prefix under no_grad")
    tp_words = f", tensor-parallel rank t of tp={ph.tp}" if ph.tp > 1 else ""
    strategy = f"<br>strategy {ph.strategy_label}: {_strategy_words(ph)}" if _has_strategy(ph) else ""
    data: dict[str, list[Any]] = {
            "z": [z], "text": [text], "hovertext": [hover], "zmax": [K - 0.5], "colorscale": [scale],
            "hovertemplate": [f"%{{hovertext}}<extra>pipeline p of D={ph.D}, stage s of K={K}{tp_words}"
                              f"{how}{strategy}</extra>"],
            "colorbar.tickvals": [tickvals], "colorbar.ticktext": [ticktext],
            "colorbar.title.text": [f"Stage (K={K})"], "name": [f"phase {i}"]}
    noun, c = _noun(plan), plan.inputs.cluster
    note = ""
    if ph.tp > 1:
        note += (f"<br><sup>{_strategy_words(ph)}: each outlined group of {ph.tp} {_nouns(plan)} (one node) "
                 f"holds one stage of one pipeline, t its tensor-parallel rank</sup>")
    if g.shown_rows < g.total_rows:
        note += (f"<br><sup>Showing the first {g.shown_rows * g.cols} of {_plural(c.nodes * c.gpus_per_node, noun)};"
                 f" the other nodes repeat the same stage layout</sup>")
    outlines = [dict(type="rect", xref="x", yref="y", x0=min(cs) - 0.47, x1=max(cs) + 0.47, y0=row - 0.47,
                     y1=row + 0.47, line=dict(color="#1f2933", width=2), fillcolor="rgba(0,0,0,0)", layer="above")
                for (_, row), cs in groups.items()]  # a group wider than a grid row: one outline per row
    return data, {"title.text": f"{noun} assignment — {_phase_title(i, ph)}{note}", "shapes": outlines}


def cluster_figure(plan: Plan) -> go.Figure:
    """Each device as a cell (rows: nodes), coloured by the pipeline stage it holds; one view per phase."""
    noun = _noun(plan)
    g = _grid(plan)
    shown_rows, cols, rows_per_node = g.shown_rows, g.cols, g.rows_per_node
    show_text = shown_rows * cols <= 128
    ylabels = []
    for r in range(shown_rows):
        node, part = divmod(r, rows_per_node)
        span = f" · {_nouns(plan)} {part * cols}–{part * cols + cols - 1}" if rows_per_node > 1 else ""
        ylabels.append(f"Node {node}{span}")
    xlabels = [f"{noun} {x}" for x in range(cols)] if rows_per_node == 1 else [f"+{x}" for x in range(cols)]
    fig = go.Figure(go.Heatmap(x=xlabels, y=ylabels, zmin=-0.5, xgap=3, ygap=3,
                               texttemplate="%{text}" if show_text else None, textfont=dict(size=11),
                               colorbar=dict(title=dict(side="top"), thickness=14, len=1.0, y=0.5, yanchor="middle",
                                             outlinewidth=0)))
    data: list[dict[str, list[Any]]] = []
    layouts: list[dict[str, Any]] = []
    for i, ph in enumerate(plan.phases):
        d, lay = _cluster_phase(plan, i, ph, g)
        data.append(d)
        layouts.append(lay)
    height = int(min(900, max(200, 130 + 34 * shown_rows * (1.6 if show_text else 1))))
    top = 60 + 22 * (shown_rows < g.total_rows) + 22 * any(ph.tp > 1 for ph in plan.phases)
    height += top - 60
    _base_layout(fig, f"{noun} assignment", height + 90)
    fig.update_layout(margin=dict(l=150 if rows_per_node > 1 else 80, r=30, t=top, b=40))
    fig.update_xaxes(side="top", showgrid=False)
    fig.update_yaxes(autorange="reversed", showgrid=False, title_text="")
    _add_data_selector(fig, _phase_labels(plan), data, layouts, "Frozen blocks: ")
    return fig
