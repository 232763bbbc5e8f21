"""Transition benchmark: elastic phase changes of a BERT-base-sized model on 4 CPU processes (gloo).

Runs the same freeze trajectory (PipeTransformer's geometric α = 1/3 for 12 blocks: 0, 4, 7, 9
frozen blocks) twice per process count, in one invocation:

- **elastic**: 4 processes K=4,D=1 -> K=2,D=2 -> K=2,D=2 -> K=1,D=4 (2 processes: K=2,D=1 -> K=1,D=2),
  moving weights and AdamW state at each change;
- **static**: K=4 (or 2), D=1 throughout (frozen layers run under no_grad on stage 0, no re-partitioning).

With 4 processes on a 2-core machine the ranks share cores, so a pipeline bubble does not waste a
core (another rank uses it) and data parallelism only adds all-reduce work: the elastic run cannot
win there. The 2-process run (one process per core) is the fair CPU analogue of one GPU per rank.

Reports each transition's seconds by part (target < 2 s; PipeTransformer's took 9-41 s) and the
measured speedup of the elastic run over the static one (total wall time of the same steps,
transitions included). Stage partitions balance a FLOP proxy (parameters of each layer; the
embedding's lookup counts as nothing; stage 0 also pays a third of the frozen prefix's cost for
its no-grad forward) with an optimal contiguous split. Prints a table and writes
JSON (default bench/results/transition_bench.json).

    python bench/transition_bench.py [--seq 32] [--batch 8] [--steps-per-phase 3] [--procs 4,2]

CPU timings on a shared 2-core box are noisy: 4 processes share 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import SyntheticDataset
from ptplan.executor.families import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.training.loop import run_training
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.validate import frozen_boundary
from ptplan.planner.partition import optimal_partition

TRAJECTORY = (0, 4, 7, 9)
# frozen blocks -> (K, D) of the elastic run, per number of processes
ELASTIC = {4: {0: (4, 1), 4: (2, 2), 7: (2, 2), 9: (1, 4)},
           2: {0: (2, 1), 4: (1, 2), 7: (1, 2), 9: (1, 2)}}


def layer_costs(model) -> list[float]:
    return [0.0 if s.kind == "embedding" else float(sum(p.numel() for p in layer.parameters()))
            for layer, s in zip(model.layers, model.specs)]


def balanced(costs: list[float], lo: int, K: int, prefix: float = 0.0) -> tuple[tuple[int, int], ...]:
    """AutoPipe's optimal split of layers [lo, n) into K stages; stage 0 also pays ``prefix``."""
    return optimal_partition(costs[lo:], K, stage0_extra_s=prefix).shifted(lo)


