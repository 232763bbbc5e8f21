"""Micro-benchmarks of one accelerator, for calibrating its device model (``planner/devices.py`` ``Efficiency``).

Measures, with CUDA events (or wall time on CPU), the three things the projection's roofline assumes:

- matrix multiplies of the shapes Transformer layers run (tokens x hidden x hidden and x 4 hidden, from one sample
  to 64 x 512 tokens) and square ones up to 8192, in the given dtype: seconds and achieved FLOP/s, which
  ``Efficiency.matmul_max`` and ``matmul_half_s`` are fitted to;
- a streaming copy (device to device), for ``Efficiency.memory``;
- an empty-ish kernel (adding a scalar to a one-element tensor), for ``Efficiency.launch_s``.

Usage (on the machine with the GPU; writes JSON)::

    python bench/gpu_micro.py --device cuda --dtype bfloat16 --out gpu_micro.json
    python bench/gpu_micro.py --device cpu --quick   (a rehearsal of the script itself)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

HIDDENS = (768, 1024, 2048, 4096)
TOKENS = (128, 512, 2048, 8192, 32768)
SQUARES = (256, 512, 1024, 2048, 4096, 8192)


def _timer(dev: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    """Median seconds of ``fn`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
    def run(fn: Callable[[], object], warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return run


def _gemms(quick: bool) -> list[tuple[int, int, int]]:
    shapes: list[tuple[int, int, int]] = []
    for h in HIDDENS[:2] if quick else HIDDENS:
        for t in TOKENS[:2] if quick else TOKENS:
            shapes += [(t, h, h), (t, h, 4 * h), (t, 4 * h, h)]
    shapes += [(n, n, n) for n in (SQUARES[:2] if quick else SQUARES)]
    return shapes


def measure(dev: torch.device, dtype: torch.dtype, quick: bool) -> dict[str, Any]:
    time_it = _timer(dev)
    reps = 3 if quick else 20
    rows = []
    for m, k, n in _gemms(quick):
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        s = time_it(lambda: torch.mm(a, b), 3, reps)
        flops = 2.0 * m * k * n
        rows.append({"m": m, "k": k, "n": n, "flops": flops, "seconds": s, "flops_per_s": flops / s})
        del a, b
    nbytes = (64 if quick else 1024) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = time_it(lambda: dst.copy_(src), 3, reps)
    one = torch.zeros(1, device=dev)
    launch_s = time_it(lambda: one.add_(1.0), 10, 50 if not quick else 5)
    # launch rate of many back-to-back kernels (what a layer's chain of small kernels pays each)
    chain = 200

    def chained() -> None:
        for _ in range(chain):
            one.add_(1.0)
    chain_s = time_it(chained, 2, 5 if not quick else 2) / chain
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "gemms": rows,
            "copy": {"bytes": nbytes, "seconds": copy_s, "bytes_moved_per_s": 2 * nbytes / copy_s},
            "launch": {"single_kernel_s": launch_s, "chained_per_kernel_s": chain_s}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--quick", action="store_true", help="few shapes and repeats (a rehearsal)")
    ap.add_argument("--out", default="gpu_micro.json")
    a = ap.parse_args()
    dev = torch.device(a.device)
    res = measure(dev, getattr(torch, a.dtype), a.quick)
    print(f"{'m':>6} {'k':>6} {'n':>6} {'TFLOP/s':>9}")
    for r in res["gemms"]:
        print(f"{r['m']:>6} {r['k']:>6} {r['n']:>6} {r['flops_per_s'] / 1e12:>9.1f}")
    print(f"copy {res['copy']['bytes_moved_per_s'] / 1e9:.0f} GB/s (read + written); one kernel "
          f"{res['launch']['single_kernel_s'] * 1e6:.1f} us, chained {res['launch']['chained_per_kernel_s'] * 1e6:.1f} us")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
