"""Figures 4 and 5: throughput and cumulative time against the baseline, and memory per stage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..plan import Phase, Plan
from .style import BASE_COLOUR, CAPACITY_SHOWN_ABOVE, FILL_COLOUR, MEMORY_TERMS, PLAN_COLOUR
from .text import _byte_unit, _bytes, _duration, _noun, _phase_title, _time_unit
from .layout import _add_data_selector, _base_layout, _phase_labels
from .positions import _position_layers, _position_memory
from .trajectory import _epoch_axis, Run, trajectory_runs


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


def _add_fill_traces(fig: go.Figure, segs: Sequence[Segment], thr: np.ndarray, cum: np.ndarray) -> None:
    """The AutoCache fill segments drawn thick over both panels (``cum``: cumulative time in the panel's unit)."""
    fills = [(k, s) for k, s in enumerate(segs) if s.fill]
    if not fills:
        return
    fx: list[float | None] = []
    fy: list[float | None] = []
    gx: list[float | None] = []
    gy: list[float | None] = []
    for k, s in fills:
        fx += [s.x0, s.x1, None]
        fy += [thr[k], thr[k], None]
        gx += [s.x0, s.x1, None]
        gy += [cum[k], cum[k + 1], None]
    fill_name = "AutoCache fill iterations (first pass over the data after a freeze)"
    fig.add_trace(go.Scatter(x=fx, y=fy, mode="lines", line=dict(color=FILL_COLOUR, width=9), opacity=0.7,
                             name=fill_name, legendgroup="fill", hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Scatter(x=gx, y=gy, mode="lines", line=dict(color=FILL_COLOUR, width=9), opacity=0.7,
                             name=fill_name, legendgroup="fill", showlegend=False, hoverinfo="skip"),
                  row=1, col=2)


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
    _add_fill_traces(fig, segs, thr, cum / div)
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
