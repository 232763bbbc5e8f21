"""Figure 3: the pipeline timeline (Gantt) of one iteration per phase, with its steady state."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go

from ..plan import Phase, Plan, TimelineEvent
from .style import (FORWARD_KINDS, IDLE_COLOUR, KIND_STYLE, KIND_WORDS, MAX_TIMELINE_EVENTS, MIXED_STYLE,
                    TIMELINE_BARS_PER_LANE)
from .text import _duration, _phase_title, _schedule_name
from .layout import _add_selector, _base_layout, _phase_labels


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


@dataclass(frozen=True)
class _Drawn:
    """One phase's timeline as drawn: its events (cut to MAX_TIMELINE_EVENTS), their blocks and how they merged."""

    events: list[TimelineEvent]
    steady: SteadyState | None
    recorded: int
    """Events the plan stores for the phase."""
    drawable: int
    """Events to draw before the cut (one steady-state window's, for a flush-free phase)."""
    blocks: list[Block]
    tols: dict[str, float]
    span: float
    """Seconds the drawn events cover."""


def _drawn(ph: Phase, step_overhead_s: float) -> _Drawn:
    tl = sorted(ph.timeline, key=lambda e: (e.start, e.rank))
    steady = steady_state(ph, step_overhead_s)
    recorded = len(tl)
    if steady is not None:
        tl = _steady_events(tl, steady)
    drawable = len(tl)
    tl = tl[:MAX_TIMELINE_EVENTS]
    span = max((e.end for e in tl), default=0.0) - (min(e.start for e in tl) if steady is not None and tl else 0.0)
    blocks, tols = timeline_blocks(tl)
    return _Drawn(tl, steady, recorded, drawable, blocks, tols, span)


def _style_trace(bs: list[Block], style: str, label: bool, tols: dict[str, float], ranks0: Sequence[int]) -> go.Bar:
    """The bars of one style (kind, or mixed lane) of one phase."""
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
    return go.Bar(
        x=end - start, base=start, y=y, width=0.22 if comm else 0.6, orientation="h", name=name,
        legendgroup=style, marker=marker, customdata=cd, text=text, textposition="inside",
        insidetextanchor="middle", textangle=0,
        textfont=dict(color=["white" if not tols or b.busy_share >= 0.5 else "#1f2933" for b in bs], size=10),
        hovertemplate=("<b>%{customdata[0]}</b><br>Stage %{customdata[1]} (rank %{customdata[2]})<br>"
                       "%{customdata[3]} → %{customdata[4]} ms (%{customdata[5]} ms)" + busy + "<extra></extra>"))


def _phase_traces(d: _Drawn, ranks0: Sequence[int]) -> list[go.Bar]:
    """One phase's bars, one trace per style, in KIND_STYLE's order."""
    # micro-batch numbers inside bars only where every bar is wide enough (~18 px of a ~700 px axis)
    compute = [b.end - b.start for b in d.blocks if b.lane == "compute"]
    label = bool(compute) and d.span > 0 and float(np.median(compute)) / d.span * 700 >= 18
    by_style: dict[str, list[Block]] = {}
    for b in d.blocks:
        by_style.setdefault(b.style, []).append(b)
    order = [*KIND_STYLE, *(f"mixed-{lane}" for lane in MIXED_STYLE)]
    return [_style_trace(by_style[style], style, label, d.tols, ranks0)
            for style in sorted(by_style, key=lambda s: order.index(s) if s in order else len(order))]


def _iteration_title(i: int, ph: Phase, d: _Drawn) -> str:
    pr = ph.predicted
    merged = ""
    if d.tols:
        gap = d.tols.get("compute", d.tols.get("comm", 0.0))
        merged = f" · {len(d.events):,} events as {len(d.blocks):,} blocks (idle gaps under {_duration(gap)} merged)"
    fill = f" · AutoCache fill iteration {_duration(pr.fill_iteration_s)}" if pr.fill_iteration_s > 0 else ""
    return (f"Iteration timeline of pipeline 0 — {_phase_title(i, ph)} · "
            f"{_schedule_name(ph.schedule)}<br><sup>{_duration(pr.iteration_s)} per iteration · "
            f"bubble {pr.bubble_fraction:.0%}"
            + (f" · exposed all-reduce {_duration(pr.allreduce_s)}" if ph.D > 1 else "")
            + fill + merged + "</sup>")


