"""The AutoCache's host traffic on the profiled device and host, measured by the profiler (issue 22 item 2).

A caching phase's stage 0 moves three kinds of bytes besides its compute (``planner/stage.py: cache_setup_s``):
rows read from the cache's host memory to the device, rows computed on the device written into the cache, and, at
a fill on a GPU, the frozen prefix's weights streamed from host memory through the device. The plan priced all
three at one assumed 10 GB/s. On a lent H200 (``bench/fill_path.py``, bert-base, 32 rows of 128 x 768 bf16) the
real rates were far apart: 104 MB of weights went to the device at 8.4 GB/s from pageable memory and 54.8 GB/s
from page-locked memory (which the executor now keeps them in: ``runtime.stage.LayerStore``), a put of 6.3 MB of
rows from the device took 3.9 ms (1.6 GB/s) and a hit served them in 1.7 ms (3.7 GB/s).

``measure_host_io`` measures the three on this machine with the executor's own code, rows of the model's prefix
output shape (``ActivationCache`` in the cache's default RAM directory, fresh rows each step):

- ``weights_to_device_bytes_per_s``: a page-locked host tensor to the device (None on a CPU: nothing is streamed);
- ``rows_write_bytes_per_s``: ``ActivationCache.put`` of a step's rows held on the device (copy to the host and the
  slab write);
- ``rows_read_bytes_per_s``: ``ActivationCache.get`` of rows written earlier and their copy to the device (the
  first read of each: a later epoch's reads of the same rows can be faster).

Medians of ``repeats`` timed steps after two untimed ones; ``planner.cluster.measured_host_io`` charges them.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Callable

import torch

STEP_BYTES = 64 << 20
"""At most this many bytes of rows per timed step (and the weights tensor's size)."""


def _median(fn: Callable[[int], object], dev: torch.device, repeats: int) -> float:
    times = []
    for k in range(repeats + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn(k)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if k >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_host_io(device: torch.device, sample_shape: tuple[int, ...], dtype: torch.dtype, rows: int, *,
                    repeats: int = 8, root: str | None = None) -> dict[str, Any]:
    """The three rates (module docstring) for steps of ``rows`` rows of ``sample_shape`` in ``dtype`` (fewer where a
    step would pass ``STEP_BYTES``), with the rows and bytes per step they were measured at."""
    from ptplan.executor.cache.autocache import ActivationCache, default_root

    row_bytes = int(torch.Size(sample_shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    n = max(1, min(int(rows), STEP_BYTES // max(row_bytes, 1)))
    out: dict[str, Any] = {"rows_per_step": n, "bytes_per_step": n * row_bytes, "repeats": repeats,
                           "weights_to_device_bytes_per_s": None}
    if device.type == "cuda":
        host = torch.empty(STEP_BYTES, dtype=torch.uint8, pin_memory=True)
        s = _median(lambda k: host.to(device, non_blocking=True), device, repeats)
        out["weights_to_device_bytes_per_s"] = STEP_BYTES / s
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(n, *sample_shape, generator=gen).to(dtype).to(device)
    steps = repeats + 3  # one put that creates the slab, then repeats + 2 (two untimed)
    with tempfile.TemporaryDirectory(dir=root or default_root()) as d:
        cache = ActivationCache(d, job_id="host-io", create=True, sample_shape=tuple(sample_shape), dtype=dtype,
                                num_samples=steps * n, budget_bytes=2 * steps * n * row_bytes + (1 << 20),
                                shard_rows=steps * n)
        try:
            ids = [torch.arange(k * n, (k + 1) * n) for k in range(steps)]
            if cache.put(ids[0], 1, data) != n:  # creates the slab (once per shard in a run, not per step)
                raise RuntimeError(f"the cache in {d} took no rows: {cache.stats()}")
            write = _median(lambda k: cache.put(ids[k + 1], 1, data), device, repeats)
            read = _median(lambda k: cache.get(ids[k + 1], 1).to(device), device, repeats)
        finally:
            cache.cleanup()
    out["rows_write_bytes_per_s"] = n * row_bytes / write
    out["rows_read_bytes_per_s"] = n * row_bytes / read
    return out
