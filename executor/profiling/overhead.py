"""The runtime's per-action overhead on the profiled device, measured by the profiler (issue 22 item 2).

The executor's own step interpreter (``executor/runtime/step.py``: ``StepInterpreter`` with ``ChunkCompute``, what
every training step runs) executes a one-stage GPipe schedule over a module with next to no compute (a 16 x 16
linear layer, one sample per micro-batch), for M = ``low`` and ``high`` micro-batches, with no process group (one
stage sends nothing). The host CPU seconds of a step (``time.process_time``: the host work, what bounds small
actions on a GPU too, whose kernels run asynchronously) are a + 2M·o, so o = (cpu(high) − cpu(low)) /
(2·(high − low)) is the seconds per forward or backward action. The fastest of ``repeats`` steps is taken at each M
(noise only adds).

What it leaves out: the point-to-point posting of a pipeline with K > 1 (one stage has no peer; the cluster's
``action_overhead_s`` keeps the two-process figure where ``bench/overhead_bench.py`` measured it).
``planner.cluster.charged_overheads`` charges the larger of the two.
"""
from __future__ import annotations

import time

import torch


def measure_action_overhead(device: torch.device, *, low: int = 2, high: int = 32, repeats: int = 10) -> float | None:
    """Seconds of host work per pipelined forward or backward action of the step interpreter (module
    docstring). The caller's RNG state is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _measure(device, low, high, repeats)


def _loss(out: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _measure(device: torch.device, low: int, high: int, repeats: int) -> float:
    from ptplan.planner.schedule import build_schedule
    from ptplan.executor.runtime.step import ChunkCompute, StepInterpreter

    mod = torch.nn.Linear(16, 16).to(device)
    best: dict[int, float] = {}
    for M in (low, high):
        step = StepInterpreter(build_schedule("gpipe", 1, M, 1), 0, ChunkCompute({0: mod}, _loss, M=M, last=0),
                               group=None, device=device)
        x, y = torch.randn(M, 16, device=device), torch.randn(M, 16, device=device)
        times = []
        for i in range(repeats + 2):
            t0 = time.process_time()
            step.run(x, y, {})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:  # two warm-up steps
                times.append(time.process_time() - t0)
            mod.zero_grad(set_to_none=True)
        best[M] = min(times)
    return max(0.0, (best[high] - best[low]) / (2 * (high - low)))
