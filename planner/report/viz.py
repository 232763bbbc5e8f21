"""Plotly figures of a plan and the one-file, offline HTML report that ``ptplan show`` writes.

Legend used on every figure: f frozen blocks; K pipeline length (stages per pipeline); D
data-parallel width (pipelines); M micro-batches per pipeline per iteration; b micro-batch size;
α the freeze rate. Ranks are numbered node by node (rank r lives on node r // devices-per-node).
A rank is a GPU, or a CPU process on a ``cpu:N`` cluster (``Cluster.device_noun``): the report
says which.
"""
from __future__ import annotations

import html
import math
import os
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from ..errors import PtplanError
from ..jsonio import write_atomic
from ..plan import MemoryBreakdown, Phase, Plan, TimelineEvent

if TYPE_CHECKING:
    from ..ablate import Ablation
    from ..compare import Comparison

FIGURES = ("trajectory", "cluster", "timeline", "throughput", "memory")
"""Keys of ``build_figures``' result, in page order."""
COMPARISON = "comparison"
"""Key of the extra figure ``build_figures(plan, comparison)`` adds: predicted against measured (last)."""
EVALUATION = "evaluation"
"""Key of the figure a run with held-out evaluations adds (``--eval-data``), after the comparison."""

MAX_GRID_CELLS = 128
"""The device grid draws at most this many devices (whole rows); larger clusters repeat the same layout."""
MAX_GRID_COLS = 16
"""Nodes with more devices than this are wrapped over several rows."""
MAX_TIMELINE_EVENTS = 20_000
"""Per phase; a longer timeline is cut (earliest events kept) with a note."""
TIMELINE_BARS_PER_LANE = 24
"""A phase whose busiest rank has more compute events than this is drawn in blocks: consecutive
events of one rank and lane merge where the idle gap between them is below a threshold, the
smallest (from 0.1 % of the iteration, doubling) that leaves at most this many blocks per lane."""
SLIDER_MAX_PHASES = 20
"""Up to this many phases get a slider; more get a dropdown."""
CAPACITY_SHOWN_ABOVE = 0.1
"""The memory axis reaches up to the device's capacity only where the fullest stage fills at least
this share of it; below, bars would be slivers, so the capacity is given in words instead."""

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
    "UPDATE": ("Optimizer step", "#54A24B", "compute"),
}
KIND_WORDS = {"PREFIX": "frozen-prefix passes", "CACHE": "cache reads", "F": "forwards", "B": "backwards",
              "W": "weight gradients", "SEND_F": "activation sends", "RECV_F": "activation receives",
              "SEND_B": "gradient sends", "RECV_B": "gradient receives", "ALLREDUCE": "all-reduces"}
FORWARD_KINDS = frozenset({"PREFIX", "CACHE", "F", "SEND_F", "RECV_F"})
"""Kinds that belong to a micro-batch's forward pass (the other kinds to its backward)."""
MIXED_STYLE: dict[str, tuple[str, str, str]] = {
    # lane: (legend name, background colour, stripe colour) of a block that merges several kinds
    "compute": ("Forwards and backwards interleaved (merged block)", "#4C78A8", "#F58518"),
    "comm": ("Sends and receives (merged block)", "#9ECAE9", "#FFBF79"),
}
MEMORY_TERMS: tuple[tuple[str, str, str], ...] = (
    # MemoryBreakdown field, legend name, colour (bottom of the stack first)
    ("weights", "Weights", "#4C78A8"),
    ("gradients", "Gradients", "#F58518"),
    ("optimizer", "Optimizer state", "#54A24B"),
    ("buffers", "Buffers (receive buffers, cached prefix outputs)", "#B279A2"),
    ("activations", "Activations in flight", "#E45756"),
    ("transient", "Transient after the pipeline drains", "#9D755D"),
)
FILL_COLOUR = "#72B7B2"
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


def _duration(seconds: float) -> str:
    """A duration in the unit that fits it: '850 ms', '12.4 s', '3.6 minutes', '2.1 hours'."""
    if seconds < 1:
        return f"{seconds * 1e3:,.3g} ms"
    unit, div = _time_unit(seconds)
    return f"{seconds / div:,.3g} {'s' if unit == 'seconds' else unit}"


BYTE_UNITS = (("B", 1.0), ("KiB", 2.0**10), ("MiB", 2.0**20), ("GiB", 2.0**30), ("TiB", 2.0**40), ("PiB", 2.0**50))


def _byte_unit(largest: float) -> tuple[str, float]:
    """The largest binary unit in which ``largest`` bytes is at least 1: (name, bytes per unit)."""
    name, div = BYTE_UNITS[0]
    for n, d in BYTE_UNITS:
        if largest >= d:
            name, div = n, d
    return name, div


def _num3(x: float) -> str:
    """Three significant digits without a trailing '.0' (never '0.0' for a positive number)."""
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _bytes(b: float) -> str:
    """Bytes in the unit that fits them: '812 KiB', '47.5 MiB', '1.52 GiB' ('0 B' only for nothing)."""
    if b <= 0:
        return "0 B"
    name, div = _byte_unit(b)
    return f"{b:,.0f} B" if name == "B" else f"{_num3(b / div)} {name}"


def _plural(n: int, noun: str) -> str:
    """'1 GPU', '16 GPUs', '4 CPU processes'."""
    word = noun if n == 1 else noun + ("es" if noun.endswith("s") else "s")
    return f"{n:,} {word}"


def _noun(plan: Plan) -> str:
    """What one rank is: 'GPU' or 'CPU process'."""
    return plan.inputs.cluster.device_noun


def _nouns(plan: Plan) -> str:
    return _plural(2, _noun(plan)).split(" ", 1)[1]


def _layers(lo: int, hi: int) -> str:
    """Half-open [lo, hi) as words."""
    return f"layer {lo}" if hi - lo == 1 else f"layers {lo}–{hi - 1}"


def _schedule_name(s: str) -> str:
    return {"gpipe": "GPipe", "1f1b": "1F1B", "2bw": "PipeDream-2BW (flush-free)"}.get(s, s)


def _has_strategy(ph: Phase) -> bool:
    """Whether the phase runs a hybrid strategy (tensor parallel, FSDP or recomputation), not plain DP."""
    return ph.strategy_label != "dp"


def _mesh(ph: Phase) -> str:
    """The phase's device mesh: 'mesh K × D × tp = 4 × 2 × 4' (the tp ranks of a stage inside one node)."""
    return f"mesh K × D × tp = {ph.K} × {ph.D} × {ph.tp}"


def _strategy_words(ph: Phase) -> str:
    """The strategy in words, for hovers and notes: 'tensor parallel over 4 ranks inside one node, FSDP
    (sharded over the D=8 replicas), activation recomputation'; 'plain data parallel' without one."""
    parts = []
    if ph.tp > 1:
        parts.append(f"tensor parallel over {ph.tp} ranks inside one node")
    S = ph.K * ph.V
    fs, rc = [s for s in range(S) if ph.fsdp_at(s)], [s for s in range(S) if ph.recompute_at(s)]
    if fs:
        on = "" if len(fs) == S else f" on stage{'s' if len(fs) > 1 else ''} {_ranges(fs)}"
        parts.append(f"FSDP{on} (sharded over the D={ph.D} replicas)")
    if rc:
        on = "" if len(rc) == S else f" on stage{'s' if len(rc) > 1 else ''} {_ranges(rc)}"
        some = [f"stage {c}: its first {ph.recompute_layers_at(c)} layers" for c in rc if ph.recompute_layers_at(c)]
        parts.append(f"activation recomputation{on}" + (f" ({'; '.join(some)})" if some else ""))
    return ", ".join(parts) or "plain data parallel"


