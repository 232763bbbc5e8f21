"""TeraPipe token slicing: planning time at the issue's size, and what slicing buys.

Legend: L tokens per sequence, K pipeline stages, g slice granularity (tokens), b samples.

1. Planning time of ``planner.terapipe.optimal_slices`` for L = 2048, K = 48 at g = 32, 16 and 8
   (median of ``--repeats``), beside TeraPipe's own DP kernel on this machine: 81.6 s (the figure in
   issue 16; not re-run here).
2. For a GPT-2-sized causal block (hidden 768) on L = 2048, K = 48: the chosen slices and the
   pipeline latency T against no token slicing (one slice) and the best uniform slicing, for
   b = 1 .. 32. The slice cost is an ILLUSTRATIVE model with TeraPipe's form, t = a + b·(β·s + γ·c +
   δ·s·c), with β from GPT-2's per-token FLOPs at an assumed 100 TFLOP/s (6·85M parameters per token
   over 48 stages), δ from the attention's s·c term at the same rate, a = 20 µs per slice and γ = 0:
   the shipped profiles measure no (s, c) grid yet (the profiler part of issue 16 is not built), so
   these latencies show the shape of the trade-off, not a GPU's numbers.

    python bench/terapipe_bench.py [--repeats 3] [--out bench/results/terapipe_bench.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from ptplan.planner.terapipe import SliceCost, optimal_slices, uniform_slices

L, K = 2048, 48
PEAK = 100e12
HIDDEN, PARAMS, LAYERS = 768, 85e6, 12


def gpt2_cost() -> SliceCost:
    per_token = 6 * PARAMS / K / PEAK  # forward + backward FLOPs of one token through one stage's share
    per_pair = 6 * 2 * HIDDEN * (LAYERS / K) / PEAK  # attention scores and values: s·c pairs per layer
    return SliceCost(const=20e-6, per_token=per_token, per_context=0.0, per_pair=per_pair, b=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/terapipe_bench.json")
    args = ap.parse_args()
    cost = gpt2_cost()
    timing = []
    print(f"planning time, L={L}, K={K} (TeraPipe's own DP here: 81.6 s, issue 16)")
    for g in (32, 16, 8):
        secs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = optimal_slices(cost, L, K, granularity=g)
            secs.append(time.perf_counter() - t0)
        timing.append({"granularity": g, "median_s": statistics.median(secs), "min_s": min(secs),
                       "candidates": res.candidates, "slices": len(res.slices)})
        print(f"  g={g:>2}: {statistics.median(secs):7.3f} s (min {min(secs):.3f}), {res.candidates} bounds "
              f"evaluated, {len(res.slices)} slices")
    rows = []
    print(f"\n{'b':>3} {'no slicing ms':>14} {'best uniform ms':>16} {'n':>4} {'optimal ms':>11} {'gain':>6}  slices")
    for b in (1, 2, 4, 8, 16, 32):
        c = replace(cost, b=b)
        one = uniform_slices(c, L, K, 1)
        uni = min((uniform_slices(c, L, K, n) for n in (2, 4, 8, 16, 32, 64, 128)), key=lambda s: s.latency_s)
        opt = optimal_slices(c, L, K, granularity=16)
        rows.append({"b": b, "unsliced_s": one.latency_s, "uniform_s": uni.latency_s, "uniform_n": len(uni.slices),
                     "optimal_s": opt.latency_s, "slices": list(opt.slices)})
        shown = ",".join(map(str, opt.slices[:6])) + (",…" if len(opt.slices) > 6 else "")
        print(f"{b:>3} {one.latency_s * 1e3:>14.2f} {uni.latency_s * 1e3:>16.2f} {len(uni.slices):>4} "
              f"{opt.latency_s * 1e3:>11.2f} {one.latency_s / opt.latency_s:>5.2f}x  {len(opt.slices)}: {shown}")
    Path(args.out).write_text(json.dumps({"command": " ".join(["python"] + sys.argv), "L": L, "K": K,
                                          "cost": cost.__dict__, "timing": timing, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