def build_plan(model, batch: int, layout: dict[int, tuple[int, int]], schedule: str):
    costs = layer_costs(model)
    specs = []
    for f in TRAJECTORY:
        K, D = layout[f]
        M = max(K, 1) if schedule == "1f1b" else max(K, 2)
        while batch % (D * M):
            M += 1
        lo = frozen_boundary(model, f)
        prefix = sum(costs[:lo]) / 3  # a forward is about a third of forward + backward
        specs.append(spec(f, K=K, D=D, M=M, b=batch // (D * M), partition=balanced(costs, lo, K, prefix)))
    return make_plan(model, specs, trajectory=list(TRAJECTORY), schedule=schedule)


def run(name: str, model, plan, args, tmp: str) -> list[dict]:
    log = os.path.join(tmp, f"{name}-{plan.world_size}.jsonl")
    steps = args.steps_per_phase * len(TRAJECTORY)
    cfg = RunConfig(plan="(bench)", model=model.name, optimizer="adamw", lr=1e-4, freeze_every=args.steps_per_phase,
                    steps_per_epoch=steps, epochs=1, progress=False, timeout_s=600, log=log, dropout=0.0)
    data = SyntheticDataset(model, steps * args.batch, seed=0)

    def worker(rank: int, world: int) -> None:
        # Each process builds its own model, as under torchrun (a forked copy would pay copy-on-write
        # page faults on the first write to every page, which a real launch does not).
        own = build_model(model.name, seq_len=model.seq_len, dropout=0.0, seed=0)
        run_training(cfg, plan, own, data)

    t0 = time.perf_counter()
    res = run_world(plan.world_size, worker, tmpdir=tmp, timeout_s=600, deadline_s=3000)
    wall = time.perf_counter() - t0
    if not res.ok:
        raise SystemExit(f"{name} run failed:\n{res.explain()}")
    recs = read_records(log)
    recs.append({"type": "wall", "seconds": wall})
    return recs


def summarise(recs: list[dict]) -> dict:
    steps = [r for r in recs if r["type"] == "step"]
    trans = [r for r in recs if r["type"] == "transition"]
    by_phase: dict[int, list[float]] = {}
    for r in steps:
        by_phase.setdefault(r["frozen_blocks"], []).append(r["seconds"])
    steady = {f: sorted(v[1:] or v)[len(v[1:] or v) // 2] for f, v in by_phase.items()}  # median w/o first
    ar: dict[int, list[float]] = {}
    for r in steps:
        ar.setdefault(r["frozen_blocks"], []).append(r.get("allreduce_seconds", 0.0))
    allreduce = {f: sorted(v[1:] or v)[len(v[1:] or v) // 2] for f, v in ar.items()}
    return {"train_seconds": sum(r["seconds"] for r in steps), "transition_seconds": sum(t["seconds"] for t in trans),
            "total_seconds": sum(r["seconds"] for r in steps) + sum(t["seconds"] for t in trans),
            "steady_step_seconds": steady, "steady_allreduce_seconds": allreduce, "transitions": trans,
            "wall_seconds": next(r["seconds"] for r in recs if r["type"] == "wall")}


def report(args, model, procs: int, el: dict, st: dict) -> dict:
    params = sum(p.numel() for p in model.parameters())
    speedup = st["total_seconds"] / el["total_seconds"]
    print(f"\n{args.model}: {params / 1e6:.1f} M parameters, seq {args.seq}, global batch {args.batch}, "
          f"{args.schedule}, AdamW, {procs} CPU processes (gloo), {args.steps_per_phase} steps per phase")
    hdr = f"{'transition':<26} {'total s':>8} {'weights':>8} {'optim':>8} {'groups':>8} {'rebuild':>8} {'MB sent':>8}"
    print(hdr)
    print("-" * len(hdr))
    for t in el["transitions"]:
        a, b = t["from"], t["to"]
        label = f"f{a['frozen_blocks']} K{a['K']}D{a['D']} -> f{b['frozen_blocks']} K{b['K']}D{b['D']}"
        p = t["parts"]
        mb = (t["bytes"]["weights"] + t["bytes"]["optimizer_state"]) / 2**20
        print(f"{label:<26} {t['seconds']:>8.3f} {p['weights']:>8.3f} {p['optimizer_state']:>8.3f} "
              f"{p['groups']:>8.3f} {p['rebuild']:>8.3f} {mb:>8.1f}")
    print("(parts: each the slowest rank's, so they need not add up to the total; MB: sent by all ranks together)")
    print(f"\n{'frozen':>6} {'elastic K,D':>11} {'elastic s/step':>14} {'of it all-reduce':>16} "
          f"{f'static K={procs} s/step':>16}")
    for f in TRAJECTORY:
        K, D = ELASTIC[procs][f]
        print(f"{f:>6} {f'{K},{D}':>11} {el['steady_step_seconds'][f]:>14.3f} {el['steady_allreduce_seconds'][f]:>16.3f} "
              f"{st['steady_step_seconds'][f]:>16.3f}")
    print(f"elastic: {el['total_seconds']:.2f} s (steps {el['train_seconds']:.2f} + transitions "
          f"{el['transition_seconds']:.2f}); static K={procs},D=1: {st['total_seconds']:.2f} s; "
          f"measured speedup {speedup:.2f}x")
    return {"processes": procs, "elastic_layout": {str(f): list(v) for f, v in ELASTIC[procs].items()},
            "elastic": el, "static": st, "speedup": speedup}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="global batch (samples)")
    ap.add_argument("--steps-per-phase", type=int, default=3)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--procs", default="4,2", help="process counts to run, from {4, 2}")
    ap.add_argument("--out", default="bench/results/transition_bench.json")
    args = ap.parse_args()

    torch.set_num_threads(1)
    model = build_model(args.model, seq_len=args.seq, dropout=0.0, seed=0)
    results = []
    for procs in [int(x) for x in args.procs.split(",")]:
        elastic = build_plan(model, args.batch, ELASTIC[procs], args.schedule)
        static = build_plan(model, args.batch, {f: (procs, 1) for f in TRAJECTORY}, args.schedule)
        with tempfile.TemporaryDirectory() as tmp:
            el = summarise(run("elastic", model, elastic, args, tmp))
            st = summarise(run("static", model, static, args, tmp))
        results.append(report(args, model, procs, el, st))
    print(f"\n{os.cpu_count()} CPU cores, shared with other work: timings are noisy.")
    out = {"benchmark": "transition_bench", "model": args.model,
           "parameters": sum(p.numel() for p in model.parameters()), "seq_len": args.seq,
           "global_batch": args.batch, "schedule": args.schedule, "optimizer": "adamw",
           "steps_per_phase": args.steps_per_phase, "trajectory": list(TRAJECTORY), "runs": results,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
           "date": time.strftime("%Y-%m-%d")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
