"""Framework overheads of the runtime on this machine: per pipelined action and per training step.

The ``cpu:N`` preset's ``action_overhead_s`` and ``step_overhead_s`` (``planner/cluster.py``) come
from here, measured apart from any model's compute:

- **action overhead**: two processes (fork, gloo, one thread each) run a 1F1B schedule (K=2) with the
  executor's own step interpreter (``executor/runtime/step.py``: ``StepInterpreter`` and ``ChunkCompute``,
  what every training step runs) over a module with next to no compute (a 16x16 linear layer, one sample per
  micro-batch) for M = 2..32 micro-batches, and measure each rank's CPU time per step
  (``time.process_time``: the host work, not the waiting). A least-squares line
  cpu(M) = a + 2M * o over M gives o, the CPU seconds per forward or backward action (each rank runs
  one F and one B per micro-batch), averaged over both ranks. (The wall time of this zero-compute
  pipeline is a chain of round trips -- about 2(o + latency) per micro-batch -- and is printed too.)
- **step overhead**: one process runs the real training loop (``run_training``, K=1, M=1) on
  ``bert-tiny`` at sequence length 8 and, in the same process before and after it, times the same
  model's whole forward + backward and AdamW step directly; the runtime's extra per step (clearing
  gradients, the loss all-reduce, the data batch, bookkeeping) is the difference of the two fastest
  steps (minimums: this machine's speed drifts by 10-20 % over seconds, and the drift only adds).

- **concurrency slowdown**: a compute-bound training step with transformer-sized work (four
  ``torch.nn.TransformerEncoderLayer``s, width 256, 8 x 128 tokens, AdamW; not one of the calibration
  models) runs in one process alone and in N processes at once (one per core, every step started
  together), alternating, ``--rounds`` times; the median over steps of the slowest process's step,
  against the lone process's median step, is the factor a synchronous step of N ranks pays on a CPU
  whose cores share caches and memory bandwidth and whose speed jitters from step to step and core
  to core (the step waits for the slowest rank).

    python bench/overhead_bench.py [--repeats 30] [--rounds 6] [--out bench/results/overhead_bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


MS = (2, 4, 8, 16, 32)
WIDTH = 16


def _pipeline_worker(rank: int, world: int, repeats: int, out_path: str) -> None:
    import torch.distributed as dist

    from ptplan.executor.runtime.step import ChunkCompute, StepInterpreter
    from ptplan.planner.schedule import build_schedule

    torch.manual_seed(0)
    mod = torch.nn.Linear(WIDTH, WIDTH)
    res = {}
    for M in MS:
        compute = ChunkCompute({rank: mod}, lambda y, t: (y - t).pow(2).mean(), M=M, last=1)
        step = StepInterpreter(build_schedule("1f1b", 2, M, 1), rank, compute, group=dist.group.WORLD,
                               device=torch.device("cpu"))
        x, target = torch.randn(M, WIDTH), torch.zeros(M, WIDTH)
        times, cpu = [], []
        for r in range(repeats + 3):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step.run(x if rank == 0 else None, target if rank == 1 else None, {})
            mod.zero_grad(set_to_none=True)
            if r >= 3:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        res[M] = {"wall_s": statistics.median(times), "cpu_s": statistics.median(cpu)}
    Path(f"{out_path}.{rank}").write_text(json.dumps(res))


def _fit_action(per_rank: list[dict[int, dict[str, float]]]) -> tuple[float, float]:
    """(o, a): CPU seconds per action and per step, least squares of cpu(M) = a + 2M * o, averaged over ranks."""
    fits = [np.polyfit([2 * M for M in MS], [r[M]["cpu_s"] for M in MS], 1) for r in per_rank]
    return float(np.mean([f[0] for f in fits])), float(np.mean([f[1] for f in fits]))


def _step_overhead(repeats: int, tmp: str) -> dict[str, float]:
    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.data.dataset import SyntheticDataset
    from ptplan.executor.families import build_model
    from ptplan.executor.training.runlog import read_records
    from ptplan.executor.handplan import make_plan, spec
    from ptplan.executor.launch.local import run_world
    from ptplan.executor.training.loop import run_training

    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    b = 4
    x, y, mask = model.make_batch(b, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    direct = []

    def time_direct() -> None:
        for r in range(repeats + 3):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model.loss(model(x, attention_mask=mask), y).backward()
            opt.step()
            if r >= 3:
                direct.append(time.perf_counter() - t0)

    time_direct()
    plan = make_plan(model, [spec(0, K=1, D=1, M=1, b=b)])
    log = os.path.join(tmp, "step.jsonl")
    cfg = RunConfig(plan="(bench)", model=model.name, optimizer="adamw", lr=1e-3, steps_per_epoch=repeats + 3,
                    epochs=1, progress=False, timeout_s=60, log=log, dropout=0.0)  # the direct loop's AdamW
    ds = SyntheticDataset(model, (repeats + 3) * b)

    def worker(rank: int, world: int) -> None:
        run_training(cfg, plan, model, ds)

    res = run_world(1, worker, tmpdir=tmp, timeout_s=60, deadline_s=300)
    if not res.ok:
        raise SystemExit(res.explain())
    runtime = [r["seconds"] for r in read_records(log) if r["type"] == "step" and not r.get("memory_sampled")][3:]
    time_direct()
    return {"direct_s": min(direct), "runtime_s": min(runtime), "direct_median_s": statistics.median(direct),
            "runtime_median_s": statistics.median(runtime)}


def _corun_worker(steps: int, barrier, q) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True) for _ in range(4)])
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-4)
    x = torch.randn(8, 128, 256)
    times = []
    for r in range(steps + 2):
        barrier.wait()  # every step starts together, as synchronous ranks do
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        layers(x).pow(2).mean().backward()
        opt.step()
        if r >= 2:
            times.append(time.perf_counter() - t0)
    q.put(times)


def _concurrency(procs: int, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per round: the median step of one process alone, and the median over steps of the slowest of
    ``procs`` processes that start every step together."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out: dict[str, list[float]] = {"alone": [], "slowest_of_n": []}
    for _ in range(rounds):
        for n, key in ((1, "alone"), (procs, "slowest_of_n")):
            q, barrier = ctx.Queue(), ctx.Barrier(n)
            ps = [ctx.Process(target=_corun_worker, args=(steps, barrier, q)) for _ in range(n)]
            for p in ps:
                p.start()
            res = [q.get(timeout=300) for _ in ps]
            for p in ps:
                p.join()
            out[key].append(statistics.median(max(step) for step in zip(*res)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=6, help="Alternations of one and N concurrent processes.")
    ap.add_argument("--out", default="bench/results/overhead_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from ptplan.executor.launch.local import run_world

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pipe.json")
        res = run_world(2, _pipeline_worker, (args.repeats, path), tmpdir=tmp, timeout_s=60, deadline_s=300)
        if not res.ok:
            raise SystemExit(res.explain())
        pipe = [{int(k): v for k, v in json.loads(Path(f"{path}.{r}").read_text()).items()} for r in range(2)]
        step = _step_overhead(args.repeats, tmp)
    o, c = _fit_action(pipe)
    print("1F1B, K=2, ~zero compute, per step:")
    for M in MS:
        print(f"  M={M:>2}: wall {1e3 * pipe[0][M]['wall_s']:7.2f} ms; CPU rank 0 {1e3 * pipe[0][M]['cpu_s']:6.2f} ms, "
              f"rank 1 {1e3 * pipe[1][M]['cpu_s']:6.2f} ms")
    print(f"fit: action_overhead_s = {o * 1e6:.0f} us of CPU per F or B ({c * 1e3:.2f} ms per step besides)")
    co = _concurrency(os.cpu_count() or 1, args.rounds, 12)
    slow = statistics.median(co["slowest_of_n"]) / statistics.median(co["alone"])
    print(f"concurrency: one process alone {1e3 * statistics.median(co['alone']):.1f} ms per step, slowest of "
          f"{os.cpu_count()} at once {1e3 * statistics.median(co['slowest_of_n']):.1f} ms -> concurrency_slowdown = "
          f"{slow:.3f} (rounds: {', '.join(f'{b / a:.2f}' for a, b in zip(co['alone'], co['slowest_of_n']))})")
    so = max(step["runtime_s"] - step["direct_s"], 0.0)
    print(f"training loop, bert-tiny seq 8, K=1 M=1: fastest step {1e3 * step['runtime_s']:.2f} ms against "
          f"{1e3 * step['direct_s']:.2f} ms for forward+backward+AdamW alone -> step_overhead_s = {so * 1e6:.0f} us")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "overhead", "machine": platform.node(), "cpus": os.cpu_count(),
                               "torch": torch.__version__, "repeats": args.repeats,
                               "pipeline_step": pipe, "action_overhead_s": o, "schedule_cpu_per_step_s": c,
                               "training_step": step, "concurrency": co, "concurrency_slowdown": slow,
                               "step_overhead_s": so}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
