"""The runtime's per-action overhead on the profiled device, measured by the profiler (issue 22 item 2).

torch.distributed.pipelining's schedule runtime (what the executor runs for K > 1: ``executor/runtime/stage.py``)
drives a one-stage pipeline over a module with next to no compute (a 16 x 16 linear layer, one sample per
micro-batch) in this process (a one-process gloo group), for M = ``low`` and ``high`` micro-batches; the host
CPU seconds of a step (``time.process_time``: the host work, what bounds small actions on a GPU too, whose
kernels run asynchronously) are a + 2M·o, so o = (cpu(high) − cpu(low)) / (2·(high − low)) is the seconds per
forward or backward action. The fastest of ``repeats`` steps is taken at each M (noise only adds).

What it leaves out: the point-to-point posting of a pipeline with K > 1 (one process has no peer; the cluster's
``action_overhead_s`` keeps the two-process figure where ``bench/overhead_bench.py`` measured it, 330 us on the
2-core CPU box against about 60 us here). ``planner.cluster.charged_overheads`` charges the larger of the two.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist


def measure_action_overhead(device: torch.device, *, low: int = 2, high: int = 32, repeats: int = 10) -> float | None:
    """Seconds of host work per pipelined forward or backward action (module docstring); None when a process
    group already exists in this process (the measurement needs its own)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if dist.is_initialized():
        return None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # leaves the caller's RNG alone
        return _measure(device, low, high, repeats)


def _measure(device: torch.device, low: int, high: int, repeats: int) -> float:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    fd, path = tempfile.mkstemp(prefix="ptplan-overhead-")
    os.close(fd)
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        try:
            mod = torch.nn.Linear(16, 16).to(device)
            stage = PipelineStage(mod, 0, 1, device)
            best: dict[int, float] = {}
            for M in (low, high):
                sched = ScheduleGPipe(stage, M, loss_fn=lambda out, y: out.sum())
                x, y = torch.randn(M, 16, device=device), torch.randn(M, 16, device=device)
                times = []
                for i in range(repeats + 2):
                    t0 = time.process_time()
                    sched.step(x, target=y)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if i >= 2:  # two warm-up steps
                        times.append(time.process_time() - t0)
                best[M] = min(times)
        finally:
            dist.destroy_process_group()
    finally:
        if os.path.exists(path):  # the file store removes it itself when the group is destroyed
            os.unlink(path)
    return max(0.0, (best[high] - best[low]) / (2 * (high - low)))
