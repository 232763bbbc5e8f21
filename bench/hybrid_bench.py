"""Hybrid parallelism (issue 14): predicted throughput of the hybrid plan against pipeline x DP and plain FSDP.

Legend: f frozen blocks; K pipeline length, D data-parallel width, tp tensor-parallel width (inside a
node), M micro-batches of b samples; strategy ``tp2·fsdp·rc`` = tp 2, FSDP (ZeRO-3) over the D
replicas, activation recomputation.

Per phase (f frozen blocks), three predictions of the planner's own model (``search.PhaseSearch``: the
one stage model, the exact split and the simulator), samples/s at the same global batch:

- ``hybrid``: the search with ``strategies="auto"`` (K, M, schedule, cache, tp, FSDP, recomputation);
- ``pp x dp``: the search with ``strategies="off"`` (today's planner: pipeline x plain data parallel);
- ``fsdp``: plain FSDP, K = 1, tp = 1, every GPU a replica, the best M (no recomputation).

"-" where nothing fits in memory. Cases: the shipped projected ``gpt2_h100_bf16`` and
``bert-large_h100_bf16`` profiles on one DGX H100 (8 GPUs), and a synthetic GPT of 48 blocks of
hidden 8192 (``synthetic.synthetic_profile``, bf16, 39.5 B parameters) on 64, 256 and 1,024 H100s. The
AutoCache is off in every search (``cache="off"``), so stage 0 holds and recomputes the frozen prefix:
with 47 of 48 blocks frozen the prefix's 76.6 GB of bf16 weights no longer fit next to the rest
without tp or FSDP, which is why ``pp x dp`` finds nothing there.

    python bench/hybrid_bench.py [--out bench/results/hybrid_bench.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.errors import InfeasibleError
from ptplan.planner.profile import load_profile
from ptplan.planner.search import Choice, PhaseSearch, Visit, _order
from ptplan.planner.synthetic import synthetic_profile

ROOT = Path(__file__).resolve().parents[1]


def plain_fsdp(s: PhaseSearch, f: int, visit: Visit) -> Choice | None:
    """The best K = 1, tp = 1, FSDP candidate (no recomputation) for f frozen blocks."""
    n0 = s.p.frozen_boundary(f)
    cands, _, _ = s.candidates(f, n0, free=True, cache=False)
    best = None
    for c in cands:
        if c.K == 1 and c.tp == 1 and c.fsdp and not c.recompute:
            got = s.evaluate(c, n0, visit)
            if isinstance(got, Choice) and (best is None or _order(got) < _order(best)):
                best = got
    return best


def describe(ch: Choice | None) -> dict | None:
    if ch is None:
        return None
    c = ch.cand
    return {"K": c.K, "D": c.D, "M": c.M, "b": c.b, "schedule": c.schedule, "cache": c.cache,
            "strategy": ch.label, "samples_per_s": c.B / ch.sim.iteration_s,
            "peak_gib": max(m.total for m in ch.memory) / 2**30}


def case(name: str, prof, cluster: Cluster, batch: int, frozen: list[int]) -> dict:
    cfg = TrainingConfig(epochs=10, samples_per_epoch=100 * batch, batch=batch, allow_extrapolation=True,
                         cache="off")
    hyb, off = PhaseSearch(prof, cluster, cfg, strategies="auto"), PhaseSearch(prof, cluster, cfg)
    visit = Visit(samples=float(cfg.samples_per_epoch))
    rows = []
    t0 = time.perf_counter()
    for f in frozen:
        got = {}
        for key, fn in (("hybrid", lambda: hyb.search(f, visit)), ("pp x dp", lambda: off.search(f, visit)),
                        ("fsdp", lambda: plain_fsdp(hyb, f, visit))):
            try:
                got[key] = describe(fn())
            except InfeasibleError:
                got[key] = None
        rows.append({"frozen": f, **got})
    return {"case": name, "cluster": cluster.name, "gpus": cluster.world_size, "batch": batch,
            "params": float(sum(r.params for r in prof.layers)), "search_s": time.perf_counter() - t0, "rows": rows}


def show(res: dict) -> None:
    print(f"\n{res['case']} on {res['cluster']} ({res['gpus']} GPUs, {res['params'] / 1e9:.2f} B parameters, "
          f"global batch {res['batch']}; searched in {res['search_s']:.1f} s)")
    print(f"{'f':>3}  {'hybrid samples/s':>16} {'plan':<56} {'pp x dp':>10} {'plan':<16} {'fsdp':>10}  {'hyb/ppdp':>8} "
          f"{'hyb/fsdp':>8}")
    for r in res["rows"]:
        h, p, z = r["hybrid"], r["pp x dp"], r["fsdp"]

        def sps(x):
            return f"{x['samples_per_s']:>10.1f}" if x else f"{'-':>10}"

        def plan(x, w):
            return (f"K{x['K']} D{x['D']} M{x['M']} {x['strategy']}" if x else "-")[:w].ljust(w)

        ratio = (lambda a, b: f"{a['samples_per_s'] / b['samples_per_s']:>8.2f}" if a and b else f"{'-':>8}")
        print(f"{r['frozen']:>3}  {sps(h):>16} {plan(h, 56)} {sps(p)} {plan(p, 16)} {sps(z)}  {ratio(h, p)} {ratio(h, z)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hybrid_bench.json"))
    args = ap.parse_args()
    dgx = get_preset("dgx-h100")
    results = []
    for name, batch in (("gpt2_h100_bf16", 256), ("bert-large_h100_bf16", 256)):
        prof = load_profile(ROOT / "profiles" / f"{name}.json")
        results.append(case(name, prof, dgx, batch, [0, 3, 6, 9, prof.num_blocks - 1]))
    big = synthetic_profile(num_blocks=48, hidden=8192, seq_len=2048, vocab=50257, dtype_bytes=2,
                            flops_per_s=400e12, batch_sizes=(1, 2, 4, 8), name="synthetic-gpt-48x8192")
    for nodes, batch in ((8, 512), (32, 2048), (128, 8192)):
        results.append(case("synthetic-gpt-48x8192", big, Cluster.uniform(nodes=nodes, like="dgx-h100"), batch,
                            [0, 12, 24, 36, 47]))
    for r in results:
        show(r)
    Path(args.out).write_text(json.dumps({"command": "python bench/hybrid_bench.py", "results": results}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
