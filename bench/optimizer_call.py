"""One optimizer call over a model against the sum of per-layer calls, and the planner's price of it.

The profiler times an AdamW step over each layer's parameters alone (``optimizer_s``); the runtime steps one
optimizer over all of a rank's parameters (``executor/runtime/optim.py``, one parameter group: weight decay 0, its
default). ``planner.costs.optimizer_call_s`` takes the fixed part of a call from the per-layer times (their
least-squares intercept against parameter counts) and prices a stage one call: fixed part + each layer's own.
This times, on this machine (CPU time of one thread, medians of 15 after 3 warm-ups), the per-layer calls and
one call over the model, and prints the per-layer sum, the planner's price and the measured call.

    python bench/optimizer_call.py [--models bert-tiny bert-small bert-base] [--out bench/results/optimizer_call.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def measure(name: str, repeats: int = 15, warmup: int = 3) -> dict[str, float]:
    from ptplan.executor.families import build_model
    from ptplan.executor.runtime.optim import make_optimizer
    from ptplan.planner.costs import optimizer_call_s

    model = build_model(name, seq_len=8)
    layers = [list(layer.parameters()) for layer in model.layers]
    for ps in layers:
        for p in ps:
            p.grad = torch.full_like(p, 1e-3)
    per_layer = [torch.optim.AdamW(ps, lr=1e-3) if ps else None for ps in layers]
    whole = make_optimizer([p for ps in layers for p in ps], "adamw", lr=1e-3)

    def layered() -> list[float]:
        out = []
        for opt in per_layer:
            a = time.process_time()
            if opt is not None:
                opt.step()
            out.append(time.process_time() - a if opt is not None else 0.0)
        return out

    def one() -> float:
        a = time.process_time()
        whole.step()
        return time.process_time() - a

    for _ in range(warmup):
        layered(), one()
    t = np.median(np.array([layered() for _ in range(repeats)]), axis=0)
    call = statistics.median(one() for _ in range(repeats))
    params = np.array([sum(p.numel() for p in ps) for ps in layers], dtype=float)
    c = optimizer_call_s(params, t)
    priced = c + float((t[t > 0] - c).sum())
    return {"layers": int((t > 0).sum()), "per_layer_sum_s": float(t.sum()), "call_fixed_s": c,
            "priced_s": priced, "measured_one_call_s": call}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert-tiny", "bert-small", "bert-base"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "optimizer_call.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"command": "python bench/optimizer_call.py --models " + " ".join(a.models),
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "models": {}}
    print(f"{'model':<11} {'layers':>6} {'per-layer sum ms':>16} {'fixed ms':>9} {'priced ms':>10} "
          f"{'one call ms':>12} {'sum err':>8} {'priced err':>10}")
    for name in a.models:
        r = res["models"][name] = measure(name)
        m = r["measured_one_call_s"]
        print(f"{name:<11} {r['layers']:>6} {r['per_layer_sum_s'] * 1e3:>16.3f} {r['call_fixed_s'] * 1e3:>9.3f} "
              f"{r['priced_s'] * 1e3:>10.3f} {m * 1e3:>12.3f} {r['per_layer_sum_s'] / m - 1:>+8.1%} "
              f"{r['priced_s'] / m - 1:>+10.1%}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
