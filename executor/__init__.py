"""ptplan.executor: everything that touches torch — model adapters, profiler, elastic runtime, cache."""