def _position_strategy(ph: Phase, k: int) -> str:
    """The FSDP/recomputation strategy of position k's stages in a phase whose stages differ ('' otherwise):
    ' · fsdp·rc', or per chunk ' · chunks 0: rc, 4: dp'."""
    if not ph.mixed:
        return ""
    chunks = [c for c, pos in enumerate(ph.stage_to_rank()) if pos == k]
    labels = {ph.stage_label(c) for c in chunks}
    if len(labels) == 1:
        return f" · {labels.pop()}"
    return " · chunks " + ", ".join(f"{c}: {ph.stage_label(c)}" for c in chunks)


def _phase_title(i: int, ph: Phase) -> str:
    title = f"phase {i}: {ph.frozen_blocks} frozen blocks · K={ph.K} × D={ph.D} · M={ph.M}"
    if _has_strategy(ph):
        title += f" · {ph.strategy_label} ({_mesh(ph)})"
    if ph.slices:  # TeraPipe: each micro-batch's bar is its token slices' actions, slice by slice
        text = ",".join(map(str, ph.slices))
        title += f" · {len(ph.slices)} token slices {text if len(text) <= 40 else text[:37] + '...'}"
    return title


def _ranges(xs: Sequence[int]) -> str:
    """0, 1, 2, 5 -> '0–2, 5'."""
    out: list[str] = []
    vals = sorted(set(xs))
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}–{vals[j]}")
        i = j + 1
    return ", ".join(out)


def _base_layout(fig: go.Figure, title: str, height: int, legend_right: bool = True) -> None:
    fig.update_layout(
        template="plotly_white", height=height, font=dict(family=FONT, size=13, color="#1f2933"),
        title=dict(text=title, x=0.0, xanchor="left", y=1.0, yanchor="top", pad=dict(t=12), font=dict(size=16)),
        margin=dict(l=70, r=30, t=70, b=60), hoverlabel=dict(font=dict(family=FONT, size=12)),
        legend=(dict(orientation="v", x=1.02, xanchor="left", y=1.0, yanchor="top", font=dict(size=12))
                if legend_right else dict(orientation="h", x=0, y=-0.18, yanchor="top")),
    )


def _selector_ui(fig: go.Figure, labels: Sequence[str], args: Sequence[list[dict[str, Any]]], prefix: str,
                 active: int) -> None:
    """A slider (up to SLIDER_MAX_PHASES steps) or a dropdown whose step i calls Plotly.update(args[i])."""
    steps: list[dict[str, Any]] = [dict(method="update", label=lab, args=a) for lab, a in zip(labels, args)]
    if len(steps) <= SLIDER_MAX_PHASES:
        fig.update_layout(sliders=[dict(
            active=active, steps=steps, x=0.0, len=1.0, y=0, yanchor="top", pad=dict(t=40, b=0),
            currentvalue=dict(prefix=prefix, font=dict(size=13), xanchor="left"),
            font=dict(size=11))])
    else:
        fig.update_layout(updatemenus=[dict(
            type="dropdown", active=active, x=1.0, xanchor="right", y=1.12, yanchor="bottom",
            buttons=[dict(method=s["method"], label=prefix + s["label"], args=s["args"]) for s in steps])])


def _add_selector(fig: go.Figure, labels: Sequence[str], groups: Sequence[Sequence[int]],
                  layouts: Sequence[dict[str, Any]], prefix: str, always: Sequence[int] = (), active: int = 0) -> None:
    """A phase selector: step i shows the traces in groups[i] (plus ``always``) and applies layouts[i];
    step ``active`` is shown first."""
    n = len(fig.data)
    masks = []
    for g in groups:
        vis = [False] * n
        for t in [*g, *always]:
            vis[t] = True
        masks.append(vis)
    for t, v in enumerate(masks[active]):
        fig.data[t].visible = v
    for key, value in layouts[active].items():  # the initial view (plotly_relayout drops annotations)
        fig.layout[key] = value
    _selector_ui(fig, labels, [[{"visible": m}, dict(lay)] for m, lay in zip(masks, layouts)], prefix, active)


def _nested(key: str, value: Any) -> dict[str, Any]:
    """'textfont.color', v -> {'textfont': {'color': v}}."""
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _add_data_selector(fig: go.Figure, labels: Sequence[str], data: Sequence[dict[str, list[Any]]],
                       layouts: Sequence[dict[str, Any]], prefix: str, active: int = 0) -> None:
    """A phase selector over a fixed set of traces: step i restyles them with data[i] (key -> one value per
    trace, as Plotly.update takes it) and applies layouts[i]. Unlike ``_add_selector`` the figure holds
    no trace per phase, so its size grows with the phases, not with their square."""
    for key, values in data[active].items():
        for t, v in zip(fig.data, values):
            t.update(_nested(key, v))
    for key, value in layouts[active].items():
        fig.layout[key] = value
    _selector_ui(fig, labels, [[dict(d), dict(lay)] for d, lay in zip(data, layouts)], prefix, active)


