"""ptplan.planner: pure planning (numpy, scipy, networkx, plotly) — never imports torch."""
