"""ptplan.planner: pure planning (numpy and plotly; networkx only for Cluster.graph()) — never imports torch."""
