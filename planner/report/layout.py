"""Plotly layout helpers of the report: the common look and the phase selectors (slider or dropdown)."""
from __future__ import annotations

from typing import Any, Sequence

import plotly.graph_objects as go

from ..plan import Plan
from .style import FONT, SLIDER_MAX_PHASES


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
