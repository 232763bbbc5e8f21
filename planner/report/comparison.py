"""Figure 6 (``ptplan show --run``): predicted against measured, per phase, and the evaluation."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .text import _byte_unit, _bytes
from .layout import _base_layout

if TYPE_CHECKING:
    from ..compare import Comparison


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
    events = [f"membership change at step {m['step']}: {m['from'].get('world_size')} -> {m['to'].get('world_size')} "
              f"processes, re-planned (plan {m['from'].get('plan_id')} -> {m['to'].get('plan_id')})"
              for m in comparison.memberships]
    if comparison.other_plan_steps:
        events.append(f"{comparison.other_plan_steps} step(s) of the run's other plan left out")
    if events:
        fig.add_annotation(text="<br>".join(events), x=0.5, xref="paper", y=1.12, yref="paper", showarrow=False,
                           font=dict(size=12, color="#b45309"))
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