def _phase_labels(plan: Plan) -> list[str]:
    return [str(ph.frozen_blocks) for ph in plan.phases]


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
    fills = [r for r in runs if r.fill_iterations]
    if fills:
        fx: list[float | None] = []
        fy: list[float | None] = []
        fcd: list[list[Any] | None] = []
        for r in fills:
            ph = plan.phases[r.phase]
            extra = r.fill_iterations * (ph.predicted.fill_iteration_s - ph.predicted.iteration_s)
            row = [r.fill_iterations, _duration(ph.predicted.fill_iteration_s), _duration(ph.predicted.iteration_s),
                   _duration(max(extra, 0.0))]
            fx += [r.x0, max(r.x_fill, r.x0), None]
            fy += [r.frozen_blocks, r.frozen_blocks, None]
            fcd += [row, row, None]
        fig.add_trace(go.Scatter(
            x=fx, y=fy, mode="lines", line=dict(width=11, color=FILL_COLOUR), opacity=0.55,
            name="AutoCache fill (first pass over the data)", customdata=fcd,
            hovertemplate="AutoCache fill: %{customdata[0]} iterations at %{customdata[1]} each (steady: "
                          "%{customdata[2]}), %{customdata[3]} extra<extra></extra>"), row=1, col=1)
    fr = plan.inputs.freeze
    if fr.policy == "geometric" and 0 < fr.alpha < 1 and runs:
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
        fig.add_trace(go.Scatter(
            x=bx, y=L * (1 - (1 - fr.alpha) ** Ts), mode="lines", line=dict(dash="dot", color="#9D9D9D", width=2),
            name=f"Bound L·(1−(1−α)^T), α={fr.alpha:.3g}, T = {step_words}",
            hovertemplate="Epoch %{x:.2f}: bound %{y:.1f} blocks<extra></extra>"), row=1, col=1)
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
def cluster_figure(plan: Plan) -> go.Figure:
    """Each device as a cell (rows: nodes), coloured by the pipeline stage it holds; one view per phase."""
    world = plan.world_size
    c = plan.inputs.cluster
    noun = _noun(plan)
    nodes, gpn = c.nodes, c.gpus_per_node
    cols = min(gpn, MAX_GRID_COLS)
    rows_per_node = math.ceil(gpn / cols)
    total_rows = nodes * rows_per_node
    shown_rows = max(1, min(total_rows, MAX_GRID_CELLS // cols))
    cap = float(c.gpu_memory_bytes)
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
        where = {}
        for p, pipeline in enumerate(ph.ranks):
            for s, r in enumerate(pipeline):
                for t in range(ph.tp):  # a tp group: the tp ranks from its first one (issue 14)
                    where[r + t] = (p, s, t)
        z = np.full((shown_rows, cols), np.nan)
        text = [[""] * cols for _ in range(shown_rows)]
        hover = [[f"no rank (unused {noun})"] * cols for _ in range(shown_rows)]
        mem = _position_memory(ph)[0]
        stage_words = []  # short: one per device of the grid, per phase
        for s in range(ph.K):
            prefix = f" + prefix 0–{ph.frozen_layers - 1}" if s == 0 and ph.frozen_layers else ""
            stage_words.append(f"{_position_layers(ph, s)}{prefix}{_position_strategy(ph, s)} · peak {_bytes(mem[s])} "
                               f"({mem[s] / cap:.0%})")
        groups: dict[tuple[int, int], list[int]] = {}  # (tp group's first rank, grid row) -> its columns there
        for r in range(world):
            node, local = divmod(r, gpn)
            row, col = node * rows_per_node + local // cols, local % cols
            if row >= shown_rows:
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
        K = ph.K
        scale = []
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
        how = ""
        if ph.frozen_layers:
            how = ("<br>stage 0 reads the frozen prefix from the AutoCache" if ph.cache
                   else "<br>stage 0 recomputes the frozen prefix under no_grad")
        tp_words = f", tensor-parallel rank t of tp={ph.tp}" if ph.tp > 1 else ""
        strategy = f"<br>strategy {ph.strategy_label}: {_strategy_words(ph)}" if _has_strategy(ph) else ""
        data.append({"z": [z], "text": [text], "hovertext": [hover], "zmax": [K - 0.5], "colorscale": [scale],
                     "hovertemplate": [f"%{{hovertext}}<extra>pipeline p of D={ph.D}, stage s of K={K}{tp_words}"
                                       f"{how}{strategy}</extra>"],
                     "colorbar.tickvals": [tickvals], "colorbar.ticktext": [ticktext],
                     "colorbar.title.text": [f"Stage (K={K})"], "name": [f"phase {i}"]})
        note = ""
        if ph.tp > 1:
            note += (f"<br><sup>{_strategy_words(ph)}: each outlined group of {ph.tp} {_nouns(plan)} (one node) "
                     f"holds one stage of one pipeline, t its tensor-parallel rank</sup>")
        if shown_rows < total_rows:
            note += (f"<br><sup>Showing the first {shown_rows * cols} of {_plural(nodes * gpn, noun)}; the other "
                     f"nodes repeat the same stage layout</sup>")
        outlines = [dict(type="rect", xref="x", yref="y", x0=min(cs) - 0.47, x1=max(cs) + 0.47, y0=row - 0.47,
                         y1=row + 0.47, line=dict(color="#1f2933", width=2), fillcolor="rgba(0,0,0,0)", layer="above")
                    for (_, row), cs in groups.items()]  # a group wider than a grid row: one outline per row
        layouts.append({"title.text": f"{noun} assignment — {_phase_title(i, ph)}{note}", "shapes": outlines})
    height = int(min(900, max(200, 130 + 34 * shown_rows * (1.6 if show_text else 1))))
    top = 60 + 22 * (shown_rows < total_rows) + 22 * any(ph.tp > 1 for ph in plan.phases)
    height += top - 60
    _base_layout(fig, f"{noun} assignment", height + 90)
    fig.update_layout(margin=dict(l=150 if rows_per_node > 1 else 80, r=30, t=top, b=40))
    fig.update_xaxes(side="top", showgrid=False)
    fig.update_yaxes(autorange="reversed", showgrid=False, title_text="")
    _add_data_selector(fig, _phase_labels(plan), data, layouts, "Frozen blocks: ")
    return fig


# ---- 3. pipeline timeline (Gantt) ----------------------------------------------------------------
def _placeholder(msg: str) -> dict[str, Any]:
    return dict(text=msg, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                font=dict(size=15, color="#6b7280"))


@dataclass(frozen=True, kw_only=True)
class Block:
    """One bar of the timeline: a single event, or consecutive events of one rank and lane merged."""

    rank: int
    stage: int
    lane: str
    """``compute`` or ``comm``."""
    kinds: tuple[tuple[str, int], ...]
    """(event kind, count) in KIND_STYLE order."""
    mb_lo: int
    mb_hi: int
    start: float
    end: float
    busy: float
    """Seconds covered by the merged events (the rest of [start, end) was idle)."""
    forward_mbs: tuple[int, int] | None = None
    """Lowest and highest micro-batch of the block's forward-pass events (None: it has none)."""
    backward_mbs: tuple[int, int] | None = None

    @property
    def events(self) -> int:
        return sum(n for _, n in self.kinds)

    @property
    def busy_share(self) -> float:
        return min(self.busy / (self.end - self.start), 1.0) if self.end > self.start else 1.0

    @property
    def style(self) -> str:
        """How the block is drawn: the KIND_STYLE key of its kind (forward for a forward stretch of
        frozen-prefix passes and forwards, backward for backwards and weight gradients), else
        ``mixed-<lane>``."""
        kinds = {k for k, _ in self.kinds}
        if len(kinds) == 1:
            return self.kinds[0][0]
        if self.lane == "compute" and kinds <= {"PREFIX", "CACHE", "F"}:
            return "F"
        if self.lane == "compute" and kinds <= {"B", "W"}:
            return "B"
        return f"mixed-{self.lane}"


def _lane(kind: str) -> str:
    return KIND_STYLE.get(kind, ("", "", "compute"))[2]


def _merge_class(kind: str) -> str:
    """Events of one class may merge: compute with compute, point-to-point with point-to-point; the
    all-reduce stays apart (its exposed part is what the figure must show)."""
    return "allreduce" if kind == "ALLREDUCE" else _lane(kind)


def _block(evs: list[TimelineEvent]) -> Block:
    count = Counter(e.kind for e in evs)
    kinds = tuple((k, count[k]) for k in KIND_STYLE if k in count) + tuple(
        (k, n) for k, n in count.items() if k not in KIND_STYLE)
    busy, reach = 0.0, -math.inf
    for e in evs:  # evs are sorted by start: the union of their intervals
        busy += max(0.0, e.end - max(e.start, reach))
        reach = max(reach, e.end)
    mbs = [e.mb for e in evs if e.mb >= 0]
    fwd = [e.mb for e in evs if e.mb >= 0 and e.kind in FORWARD_KINDS]
    bwd = [e.mb for e in evs if e.mb >= 0 and e.kind not in FORWARD_KINDS]
    return Block(rank=evs[0].rank, stage=evs[0].stage, lane=_lane(evs[0].kind), kinds=kinds,
                 mb_lo=min(mbs) if mbs else -1, mb_hi=max(mbs) if mbs else -1,
                 start=min(e.start for e in evs), end=reach, busy=busy,
                 forward_mbs=(min(fwd), max(fwd)) if fwd else None, backward_mbs=(min(bwd), max(bwd)) if bwd else None)


def _stretches(evs: list[TimelineEvent]) -> list[list[TimelineEvent]]:
    """A compute lane cut into its schedule's stretches: runs of forwards of several micro-batches (a
    warm-up, GPipe's forward half), runs of backwards of several (a cool-down, GPipe's backward half),
    and in between the stretches where forward and backward alternate micro-batch by micro-batch
    (1F1B's steady state). Blocks never merge across stretches."""
    runs: list[list[TimelineEvent]] = []
    for e in evs:
        if runs and (runs[-1][0].kind in FORWARD_KINDS) == (e.kind in FORWARD_KINDS):
            runs[-1].append(e)
        else:
            runs.append([e])
    out: list[list[TimelineEvent]] = []
    prev_single = False
    for r in runs:
        single = len({e.mb for e in r}) <= 1
        if single and prev_single:
            out[-1].extend(r)
        else:
            out.append(list(r))
        prev_single = single
    return out


def _split_at_gaps(evs: list[TimelineEvent], tol: float) -> list[list[TimelineEvent]]:
    """Consecutive events (sorted by start) split wherever the idle gap exceeds ``tol`` seconds."""
    out: list[list[TimelineEvent]] = [[evs[0]]]
    reach = evs[0].end
    for e in evs[1:]:
        if e.start - reach <= tol:
            out[-1].append(e)
        else:
            out.append([e])
        reach = max(reach, e.end)
    return out


def timeline_blocks(events: Sequence[TimelineEvent], max_per_lane: int = TIMELINE_BARS_PER_LANE
                    ) -> tuple[list[Block], dict[str, float]]:
    """The bars to draw for one phase's events, and the idle-gap threshold used per lane class.

    Every event is its own bar while the busiest rank has at most ``max_per_lane`` compute events
    (no thresholds). Above that, events merge into blocks, one rank and lane at a time: a compute lane
    is first cut into its schedule's stretches (``_stretches``: warm-up, steady state, cool-down),
    a communication lane is one stretch; the all-reduce never merges. A stretch is then split wherever
    the idle gap exceeds the lane class's threshold: the smallest of span/1000 x 2^k that leaves at
    most ``max_per_lane`` blocks on every lane of that class (``compute`` or ``comm``).
    """
    if not events:
        return [], {}
    lanes: dict[tuple[int, str], list[TimelineEvent]] = {}
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        lanes.setdefault((e.rank, _merge_class(e.kind)), []).append(e)
    busiest = max((len(v) for (_, c), v in lanes.items() if c == "compute"), default=0)
    if busiest <= max_per_lane:
        return [_block([e]) for v in lanes.values() for e in v], {}
    span = max(e.end for e in events) - min(e.start for e in events)
    blocks: list[Block] = []
    tols: dict[str, float] = {}
    for cls in ("compute", "comm", "allreduce"):
        keyed = {k: v for k, v in lanes.items() if k[1] == cls}
        if not keyed:
            continue
        if cls == "allreduce":
            blocks += [_block([e]) for v in keyed.values() for e in v]
            continue
        stretches = {k: (_stretches(v) if cls == "compute" else [v]) for k, v in keyed.items()}
        tol = span / 1000
        while True:
            pieces = {k: [p for st in sts for p in _split_at_gaps(st, tol)] for k, sts in stretches.items()}
            if all(len(p) <= max_per_lane for p in pieces.values()) or tol >= span:
                break
            tol *= 2
        tols[cls] = tol
        blocks += [_block(p) for ps in pieces.values() for p in ps]
    return blocks, tols


def _share(x: float) -> str:
    return "<1%" if 0 < x < 0.005 else f"{x:.0%}"


def _span(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}–{r[1]}"


def _block_words(b: Block) -> str:
    """What a bar holds, for its hover."""
    if b.events == 1:
        kind = b.kinds[0][0]
        return KIND_STYLE.get(kind, (kind, "", ""))[0] + ("" if b.mb_lo < 0 else f" · micro-batch {b.mb_lo}")
    parts = ", ".join(f"{n} {KIND_WORDS.get(k, k)}" for k, n in b.kinds)
    ranges = [(w, r) for w, r in (("forward", b.forward_mbs), ("backward", b.backward_mbs)) if r is not None]
    if len(ranges) == 1:
        r = ranges[0][1]
        return f"{parts} of micro-batch{'es' if r[0] != r[1] else ''} {_span(r)}"
    mbs = "; ".join(f"{w} passes of micro-batches {_span(r)}" for w, r in ranges)
    return f"{parts}<br>{mbs}" if mbs else parts


def _block_label(b: Block) -> str:
    """The text inside a compute bar: its micro-batch(es); for an interleaved block also how busy it was."""
    if b.events == 1:
        return str(b.mb_lo)
    if b.forward_mbs is not None and b.backward_mbs is not None:
        return f"F {_span(b.forward_mbs)} · B {_span(b.backward_mbs)} · {_share(b.busy_share)} busy"
    r = b.forward_mbs or b.backward_mbs
    return _span(r) if r is not None else ""


@dataclass(frozen=True, kw_only=True)
class SteadyState:
    """One period of a flush-free (PipeDream-2BW) phase's steady state, located on its timeline."""

    minibatch: int
    """t0: the mini-batch whose period is marked (one the simulator averages its period over)."""
    minibatches: int
    """N: mini-batches in the simulated window (``schedule.TWOBW_WINDOW``)."""
    start: float
    """Seconds: stage 0's first forward of mini-batch t0 (``simulate``'s S0[t0])."""
    period: float
    """Seconds between consecutive mini-batches on the timeline: the simulator's steady-state period."""
    iteration_s: float
    """The phase's predicted iteration time: ``period`` plus the fixed per-step overhead
    (``Cluster.step_overhead_s``, which the timeline does not draw) -- one mini-batch per period."""

    @property
    def end(self) -> float:
        return self.start + self.period


def steady_state(ph: Phase, step_overhead_s: float = 0.0) -> SteadyState | None:
    """Where a flush-free phase's steady state is on its timeline: the simulator measures the period as
    the mean spacing of stage 0's first forwards of the window's last mini-batches (``simulate``,
    flush-free), so the marked period starts at the first of those, mini-batch t0 = N - 1 - min(3, N - 2),
    and lasts the predicted iteration time less ``step_overhead_s`` (the plan's cluster's).
    None for a flushed schedule or a phase without a timeline."""
    if ph.schedule != "2bw" or not ph.timeline:
        return None
    firsts: dict[int, float] = {}
    for e in ph.timeline:
        if e.stage == 0 and e.kind in ("PREFIX", "F") and e.mb % ph.M == 0:
            t = e.mb // ph.M
            firsts[t] = min(firsts.get(t, math.inf), e.start)
    N = max(e.mb for e in ph.timeline) // ph.M + 1
    if N < 3 or sorted(firsts) != list(range(N)):
        return None
    t0 = N - 1 - min(3, N - 2)
    it = ph.predicted.iteration_s
    return SteadyState(minibatch=t0, minibatches=N, start=firsts[t0], period=max(it - step_overhead_s, 0.0),
                       iteration_s=it)


def _steady_events(tl: list[TimelineEvent], st: SteadyState) -> list[TimelineEvent]:
    """The events a flush-free phase's timeline draws: those overlapping its marked period with a
    quarter period either side (the fill before and the drain after are not an iteration)."""
    lo, hi = st.start - st.period / 4, st.end + st.period / 4
    return [e for e in tl if e.end > lo and e.start < hi]


def timeline_figure(plan: Plan) -> go.Figure:
    """One iteration of pipeline 0 per phase: compute on the upper lane of each rank, communication below;
    phases with many micro-batches in merged blocks (``timeline_blocks``). A flush-free (2BW) phase has
    no iteration of its own: it shows one period of its steady state (``steady_state``), marked, with a
    quarter period of context either side."""
    fig = go.Figure()
    # the idle legend entry: rows are drawn on an idle-coloured band, so gaps read as bubbles
    fig.add_trace(go.Bar(x=[None], y=[None], orientation="h", marker_color=IDLE_COLOUR, name="Idle (pipeline bubble)",
                         hoverinfo="skip", showlegend=True))
    groups, layouts = [], []
    Kmax = max(ph.K for ph in plan.phases)
    on_trajectory = {t.phase for t in plan.trajectory}
    styles_used: set[str] = set()
    for i, ph in enumerate(plan.phases):
        tl = sorted(ph.timeline, key=lambda e: (e.start, e.rank))
        steady = steady_state(ph, plan.inputs.cluster.step_overhead_s)
        recorded = len(tl)
        if steady is not None:
            tl = _steady_events(tl, steady)
        n_drawable = len(tl)
        cut = n_drawable > MAX_TIMELINE_EVENTS
        tl = tl[:MAX_TIMELINE_EVENTS]
        first = len(fig.data)
        ranks0 = ph.ranks[0]
        span = max((e.end for e in tl), default=0.0) - (min(e.start for e in tl) if steady is not None and tl else 0.0)
        blocks, tols = timeline_blocks(tl)
        # micro-batch numbers inside bars only where every bar is wide enough (~18 px of a ~700 px axis)
        compute = [b.end - b.start for b in blocks if b.lane == "compute"]
        label = bool(compute) and span > 0 and float(np.median(compute)) / span * 700 >= 18
        by_style: dict[str, list[Block]] = {}
        for b in blocks:
            by_style.setdefault(b.style, []).append(b)
        order = [*KIND_STYLE, *(f"mixed-{lane}" for lane in MIXED_STYLE)]
        for style in sorted(by_style, key=lambda s: order.index(s) if s in order else len(order)):
            bs = by_style[style]
            styles_used.add(style)
            comm = bs[0].lane == "comm"
            marker: dict[str, Any]
            if style.startswith("mixed-"):
                name, bg, fg = MIXED_STYLE[bs[0].lane]
                marker = dict(color=bg, pattern=dict(shape="/", fgcolor=fg, bgcolor=bg, size=6, solidity=0.45),
                              line=dict(width=0.5, color="white"))
            else:
                name, colour, _ = KIND_STYLE.get(style, (style, "#BAB0AC", "compute"))
                marker = dict(color=colour, line=dict(width=0.5, color="white"))
            if tols:  # a merged block is as opaque as its rank was busy in it (an idle stretch is a ghost)
                marker["opacity"] = [max(0.2, b.busy_share) for b in bs]
            start = np.array([b.start for b in bs]) * 1e3
            end = np.array([b.end for b in bs]) * 1e3
            y = np.array([b.rank for b in bs], dtype=float) + (0.27 if comm else -0.12)
            cd = [[_block_words(b), b.stage, ranks0[b.rank] if b.rank < len(ranks0) else b.rank,
                   f"{b.start * 1e3:.2f}", f"{b.end * 1e3:.2f}", f"{(b.end - b.start) * 1e3:.2f}",
                   _share(b.busy_share), b.events] for b in bs]
            text = None
            if (label or tols) and not comm:  # merged blocks: each labelled where it fits (uniformtext hides the rest)
                text = [_block_label(b) for b in bs]
            lane_tol = tols.get("comm" if comm else "compute")
            busy = (f"<br>Busy %{{customdata[6]}} of this block (idle gaps under {_duration(lane_tol)} merged)"
                    if lane_tol is not None else "")
            fig.add_trace(go.Bar(
                x=end - start, base=start, y=y, width=0.22 if comm else 0.6, orientation="h", name=name,
                legendgroup=style, marker=marker, customdata=cd, text=text, textposition="inside",
                insidetextanchor="middle", textangle=0,
                textfont=dict(color=["white" if not tols or b.busy_share >= 0.5 else "#1f2933" for b in bs],
                              size=10),
                hovertemplate=("<b>%{customdata[0]}</b><br>Stage %{customdata[1]} (rank %{customdata[2]})<br>"
                               "%{customdata[3]} → %{customdata[4]} ms (%{customdata[5]} ms)" + busy
                               + "<extra></extra>")))
        groups.append(list(range(first, len(fig.data))))
        K = ph.K
        end_ms = (span or ph.predicted.iteration_s) * 1e3
        shapes = [dict(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=s - 0.45, y1=s + 0.42,
                       fillcolor=IDLE_COLOUR, line=dict(width=0), layer="below") for s in range(K)]
        anns = []
        if not tl:
            why = ("this phase is not on the predicted trajectory (only an adaptive run reaches it); the plan "
                   "stores timelines of the trajectory's phases" if i not in on_trajectory else
                   "the plan did not store this phase's timeline (too many events)")
            anns.append(_placeholder(f"No timeline recorded for this phase:<br>{why}"))
        elif cut:
            anns.append(dict(text=f"showing the first {MAX_TIMELINE_EVENTS} of {n_drawable} events",
                             x=1, y=1.0, xref="paper", yref="paper", xanchor="right", yanchor="bottom",
                             showarrow=False, font=dict(size=11, color="#6b7280")))
        pr = ph.predicted
        merged = ""
        gap = tols.get("compute", tols.get("comm", 0.0))
        if tols:
            merged = f" · {len(tl):,} events as {len(blocks):,} blocks (idle gaps under {_duration(gap)} merged)"
        fill = f" · AutoCache fill iteration {_duration(pr.fill_iteration_s)}" if pr.fill_iteration_s > 0 else ""
        x_range = [0, end_ms * 1.02 if end_ms > 0 else 1]
        x_title = "Time within one iteration (ms)"
        if steady is None:
            title = (f"Iteration timeline of pipeline 0 — {_phase_title(i, ph)} · "
                     f"{_schedule_name(ph.schedule)}<br><sup>{_duration(pr.iteration_s)} per iteration · "
                     f"bubble {pr.bubble_fraction:.0%}"
                     + (f" · exposed all-reduce {_duration(pr.allreduce_s)}" if ph.D > 1 else "")
                     + fill + merged + "</sup>")
        else:
            lo_ms, hi_ms = (steady.start - steady.period / 4) * 1e3, (steady.end + steady.period / 4) * 1e3
            x_range = [lo_ms, hi_ms]
            x_title = f"Time in the simulated {steady.minibatches}-mini-batch flush-free window (ms)"
            t0, M = steady.minibatch, ph.M
            overhead = steady.iteration_s - steady.period
            per = (f"one mini-batch (iteration) per period: {_duration(pr.iteration_s)} per iteration"
                   + (f" (the pipeline's {steady.period:.6g} s + {_duration(overhead)} fixed step overhead, not "
                      f"drawn)" if overhead > 0 else ""))
            title = (f"Flush-free steady state of pipeline 0: one period = {_duration(steady.iteration_s)} — "
                     f"{_phase_title(i, ph)} · {_schedule_name(ph.schedule)}<br><sup>{per} · "
                     f"bubble {pr.bubble_fraction:.0%}</sup><br><sup>shaded: mini-batch {t0}'s period (micro-batches "
                     f"{t0 * M}–{t0 * M + M - 1}) from stage 0's first forward; fill and drain happen once per phase"
                     f" · {len(tl):,} of {recorded:,} events" + (f" as {len(blocks):,} blocks (gaps under "
                                                                   f"{_duration(gap)} merged)" if tols else "")
                     + "</sup>")
            shapes.append(dict(type="rect", xref="x", x0=steady.start * 1e3, x1=steady.end * 1e3, yref="paper",
                               y0=0, y1=1, fillcolor="rgba(238,202,59,0.28)", line=dict(width=0), layer="below"))
            shapes += [dict(type="line", xref="x", x0=x * 1e3, x1=x * 1e3, yref="paper", y0=0, y1=1,
                            line=dict(color="#8A5300", width=1.5, dash="dash"), layer="above")
                       for x in (steady.start, steady.end)]
            anns.append(dict(text=f"one period: {_duration(steady.iteration_s)} (mini-batch {t0})",
                             x=(steady.start + steady.period / 2) * 1e3, xref="x", y=1.0, yref="paper",
                             yanchor="bottom", showarrow=False, font=dict(size=11, color="#8A5300")))
        layouts.append({
            "title.text": title,
            "yaxis.tickvals": list(range(K)),
            "yaxis.ticktext": [f"Stage {s} · rank {ph.ranks[0][s]}" for s in range(K)],
            "yaxis.range": [K - 0.5, -0.5],
            "xaxis.range": x_range,
            "xaxis.title.text": x_title,
            "shapes": shapes if tl else [],
            "annotations": anns,
            "xaxis.visible": bool(tl), "yaxis.visible": bool(tl),
        })
    legend_px = 27 * (len(styles_used) + 1)  # the legend must fit beside the plot without scrolling
    flush_free = any(ph.schedule == "2bw" for ph in plan.phases)  # a three-line title
    height = int(min(800, max(260 + legend_px, 190 + 56 * Kmax))) + (28 if flush_free else 0)
    _base_layout(fig, "Iteration timeline", height)
    fig.update_layout(barmode="overlay", bargap=0, uniformtext=dict(minsize=8, mode="hide"),
                      margin=dict(l=130, r=30, t=100 if flush_free else 72, b=60), hovermode="closest")
    fig.update_xaxes(title_text="Time within one iteration (ms)", zeroline=False)
    fig.update_yaxes(showgrid=False, zeroline=False)
    first_drawn = next((i for i, ph in enumerate(plan.phases) if ph.timeline), 0)
    _add_selector(fig, _phase_labels(plan), groups, layouts, "Frozen blocks: ", always=[0], active=first_drawn)
    return fig


# ---- 4. throughput and cumulative time against the baseline ------------------------------------
@dataclass(frozen=True, kw_only=True)
class Segment:
    """Part of a run at one throughput: its AutoCache fill iterations, or its steady ones."""

    run: Run
    fill: bool
    x0: float
    x1: float
    iterations: int
    seconds: float
    samples: float


def _segments(plan: Plan, runs: Sequence[Run]) -> list[Segment]:
    out = []
    for r in runs:
        B = plan.phases[r.phase].global_batch
        if r.fill_iterations:
            out.append(Segment(run=r, fill=True, x0=r.x0, x1=r.x_fill, iterations=r.fill_iterations,
                               seconds=r.fill_seconds, samples=float(r.fill_iterations * B)))
        steady = r.iterations - r.fill_iterations
        if steady > 0:
            out.append(Segment(run=r, fill=False, x0=r.x_fill, x1=r.x1, iterations=steady,
                               seconds=max(r.seconds - r.fill_seconds, 0.0), samples=float(steady * B)))
    return out


def throughput_figure(plan: Plan) -> go.Figure:
    """Samples/s over training and cumulative training time, elastic plan versus the static baseline;
    AutoCache fill iterations drawn apart (they are slower than the steady ones)."""
    runs = trajectory_runs(plan)
    segs = _segments(plan, runs)
    E = plan.inputs.training.epochs
    thr = np.array([s.samples / s.seconds if s.seconds > 0 else 0.0 for s in segs], dtype=float)
    base_thr = plan.baseline.phase.predicted.samples_per_s
    total = plan.totals.seconds
    speedup = plan.totals.speedup
    unit, div = _time_unit(max(plan.baseline.seconds, total))
    bph = plan.baseline.phase
    base_name = f"Baseline: no freezing, static K={bph.K} × D={bph.D}"
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("Throughput", "Cumulative training time"))

    def cd(s: Segment, t: float) -> list[Any]:
        ph = plan.phases[s.run.phase]
        what = (f"AutoCache fill: {s.iterations:,} iterations" if s.fill
                else f"{s.iterations:,} steady iterations")
        return [s.run.frozen_blocks, ph.K, ph.D, _duration(s.seconds), t / base_thr if base_thr > 0 else 0.0, what]

    xs = [s.x0 for s in segs] + ([segs[-1].x1] if segs else [])
    ys = list(thr) + list(thr[-1:])
    cds = [cd(s, t) for s, t in zip(segs, thr)] + ([cd(segs[-1], thr[-1])] if segs else [])
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="lines+markers", name="Elastic plan (freezing)",
        line=dict(color=PLAN_COLOUR, width=3, shape="hv"), marker=dict(size=[7] * len(segs) + [0]),
        legendgroup="plan", customdata=cds,
        hovertemplate="Epoch %{x:.2f}: %{y:,.0f} samples/s (%{customdata[4]:.1f}× baseline)<br>%{customdata[5]}, "
                      "%{customdata[3]}<br>f=%{customdata[0]} frozen · K=%{customdata[1]} × D=%{customdata[2]}"
                      "<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(
        x=[0, E], y=[base_thr, base_thr], mode="lines", line=dict(color=BASE_COLOUR, dash="dash", width=2.5),
        name=base_name, legendgroup="base",
        hovertemplate=f"Baseline: {base_thr:,.0f} samples/s<extra></extra>"), row=1, col=1)
    # cumulative: the rate is constant within a segment, so straight lines between segment ends are exact
    cum = np.concatenate([[0.0], np.cumsum([s.seconds for s in segs])])
    cx = [segs[0].x0 if segs else 0.0] + [s.x1 for s in segs]
    fig.add_trace(go.Scatter(
        x=cx, y=cum / div, mode="lines+markers", line=dict(color=PLAN_COLOUR, width=3), marker=dict(size=6),
        name="Elastic plan (freezing)", legendgroup="plan", showlegend=False,
        hovertemplate=f"Epoch %{{x:.2f}}: %{{y:.3g}} {unit}<extra>plan</extra>"), row=1, col=2)
    base_x = np.arange(0, E + 1, max(1, E // 200))
    if base_x[-1] != E:
        base_x = np.append(base_x, E)
    fig.add_trace(go.Scatter(
        x=base_x, y=plan.baseline.seconds * base_x / max(E, 1) / div, mode="lines+markers",
        line=dict(color=BASE_COLOUR, dash="dash", width=2.5), marker=dict(size=5 if len(base_x) <= 31 else 0),
        name=base_name, legendgroup="base", showlegend=False,
        hovertemplate=f"Epoch %{{x}}: %{{y:.3g}} {unit}<extra>baseline</extra>"), row=1, col=2)
    fills = [(k, s) for k, s in enumerate(segs) if s.fill]
    if fills:
        fx: list[float | None] = []
        fy: list[float | None] = []
        gx: list[float | None] = []
        gy: list[float | None] = []
        for k, s in fills:
            fx += [s.x0, s.x1, None]
            fy += [thr[k], thr[k], None]
            gx += [s.x0, s.x1, None]
            gy += [cum[k] / div, cum[k + 1] / div, None]
        fill_name = "AutoCache fill iterations (first pass over the data after a freeze)"
        fig.add_trace(go.Scatter(x=fx, y=fy, mode="lines", line=dict(color=FILL_COLOUR, width=9), opacity=0.7,
                                 name=fill_name, legendgroup="fill", hoverinfo="skip"), row=1, col=1)
        fig.add_trace(go.Scatter(x=gx, y=gy, mode="lines", line=dict(color=FILL_COLOUR, width=9), opacity=0.7,
                                 name=fill_name, legendgroup="fill", showlegend=False, hoverinfo="skip"),
                      row=1, col=2)
    if len(cum) > 1:
        fig.add_annotation(x=cx[-1], y=cum[-1] / div, xref="x2", yref="y2", text=f"{speedup:.2f}× faster",
                           showarrow=True, arrowhead=0, ax=-40, ay=-40, font=dict(size=13, color=PLAN_COLOUR))
    pos = thr[thr > 0]
    log = bool(len(pos)) and max(pos.max(), base_thr) / max(min(pos.min(), base_thr), 1e-12) > 20
    fill_s = plan.totals.fill_seconds
    fill_txt = (f" · AutoCache fills add {_duration(fill_s)} ({fill_s / total:.1%} of the plan)"
                if fill_s > 0 and total > 0 else "")
    title = (f"Throughput and training time — predicted speedup {speedup:.2f}×<br><sup>{total / div:.3g} vs "
             f"{plan.baseline.seconds / div:.3g} {unit} for the baseline{fill_txt} · transitions not included</sup>")
    _base_layout(fig, title, 470, legend_right=False)
    fig.update_layout(margin=dict(l=70, r=30, t=95, b=110), legend=dict(y=-0.22))
    fig.update_yaxes(title_text="Samples per second" + (" (log scale)" if log else ""),
                     type="log" if log else "linear", dtick=1 if log else None, rangemode="tozero",
                     tickformat="~s", row=1, col=1)
    fig.update_yaxes(title_text=f"Elapsed training time ({unit})", rangemode="tozero", row=1, col=2)
    for c in (1, 2):
        fig.update_xaxes(**_epoch_axis(E), row=1, col=c)
    fig.update_annotations(selector=dict(text="Throughput"), font_size=13)
    fig.update_annotations(selector=dict(text="Cumulative training time"), font_size=13)
    return fig


# ---- 5. per-stage peak memory against capacity ---------------------------------------------------
def _stack(m: MemoryBreakdown) -> dict[str, int]:
    """The terms that add up to the peak: activations and the transient never coexist (the transient
    comes after the pipeline drained), so only the larger of the two is stacked."""
    out = {k: int(getattr(m, k)) for k, _, _ in MEMORY_TERMS}
    if out["activations"] >= out["transient"]:
        out["transient"] = 0
    else:
        out["activations"] = 0
    return out


def _position_chunks(ph: Phase) -> list[list[int]]:
    """Per pipeline position (rank of a pipeline), the chunks (stages) it runs: [k] when V = 1."""
    out: list[list[int]] = [[] for _ in range(ph.K)]
    for c, k in enumerate(ph.stage_to_rank()):
        out[k].append(c)
    return out


def _position_layers(ph: Phase, k: int) -> str:
    """The layers position k runs, chunk by chunk ("layers 3–5, 9–11" with V > 1)."""
    parts = [_layers(*ph.partition[c]) for c in _position_chunks(ph)[k]]
    return parts[0] if len(parts) == 1 else "chunks " + ", ".join(
        f"{c}: {w}" for c, w in zip(_position_chunks(ph)[k], parts))


def _position_memory(ph: Phase) -> tuple[list[int], list[dict[str, int]] | None, list[int]]:
    """Per position: the peak (bytes), its stacked terms (None without a break-down) and micro-batches in
    flight. V = 1: the stage's own numbers. V > 1: a rank holds V chunks, whose fixed terms add up and
    whose activations peak together as the simulator tracked them (``rank_peak_memory_bytes``); the
    activations (or the transient, whichever is larger) are the rest of the rank's peak."""
    mems, peaks = ph.predicted.stage_memory, ph.predicted.stage_peak_memory_bytes
    if ph.V == 1:
        return (list(peaks), [_stack(m) for m in mems] if mems else None,
                [m.inflight for m in mems] if mems else [0] * ph.K)
    chunks = _position_chunks(ph)
    rank_peaks = list(ph.predicted.rank_peak_memory_bytes) or [sum(peaks[c] for c in cs) for cs in chunks]
    if not mems:
        return rank_peaks, None, [0] * ph.K
    terms, inflight = [], []
    for k, cs in enumerate(chunks):
        t = {key: sum(int(getattr(mems[c], key)) for c in cs) for key, _, _ in MEMORY_TERMS}
        fixed = t["weights"] + t["gradients"] + t["optimizer"] + t["buffers"]
        rest = max(rank_peaks[k] - fixed, 0)
        after = t["transient"]
        t["activations"], t["transient"] = (0, rest) if after >= rest and after > 0 else (rest, 0)
        terms.append(t)
        inflight.append(sum(mems[c].inflight for c in cs))
    return rank_peaks, terms, inflight


def _memory_phase(ph: Phase, cap: float, div: float) -> dict[str, list[Any]]:
    """One phase's data for the memory figure's fixed traces: the MEMORY_TERMS bars, the single-bar
    fallback (a plan without the break-down), and the peak labels -- one bar per pipeline position (its
    stage, or its V chunks together: ``_position_memory``)."""
    peaks_l, terms, inflight = _position_memory(ph)
    peaks = np.array(peaks_l, dtype=float)
    x = [f"Stage {s}" for s in range(ph.K)] if ph.V == 1 else [f"Position {k}" for k in range(ph.K)]
    mems = ph.predicted.stage_memory
    out: dict[str, list[Any]] = {"x": [], "y": [], "customdata": [], "visible": [], "text": [],
                                 "textfont.color": []}

    def add(y: Any, cd: Any, visible: bool, text: Any = None, colour: Any = None) -> None:
        out["x"].append(x)
        out["y"].append(y)
        out["customdata"].append(cd)
        out["visible"].append(visible)
        out["text"].append(text)
        out["textfont.color"].append(colour)

    for key, _, _ in MEMORY_TERMS:
        if not terms or not any(t[key] for t in terms) and not any(getattr(m, key) for m in mems):
            add([0.0] * ph.K, [""] * ph.K, False)
            continue
        ys = np.array([t[key] for t in terms], dtype=float)
        said = []
        for s, v in enumerate(ys):
            raw = int(getattr(mems[s], key)) if ph.V == 1 else int(v)
            said.append(_bytes(v) if raw == v else f"{_bytes(raw)}, not in the peak (it never coexists with the "
                                                   f"{'transient' if key == 'activations' else 'activations'})")
        add(list(ys / div), said, True)
    add(list(peaks / div), [_bytes(p) for p in peaks], not terms)
    notes = []
    for k in range(ph.K):
        words = _position_layers(ph, k)
        if mems:
            n = inflight[k]
            words += f" · {n} micro-batch{'es' if n != 1 else ''} in flight"
            if ph.V > 1:
                words += f" over its {ph.V} chunks"
        notes.append(words)
    add(list(peaks / div), [[_bytes(p), f"{p / cap:.1%}", n] for p, n in zip(peaks, notes)], True,
        [_bytes(p) for p in peaks], ["#D62728" if p > cap else "#1f2933" for p in peaks])
    return out


def memory_figure(plan: Plan) -> go.Figure:
    """Each stage's predicted peak memory per phase, stacked term by term (``Prediction.stage_memory``),
    in the unit that fits the phase, against the device's capacity where it is on the same scale.

    The figure has one trace per term (plus the peak labels); the phase selector swaps their data."""
    cap = float(plan.inputs.cluster.gpu_memory_bytes)
    noun = _noun(plan)
    fig = go.Figure()
    for key, name, colour in MEMORY_TERMS:
        fig.add_trace(go.Bar(name=name, legendgroup=key, marker=dict(color=colour, line=dict(width=0)),
                             hovertemplate=f"{name}: %{{customdata}}<extra></extra>"))
    fig.add_trace(go.Bar(name="Peak memory (no break-down in this plan)", marker=dict(color=PLAN_COLOUR),
                         hovertemplate="Peak %{customdata}<extra></extra>"))
    fig.add_trace(go.Scatter(
        mode="text", textposition="top center", textfont=dict(size=11), showlegend=False, cliponaxis=False,
        name="Peak", hovertemplate="<b>Peak %{customdata[0]}</b> (%{customdata[1]} of capacity) · %{customdata[2]}"
                                   "<extra></extra>"))
    data: list[dict[str, list[Any]]] = []
    layouts: list[dict[str, Any]] = []
    for i, ph in enumerate(plan.phases):
        peaks = ph.predicted.device_peak_memory_bytes
        peak = float(max(peaks)) if peaks else 0.0
        show_cap = peak >= CAPACITY_SHOWN_ABOVE * cap
        unit, div = _byte_unit(max(peak, cap) if show_cap else max(peak, 1.0))
        data.append(_memory_phase(ph, cap, div))
        anns, shapes = [], []
        if show_cap:
            shapes.append(dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=cap / div, y1=cap / div,
                               line=dict(color="#D62728", dash="dash", width=2)))
            anns.append(dict(text=f"{noun} capacity {_bytes(cap)}", x=1, xref="paper", xanchor="right",
                             y=cap / div, yref="y", yanchor="bottom", showarrow=False,
                             font=dict(size=11, color="#D62728")))
        else:
            anns.append(dict(text=f"{noun} capacity {_bytes(cap)} is off this scale: the fullest stage uses "
                                  f"{peak / cap:.1%} of it", x=1, xref="paper", xanchor="right", y=1,
                             yref="paper", yanchor="bottom", showarrow=False, font=dict(size=11, color="#6b7280")))
        nover = sum(p > cap for p in peaks)
        if nover:
            anns.append(dict(text=f"{nover} stage(s) over capacity", x=0, xref="paper", xanchor="left", y=1,
                             yref="paper", yanchor="bottom", showarrow=False, font=dict(size=12, color="#D62728")))
        top = max(peak, cap if show_cap else 0.0) / div
        layouts.append({
            "title.text": (f"Peak {noun} memory per {'stage' if ph.V == 1 else f'position ({ph.V} chunks each)'} — "
                           f"{_phase_title(i, ph)}"
                           + (" · stage 0 also holds the frozen prefix" if ph.frozen_layers and not ph.cache else "")
                           + (" · stage 0 holds the cached prefix outputs" if ph.cache else "")),
            "xaxis.range": [-0.6, ph.K - 0.4], "annotations": anns, "shapes": shapes,
            "yaxis.title.text": f"Predicted peak memory ({unit})", "yaxis.range": [0, top * 1.18 if top else 1],
        })
    _base_layout(fig, f"Peak {noun} memory per stage", 480)
    fig.update_layout(barmode="stack", bargap=0.35, margin=dict(l=70, r=30, t=80, b=60), hovermode="x unified",
                      legend=dict(traceorder="reversed"), uniformtext=dict(minsize=8, mode="hide"))
    Kmax = max(ph.K for ph in plan.phases)
    fig.update_xaxes(title_text=f"Pipeline stage (one {noun} each; every pipeline has the same layout)",
                     type="category", categoryorder="array", categoryarray=[f"Stage {s}" for s in range(Kmax)])
    _add_data_selector(fig, _phase_labels(plan), data, layouts, "Frozen blocks: ")
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
    pm_b = np.array([r.predicted_peak_memory_bytes for r in rows], dtype=float)
    mm_b = np.array([r.measured_peak_memory_bytes if r.measured_peak_memory_bytes is not None else np.nan
                     for r in rows], dtype=float)
    unit, div = _byte_unit(float(np.nanmax(np.concatenate([pm_b, mm_b, [1.0]]))))
    pm, mm = pm_b / div, mm_b / div
    fig.add_trace(go.Bar(x=x, y=pm, name="Predicted", marker_color=PRED_COLOUR, legendgroup="pred", showlegend=False,
                         customdata=[[_bytes(b)] for b in pm_b],
                         hovertemplate="%{x}<br>predicted %{customdata[0]}<extra></extra>"), row=1, col=2)
    fig.add_trace(go.Bar(x=x, y=mm, name="Measured", marker_color=MEAS_COLOUR, legendgroup="meas", showlegend=False,
                         text=[_err_text(r.memory_error) for r in rows], textposition="outside", cliponaxis=False,
                         customdata=[[_err_text(r.memory_error), _bytes(b) if np.isfinite(b) else "not measured"]
                                     for r, b in zip(rows, mm_b)],
                         hovertemplate="%{x}<br>measured %{customdata[1]}<br>prediction error %{customdata[0]}"
                                       "<extra></extra>"), row=1, col=2)
    mem_part = (f", peak memory {comparison.median_abs_memory_error:.1%}"
                if comparison.median_abs_memory_error is not None else ", peak memory not measured")
    _base_layout(fig, f"Predicted against measured — median |error|: iteration time "
                      f"{comparison.median_abs_iteration_error:.1%}{mem_part}", 470, legend_right=False)
    fig.update_layout(barmode="group", bargap=0.25, margin=dict(l=70, r=30, t=80, b=110), legend=dict(y=-0.25))
    top_t = float(np.nanmax(np.concatenate([pt, mt]))) if len(rows) else 1.0
    fig.update_yaxes(title_text="Milliseconds per iteration", range=[0, top_t * 1.2], row=1, col=1)
    top_m = float(np.nanmax(np.concatenate([pm, mm]))) if len(rows) and has_mem else float(pm.max(initial=1.0))
    fig.update_yaxes(title_text=unit, range=[0, top_m * 1.2], row=1, col=2)
    if not has_mem:
        fig.add_annotation(text="memory not measured in this run", x=0.78, xref="paper", y=0.5, yref="paper",
                           showarrow=False, font=dict(size=13, color="#6b7280"))
    return fig


def evaluation_figure(comparison: "Comparison") -> go.Figure:
    """The run's held-out loss (left) and accuracy or perplexity (right) against optimizer steps, each point
    marked with the phase (frozen blocks, K, D) it was evaluated in."""
    ev = comparison.evals
    lm = any(e.get("perplexity") is not None for e in ev)
    second = "Perplexity" if lm else "Accuracy"
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=("Held-out loss", second))
    steps = [e["step"] for e in ev]
    words = [f"step {e['step']} · epoch {e['epoch']} · phase {e['phase']} · {e['samples']} samples" for e in ev]
    fig.add_trace(go.Scatter(x=steps, y=[e["loss"] for e in ev], mode="lines+markers", name="Loss",
                             marker_color=MEAS_COLOUR, customdata=words,
                             hovertemplate="%{customdata}<br>loss %{y:.4f}<extra></extra>"), row=1, col=1)
    vals = [e.get("perplexity") if lm else (None if e.get("accuracy") is None else 100 * e["accuracy"]) for e in ev]
    fig.add_trace(go.Scatter(x=steps, y=vals, mode="lines+markers", name=second, marker_color=PRED_COLOUR,
                             customdata=words, hovertemplate="%{customdata}<br>" + ("perplexity %{y:.4g}" if lm else
                                                                                    "accuracy %{y:.1f} %")
                             + "<extra></extra>"), row=1, col=2)
    _base_layout(fig, f"Held-out evaluation — last: loss {ev[-1]['loss']:.4f}"
                      + (f", perplexity {ev[-1]['perplexity']:.4g}" if lm and ev[-1].get("perplexity") is not None
                         else f", accuracy {ev[-1]['accuracy']:.1%}" if ev[-1].get("accuracy") is not None else ""),
                 420, legend_right=False)
    fig.update_layout(showlegend=False, margin=dict(l=70, r=30, t=80, b=60))
    for c in (1, 2):
        fig.update_xaxes(title_text="Optimizer steps", row=1, col=c)
    fig.update_yaxes(title_text="Cross-entropy" + (" per token" if lm else " per sample"), row=1, col=1)
    fig.update_yaxes(title_text="Perplexity" if lm else "Accuracy (%)", row=1, col=2)
    return fig


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
    bars beside the rows it has (PyTorch blog Fig. 9: ViT-B/16, ImageNet, 2 x 8 Quadro RTX 5000)."""
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
    paper = [(lab, r.paper_speedup) for lab, r in zip(labels, rows) if r.paper_speedup is not None]
    if paper:
        fig.add_trace(go.Scatter(y=[p[0] for p in paper], x=[p[1] for p in paper], mode="markers",
                                 marker=dict(symbol="diamond", size=12, color="#E45756"),
                                 name="the paper's bar (ViT-B/16 ImageNet, 2 x 8 RTX 5000)",
                                 hovertemplate="paper: %{x:.2f}×<extra></extra>"))
    fig.add_vline(x=1.0, line_dash="dot", line_color=BASE_COLOUR)
    _base_layout(fig, f"Where the speedup comes from — {ab.model} on {ab.cluster}", 120 + 42 * len(rows),
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
