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

- ``weights_to_device_bytes_per_s``: one page-locked host tensor of ``STEP_BYTES`` to the device (None on a CPU:
  nothing is streamed); a bound on the runtime's rate, which copies a layer tensor by tensor (``weights.streamed``);
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


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_seconds(fn: Callable[[int], object], dev: torch.device, repeats: int) -> float:
    """Median wall seconds of ``fn(k)`` for k = 2 .. repeats + 1 (k = 0, 1 untimed), the device synchronised
    before and after each call."""
    times = []
    for k in range(repeats + 2):
        sync(dev)
        t = time.perf_counter()
        fn(k)
        sync(dev)
        if k >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _room(root: str, want: int) -> tuple[str, int]:
    """The folder to measure in and its free bytes: ``root``, or the temporary directory when ``root`` (a small
    /dev/shm, as containers have) has less than ``want`` free and the temporary directory more."""
    import shutil

    free = shutil.disk_usage(root).free
    if free < want:
        other = tempfile.gettempdir()
        if (more := shutil.disk_usage(other).free) > free:
            return other, more
    return root, free


def measure_host_io(device: torch.device, sample_shape: tuple[int, ...], dtype: torch.dtype, rows: int, *,
                    repeats: int = 8, root: str | None = None, step_bytes: int = STEP_BYTES) -> dict[str, Any]:
    """The three rates (module docstring) for steps of ``rows`` rows of ``sample_shape`` in ``dtype``: fewer rows
    where a step would pass ``step_bytes`` or the steps would fill half the free space of the cache's folder. A
    rate that could not be measured (no room for one row) is None, with a ``note`` saying why: the plan then
    charges the config's ``host_read_bandwidth`` for it; the profile is kept."""
    from ptplan.executor.cache.autocache import ActivationCache, default_root

    row_bytes = int(torch.Size(sample_shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    steps = repeats + 3  # one put that creates the slab, then repeats + 2 (two untimed)
    where, free = _room(root or default_root(), 2 * steps * min(rows, step_bytes // max(row_bytes, 1)) * row_bytes)
    n = min(int(rows), step_bytes // max(row_bytes, 1), free // (2 * steps * row_bytes))
    out: dict[str, Any] = {"rows_per_step": n, "bytes_per_step": n * row_bytes, "repeats": repeats,
                           "weights_to_device_bytes_per_s": None, "rows_write_bytes_per_s": None,
                           "rows_read_bytes_per_s": None}
    if device.type == "cuda":
        host = torch.empty(step_bytes, dtype=torch.uint8, pin_memory=True)
        s = median_seconds(lambda k: host.to(device, non_blocking=True), device, repeats)
        out["weights_to_device_bytes_per_s"] = step_bytes / s
    if n < 1:
        out["note"] = f"{where} has {free} bytes free: no room for {steps} rows of {row_bytes} bytes"
        return out
    data = torch.randn(n, *sample_shape, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    with tempfile.TemporaryDirectory(dir=where) as d:
        cache = ActivationCache(d, job_id="host-io", create=True, sample_shape=tuple(sample_shape), dtype=dtype,
                                num_samples=steps * n, budget_bytes=2 * steps * n * row_bytes + (1 << 20),
                                shard_rows=steps * n)
        try:
            ids = [torch.arange(k * n, (k + 1) * n) for k in range(steps)]
            if cache.put(ids[0], 1, data) != n:  # creates the slab (once per shard in a run, not per step)
                out["note"] = f"the cache in {where} took none of {n} rows (no room for a slab)"
                return out
            write = median_seconds(lambda k: cache.put(ids[k + 1], 1, data), device, repeats)

            def read(k: int) -> None:
                rows_back = cache.get(ids[k + 1], 1)
                assert rows_back is not None, "rows written a step earlier are cached"
                rows_back.to(device)

            got = median_seconds(read, device, repeats)
        finally:
            cache.cleanup()
    out["rows_write_bytes_per_s"] = n * row_bytes / write
    out["rows_read_bytes_per_s"] = n * row_bytes / got
    return out
