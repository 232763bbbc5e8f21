"""The step interpreter against torch's pipelining runtime on the same action lists: step time on CPU (gloo).

Legend: K = 2 positions (two processes, one core each), V chunks per position, M micro-batches of b samples.

For each schedule (GPipe, 1F1B, ZB-H1, interleaved 1F1B with V = 2), the layers of ``--model`` are cut into
K·V equal chunks and one step runs the planner's lists (``planner.schedule.build_schedule``) two ways, on the
same modules and batch: ``executor.runtime.step.StepInterpreter`` (what the executor runs) and torch's
``_PipelineScheduleRuntime`` fed the same lists in torch's IR (``actions.torch_actions``; what the executor ran
before the interpreter). Rounds alternate interpreter, torch, interpreter, torch ..., so load on the box hits
both alike; the first ``--warmup`` steps of each are left out; the table gives the median seconds per step and
the ratio. The gradients of the two are compared once (max relative difference).

    python bench/step_bench.py [--model bert-tiny] [--seq 64] [--b 4] [--M 4] [--steps 10] [--out ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]


class _Chunk(torch.nn.Module):
    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask)
        return x


def _worker(rank: int, world: int, args: argparse.Namespace, name: str, V: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from ptplan.executor.families.models import build_model
    from ptplan.executor.runtime.actions import torch_actions
    from ptplan.executor.runtime.step import ChunkCompute, StepInterpreter
    from ptplan.planner.schedule import build_schedule

    model = build_model(args.model, seq_len=args.seq, granularity="half", dropout=0.0, seed=0)
    sched = build_schedule(name, world, args.M, V)
    S = sched.K
    n = len(model.layers)
    cuts = [round(i * n / S) for i in range(S + 1)]
    mine = {c: _Chunk(list(model.layers[cuts[c]:cuts[c + 1]])) for c in range(S) if sched.stage_to_rank[c] == rank}
    x, y, m = model.make_batch(args.b * args.M, generator=torch.Generator().manual_seed(0))
    kw = {} if m is None else {"attention_mask": m}
    first, last = 0 in mine, S - 1 in mine
    group = dist.group.WORLD
    ours = StepInterpreter(sched, rank, ChunkCompute(mine, model.loss, M=args.M, last=S - 1), group=group,
                           device=torch.device("cpu"))
    stages = [PipelineStage(mod, c, S, torch.device("cpu"), group=group) for c, mod in sorted(mine.items())]
    theirs = _PipelineScheduleRuntime(stages, n_microbatches=args.M, loss_fn=model.loss, scale_grads=True)
    theirs._prepare_schedule_with_comms(torch_actions(sched), format="compute_comms")

    def zero() -> None:
        for mod in mine.values():
            mod.zero_grad(set_to_none=True)

    def run_ours() -> None:
        ours.run(x if first else None, y if last else None, kw)

    def run_theirs() -> None:
        ends = {"target": y, "losses": []} if last else {}
        theirs.step(*((x,) if first else ()), return_outputs=False, **ends, **kw)

    times: dict[str, list[float]] = {"interpreter": [], "torch": []}
    grads: dict[str, list[torch.Tensor]] = {}
    for i in range(args.warmup + args.steps):
        for label, fn in (("interpreter", run_ours), ("torch", run_theirs)):
            zero()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if i >= args.warmup:
                times[label].append(time.perf_counter() - t0)
            if i == 0:
                grads[label] = [p.grad.clone() for mod in mine.values() for p in mod.parameters() if p.grad is not None]
    diff = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
               for a, b in zip(grads["interpreter"], grads["torch"]))
    torch.save({"times": times, "diff": diff}, os.path.join(out, f"{name}-{rank}.pt"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bert-tiny")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--M", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_bench.json"))
    args = ap.parse_args()
    from ptplan.executor.launch.local import run_world

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, V in SCHEDULES:
            res = run_world(2, _worker, (args, name, V, tmp), tmpdir=tmp, timeout_s=120, deadline_s=600)
            if not res.ok:
                print(res.explain(), file=sys.stderr)
                return 1
            got = [torch.load(os.path.join(tmp, f"{name}-{r}.pt")) for r in range(2)]
            med = {k: statistics.median(max(g["times"][k][i] for g in got) for i in range(args.steps))
                   for k in ("interpreter", "torch")}
            rows.append({"schedule": name, "V": V, "interpreter_s": med["interpreter"], "torch_s": med["torch"],
                         "ratio": med["interpreter"] / med["torch"], "grad_rel_diff": max(g["diff"] for g in got)})
    print(f"{args.model}, seq {args.seq}, K=2, M={args.M}, b={args.b}, median of {args.steps} steps "
          f"(torch {torch.__version__}, {os.cpu_count()} cores)")
    print(f"{'schedule':<18}{'V':>3}{'interpreter s':>15}{'torch s':>10}{'ratio':>8}{'grad diff':>11}")
    for r in rows:
        print(f"{r['schedule']:<18}{r['V']:>3}{r['interpreter_s']:>15.4f}{r['torch_s']:>10.4f}{r['ratio']:>8.2f}"
              f"{r['grad_rel_diff']:>11.1e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