def _steady_title(i: int, ph: Phase, d: _Drawn, steady: SteadyState) -> str:
    pr = ph.predicted
    t0, M = steady.minibatch, ph.M
    gap = d.tols.get("compute", d.tols.get("comm", 0.0))
    overhead = steady.iteration_s - steady.period
    per = (f"one mini-batch (iteration) per period: {_duration(pr.iteration_s)} per iteration"
           + (f" (the pipeline's {steady.period:.6g} s + {_duration(overhead)} fixed step overhead, not "
              f"drawn)" if overhead > 0 else ""))
    return (f"Flush-free steady state of pipeline 0: one period = {_duration(steady.iteration_s)} — "
            f"{_phase_title(i, ph)} · {_schedule_name(ph.schedule)}<br><sup>{per} · "
            f"bubble {pr.bubble_fraction:.0%}</sup><br><sup>shaded: mini-batch {t0}'s period (micro-batches "
            f"{t0 * M}–{t0 * M + M - 1}) from stage 0's first forward; fill and drain happen once per phase"
            f" · {len(d.events):,} of {d.recorded:,} events" + (f" as {len(d.blocks):,} blocks (gaps under "
                                                                 f"{_duration(gap)} merged)" if d.tols else "")
            + "</sup>")


def _steady_marks(steady: SteadyState) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The shaded period, its two dashed edges, and its label."""
    shapes = [dict(type="rect", xref="x", x0=steady.start * 1e3, x1=steady.end * 1e3, yref="paper",
                   y0=0, y1=1, fillcolor="rgba(238,202,59,0.28)", line=dict(width=0), layer="below")]
    shapes += [dict(type="line", xref="x", x0=x * 1e3, x1=x * 1e3, yref="paper", y0=0, y1=1,
                    line=dict(color="#8A5300", width=1.5, dash="dash"), layer="above")
               for x in (steady.start, steady.end)]
    ann = dict(text=f"one period: {_duration(steady.iteration_s)} (mini-batch {steady.minibatch})",
               x=(steady.start + steady.period / 2) * 1e3, xref="x", y=1.0, yref="paper",
               yanchor="bottom", showarrow=False, font=dict(size=11, color="#8A5300"))
    return shapes, ann


def _phase_layout(i: int, ph: Phase, d: _Drawn, on_trajectory: bool) -> dict[str, Any]:
    """The layout a phase's selector step applies: title, axes, idle bands, notes."""
    K = ph.K
    end_ms = (d.span or ph.predicted.iteration_s) * 1e3
    shapes = [dict(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=s - 0.45, y1=s + 0.42,
                   fillcolor=IDLE_COLOUR, line=dict(width=0), layer="below") for s in range(K)]
    anns = []
    if not d.events:
        why = ("this phase is not on the predicted trajectory (only an adaptive run reaches it); the plan "
               "stores timelines of the trajectory's phases" if not on_trajectory else
               "the plan did not store this phase's timeline (too many events)")
        anns.append(_placeholder(f"No timeline recorded for this phase:<br>{why}"))
    elif d.drawable > MAX_TIMELINE_EVENTS:
        anns.append(dict(text=f"showing the first {MAX_TIMELINE_EVENTS} of {d.drawable} events",
                         x=1, y=1.0, xref="paper", yref="paper", xanchor="right", yanchor="bottom",
                         showarrow=False, font=dict(size=11, color="#6b7280")))
    x_range = [0, end_ms * 1.02 if end_ms > 0 else 1]
    x_title = "Time within one iteration (ms)"
    steady = d.steady
    if steady is None:
        title = _iteration_title(i, ph, d)
    else:
        x_range = [(steady.start - steady.period / 4) * 1e3, (steady.end + steady.period / 4) * 1e3]
        x_title = f"Time in the simulated {steady.minibatches}-mini-batch flush-free window (ms)"
        title = _steady_title(i, ph, d, steady)
        marks, ann = _steady_marks(steady)
        shapes += marks
        anns.append(ann)
    return {
        "title.text": title,
        "yaxis.tickvals": list(range(K)),
        "yaxis.ticktext": [f"Stage {s} · rank {ph.ranks[0][s]}" for s in range(K)],
        "yaxis.range": [K - 0.5, -0.5],
        "xaxis.range": x_range,
        "xaxis.title.text": x_title,
        "shapes": shapes if d.events else [],
        "annotations": anns,
        "xaxis.visible": bool(d.events), "yaxis.visible": bool(d.events),
    }


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
        d = _drawn(ph, plan.inputs.cluster.step_overhead_s)
        first = len(fig.data)
        for trace in _phase_traces(d, ph.ranks[0]):
            styles_used.add(trace.legendgroup)
            fig.add_trace(trace)
        groups.append(list(range(first, len(fig.data))))
        layouts.append(_phase_layout(i, ph, d, i in on_trajectory))
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
