"""Each schedule's peak memory, measured against the stage model, with and without recomputation.

bert-tiny (halves, 8 tokens, dropout 0), one pipeline of K = 2 positions on 2 forked gloo processes (one thread
each), M micro-batches of 1 sample (16; GPipe with recomputation 64, where the held outputs show), AdamW, no
freezing: every schedule the executor runs whole micro-batches with (V = 2 where it takes chunks), each with
recomputation off, on (the whole stage) and of each stage's first layer only (Galvatron's layer-wise choice); and
every schedule but 2BW (which refuses it) with every stage FSDP-sharded over D = 2 replicas (4 processes, ``fsdp``
rows). The sampled step's measured peak per rank (``executor/runtime/memory.StepMemory``:
stage tensors + live saved-for-backward storages + the backward's working set, the 4-byte AdamW step counters
left out as the stage model leaves them out) against the simulator's rank peak from the stage model
(``StageModel.stage_costs`` on the run's own profile, ``simulate``'s ``rank_peak_memory_bytes``). Error =
predicted / measured - 1: positive is the safe side. About 3 minutes.

    python bench/schedule_memory.py [--out bench/results/schedule_memory.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("2bw", 1), ("interleaved-1f1b", 2), ("looped-bfs", 2), ("zb-v", 2)]
SEQ, K = 8, 2


def measure(schedule: str, V: int, recompute: bool, tmp: str, layers: int = 0, fsdp: bool = False) -> list[dict]:
    """One case: per rank, (measured, predicted) bytes; ``layers``: each stage recomputes only its first ``layers``;
    ``fsdp``: every stage sharded over D = 2 replicas."""
    import torch

    from ptplan.executor.data.dataset import TensorDataset
    from ptplan.executor.families.models import build_model
    from ptplan.executor.handplan import make_plan, spec
    from ptplan.executor.launch.local import run_world
    from ptplan.executor.profiling.profiler import profile_model
    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.training.loop import run_training
    from ptplan.executor.training.runlog import read_records
    from ptplan.planner.cluster import cpu_cluster
    from ptplan.planner.costs import CostTable
    from ptplan.planner.schedule import build_schedule, peak_inflight, peak_stashed, stage_to_rank
    from ptplan.planner.simulate import simulate
    from ptplan.planner.stage import PhaseShape, StageModel, links_for

    M = 64 if schedule == "gpipe" and recompute else 16
    steps = 5 if schedule == "2bw" else 2  # 2BW's memory is sampled at its 4th step
    model = build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0)
    D = 2 if fsdp else 1
    plan = make_plan(model, [spec(0, K=K, D=D, M=M, b=1, schedule=schedule, V=V)], samples_per_epoch=D * M * steps)
    plan = dataclasses.replace(plan, phases=tuple(dataclasses.replace(
        p, recompute=recompute, recompute_layers=(layers,) * len(p.partition), fsdp=fsdp) for p in plan.phases))
    log = os.path.join(tmp, "run.jsonl")
    cfg = RunConfig(plan="(bench)", model="bert-tiny", optimizer="adamw", lr=1e-3, seed=0, progress=False,
                    steps_per_epoch=steps, epochs=1, timeout_s=60, log=log)
    data = TensorDataset(*model.make_batch(D * M * steps, generator=torch.Generator().manual_seed(1)))

    def worker(rank: int, world: int) -> None:
        torch.set_num_threads(1)
        run_training(cfg, plan, model, data)

    res = run_world(K * D, worker, tmpdir=tmp, timeout_s=60, deadline_s=300)
    if not res.ok:
        raise SystemExit(res.explain())
    (rec,) = [r for r in read_records(log) if r["type"] == "step" and r.get("memory_sampled")]
    table = CostTable(profile_model(build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0),
                                    device="cpu", batch_sizes=(1, 2), warmup=0, repeats=1, progress=False))
    ph = plan.phases[0]
    twobw = schedule == "2bw"
    shape = PhaseShape(K=K, M=M, b=1, D=D, frozen=0, cache=False, V=V, inflight=peak_inflight(schedule, K, M, V),
                       stashed=peak_stashed(schedule, K, M, V), optimizer="adamw", device_is_host=True,
                       weight_versions=2 if twobw else 1, own_p2p=twobw, recompute=recompute, recompute_layers=layers,
                       stage_ranks=stage_to_rank(schedule, K, V), fsdp=fsdp)
    costs = StageModel(table, shape, links_for(cpu_cluster(K * D), K, stage_to_rank(schedule, K, V))).stage_costs(
        ph.partition)
    predicted = simulate(build_schedule(schedule, K, M, V), costs).rank_peak_memory_bytes
    rows, s2r = [], stage_to_rank(schedule, K, V)
    for rank, got in enumerate(rec["memory"]["per_rank"]):
        pos = next(row.index(rank) for row in ph.ranks if rank in row)
        want = predicted[pos]
        own = [i for c, (lo, hi) in enumerate(ph.partition) if s2r[c] == pos for i in range(lo, hi)]
        measured = got["total"] - 4 * sum(1 for i in own for _ in model.layers[i].parameters())
        rows.append({"schedule": schedule, "V": V, "recompute": recompute, "recompute_layers": layers, "M": M,
                     "fsdp": fsdp, "D": D, "rank": rank,
                     "measured_bytes": measured, "predicted_bytes": int(want), "error": int(want) / measured - 1})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "schedule_memory.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT.parent))
    rows = []
    print(f"{'schedule':<18}{'V':>2} {'rc':<4}{'M':>3} {'rank':>4} {'measured B':>12} {'predicted B':>12} {'error':>8}")
    for schedule, V in CASES:
        for recompute, layers, fsdp in ((False, 0, False), (True, 0, False), (True, 1, False), (False, 0, True)):
            if fsdp and schedule == "2bw":
                continue  # 2BW refuses FSDP (strategy.runtime_refusal)
            with tempfile.TemporaryDirectory() as tmp:
                for r in measure(schedule, V, recompute, tmp, layers, fsdp):
                    rows.append(r)
                    rc = "fsdp" if fsdp else f"rc{layers}" if layers else "on" if recompute else "off"
                    print(f"{schedule:<18}{V:>2} {rc:<4}{r['M']:>3} {r['rank']:>4} "
                          f"{r['measured_bytes']:>12,} {r['predicted_bytes']:>12,} {r['error']:>+8.2%}", flush=True)
    Path(args.out).write_text(json.dumps({"command": "python bench/schedule_memory.py", "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
