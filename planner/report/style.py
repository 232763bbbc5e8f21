"""Names, colours, fonts and limits shared by the report's figures and page."""
from __future__ import annotations

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
