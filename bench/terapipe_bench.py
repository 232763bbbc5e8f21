"""TeraPipe token slicing on the measured GPT-2 slice model: planning time at the issue's size, the chosen slices,
and the predicted iteration time with and without token slicing for batch sizes 1-32.

Legend: L tokens per sequence, K pipeline stages, g slice granularity (tokens), b samples per micro-batch,
M micro-batches.

The slice cost is MEASURED: profiles/gpt2_cpu_fp32_slices.json holds a GPT-2 block (hidden 768) timed on
this CPU on a (b, s, c) grid (b 1, 2; s 64, 256, 1024, 2048; c 0, 512, 1024; one thread, CPU time) and
the fit t = const + per_token·b·s + per_context·b·c + per_pair·b·s·c + per_square·b·s² (coefficients
>= 0, relative errors) of its forward and backward (``python -m ptplan.executor.profiling.slices``). Batch
sizes above 2 and contexts beyond 1024 extrapolate the fit (linear in b).

1. Planning time of ``planner.terapipe.optimal_slices`` for L = 2048, K = 48 (one measured GPT-2 block per
   stage: a 48-block GPT-2-width model) at g = 32, 16, 8 (median of ``--repeats``), beside TeraPipe's own DP
   kernel on this machine: 81.6 s (the figure in issue 16; not re-run here).
2. The same 48-stage pipeline, b = 1..32 in one micro-batch: TeraPipe's objective T = Σ t + (K−1)·max t for no
   slicing, the best uniform slicing and the optimal slices (g = 8).
3. The real 12-block GPT-2 at its own longest sequence, L3 = 1024 tokens, projected for TeraPipe's GPU (V100,
   fp16; ``ptplan profile gpt2 --project v100 --dtype fp16 --seq-len 1024 --slices``, built here in seconds:
   the stage model prices a profile's layers at the length they were profiled at, and the shipped CPU profile
   is at 128) on one p3.16xlarge, K = 4 and 8 stages: the simulated iteration (planner.terapipe.sliced_phase:
   the terapipe schedule in the discrete-event simulator) without slicing and with the chosen slices, for
   b = 1..32 in one micro-batch (M = 1), and the best over M (b split into M micro-batches) with and without
   slicing; "-" where no M fits the GPU's memory.

4. ``--measure PROFILE``: the executor for real. PROFILE is a gpt2-tiny profile with slices measured at
   the sequence length L it was profiled with (``ptplan profile gpt2-tiny --seq-len 1024 --batch-sizes 1,2
   --slices --timer cpu``); two forked processes (gloo, one thread each) run executor/runtime/sliced.py's loop on
   K = 2 stages, M = 1, unsliced and with the planner's slices, and the median step (after one warm-up)
   is set beside ``sliced_phase``'s prediction (compute only: no optimizer, gloo sends not priced).

    python bench/terapipe_bench.py [--repeats 3] [--out bench/results/terapipe_bench.json]
           [--measure /tmp/g2t1024.json --steps 4]

Without ``--measure``, an existing ``--out`` keeps its part 4 (and the command that measured it).
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

from ptplan.planner.cluster import Cluster
from ptplan.planner.profile import load_profile
from ptplan.planner.terapipe import optimal_slices, profile_slice_cost, sliced_phase, uniform_slices

L, K = 2048, 48
PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "gpt2_cpu_fp32_slices.json"
BATCHES = (1, 2, 4, 8, 16, 32)
L3, K3, DEVICE3, LIKE3 = 1024, (4, 8), "v100", "p3.16xlarge"


def projected_gpt2(seq_len: int, device: str):
    """GPT-2 projected for ``device`` in fp16 at ``seq_len``, with its token-slice costs (``ptplan profile gpt2
    --project DEVICE --dtype fp16 --seq-len SEQ_LEN --slices``, in process)."""
    try:
        import torch
    except ImportError:
        raise SystemExit("part 3 projects GPT-2 and needs torch: pip install torch==2.13.0 -e '.[executor]'") from None

    from ptplan.executor.families import build_model
    from ptplan.executor.profiling.profiler import powers_of_two
    from ptplan.executor.profiling.project import project_profile
    from ptplan.executor.profiling.slices import project_slices, with_slices
    from ptplan.planner.devices import get_device

    command = f"ptplan profile gpt2 --project {device} --dtype fp16 --seq-len {seq_len} --slices"
    model = build_model("gpt2", seq_len=seq_len, dtype=torch.float16, layers=[])
    dev = get_device(device)
    prof = project_profile(model, dev, batch_sizes=powers_of_two(64), command=command)
    return with_slices(prof, project_slices(model, dev, command=command, date=prof.device.date))


def _shown(slices) -> str:
    return f"{len(slices)}: " + ",".join(map(str, slices[:5])) + (",…," + str(slices[-1]) if len(slices) > 5 else "")


def _measure_worker(rank: int, world: int, L: int, b: int, slices: list[int], ranges: list[list[int]], steps: int,
                    out: str) -> None:
    import torch
    import torch.distributed as dist

    from ptplan.executor.families import build_model
    from ptplan.executor.runtime.sliced import SlicedStage, run_sliced_step
    from ptplan.planner.schedule import terapipe

    model = build_model("gpt2-tiny", seq_len=L, dropout=0.0, seed=0)
    model.train()
    x, y, m = model.make_batch(b, generator=torch.Generator().manual_seed(0))
    lo, hi = ranges[rank]
    sched = terapipe(2, 1, len(slices))
    times = []
    for _ in range(steps + 1):
        stage = SlicedStage(model.layers[lo:hi], first=rank == 0, last=rank == 1)
        dist.barrier()
        t0 = time.perf_counter()
        run_sliced_step(sched, stage, position=rank, ranks=[0, 1], slices=slices, inputs=[x] if rank == 0 else None,
                        labels=[y] if rank == 1 else None, hidden=model.config.hidden_size, attention_mask=[m])
        dist.barrier()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    if rank == 0:
        Path(out).write_text(json.dumps(times[1:]))


def measure(path: str, steps: int) -> list[dict]:
    """Part 4 (module docstring)."""
    from ptplan.executor.launch.local import run_world

    prof = load_profile(path)
    L = prof.model.seq_len
    rows = []
    print(f"\n4. measured: gpt2-tiny, L={L}, K=2, M=1, 2 processes (load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores)")
    print(f"{'b':>3} {'slices':>24} {'predicted s':>12} {'measured s':>11} {'error':>7}")
    for b in (1, 2):
        ph = sliced_phase(prof, L=L, K=2, M=1, b=b, granularity=32)
        for slices, pred in (((L,), ph.unsliced_s), (ph.slices, ph.iteration_s)):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "times.json")
                res = run_world(2, _measure_worker, (L, b, list(slices), [list(r) for r in ph.ranges], steps, out),
                                tmpdir=tmp, timeout_s=120, deadline_s=600)
                assert res.ok, res.explain()
                times = json.loads(Path(out).read_text())
            med = statistics.median(times)
            rows.append({"b": b, "slices": list(slices), "predicted_s": pred, "measured_s": times, "median_s": med,
                         "load_average": os.getloadavg()[0]})
            print(f"{b:>3} {_shown(slices):>24} {pred:>12.3f} {med:>11.3f} {100 * (pred - med) / med:>+6.1f}%")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "bench" / "results"
                                         / "terapipe_bench.json"))
    ap.add_argument("--measure", default=None, metavar="PROFILE", help="part 4: a gpt2-tiny profile with slices")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    prof = load_profile(PROFILE)
    sp = prof.token_slices
    assert sp is not None
    cost = profile_slice_cost(prof, b=1)
    print(f"slice model: {PROFILE.name}, {len(sp.points)} points measured on {sp.device} ({sp.date}), fit median error "
          f"forward {100 * sp.forward.fit_error:.1f} %, backward {100 * sp.backward.fit_error:.1f} %")
    timing = []
    print(f"\n1. planning time, L={L}, K={K} (TeraPipe's own DP here: 81.6 s, issue 16)")
    for g in (32, 16, 8):
        secs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = optimal_slices(cost, L, K, granularity=g)
            secs.append(time.perf_counter() - t0)
        timing.append({"granularity": g, "median_s": statistics.median(secs), "min_s": min(secs),
                       "candidates": res.candidates, "slices": list(res.slices)})
        print(f"  g={g:>2}: {statistics.median(secs):7.3f} s (min {min(secs):.3f}), {res.candidates} bounds "
              f"evaluated, slices {_shown(res.slices)}")

    rows = []
    print(f"\n2. {K} stages of one GPT-2 block, L={L}, M=1: TeraPipe's objective (s)")
    print(f"{'b':>3} {'no slicing':>11} {'best uniform':>13} {'n':>4} {'optimal':>9} {'gain':>6}  slices")
    for b in BATCHES:
        c = profile_slice_cost(prof, b=b)
        one = uniform_slices(c, L, K, 1)
        uni = min((uniform_slices(c, L, K, n) for n in (2, 4, 8, 16, 32, 64, 128)), key=lambda s: s.latency_s)
        opt = optimal_slices(c, L, K, granularity=8)
        rows.append({"b": b, "unsliced_s": one.latency_s, "uniform_s": uni.latency_s, "uniform_n": len(uni.slices),
                     "optimal_s": opt.latency_s, "slices": list(opt.slices)})
        print(f"{b:>3} {one.latency_s:>11.2f} {uni.latency_s:>13.2f} {len(uni.slices):>4} {opt.latency_s:>9.2f} "
              f"{one.latency_s / opt.latency_s:>5.2f}x  {_shown(opt.slices)}")

    phases = []
    t0 = time.perf_counter()
    gpt2 = projected_gpt2(L3, DEVICE3)
    print(f"\n3. GPT-2 (12 blocks) projected for {DEVICE3} fp16 at L={L3} ({time.perf_counter() - t0:.1f} s), one "
          f"{LIKE3}")
    cluster = Cluster.uniform(nodes=1, like=LIKE3)
    for k in K3:
        print(f"K={k}: simulated iteration (ms)")
        print(f"{'b':>3} {'M=1 unsliced':>13} {'M=1 sliced':>11} {'gain':>6} {'best M unsliced':>16} "
              f"{'best M sliced':>14} {'gain':>6}  slices (best sliced)")
        for b in BATCHES:
            t0 = time.perf_counter()
            cands = [sliced_phase(gpt2, K=k, M=m, b=b // m, granularity=32, cluster=cluster)
                     for m in BATCHES if b % m == 0]
            one, fit = cands[0], [c for c in cands if c.fits]
            secs = time.perf_counter() - t0
            row = {"K": k, "b": b, "m1_unsliced_s": one.unsliced_s, "m1_sliced_s": one.iteration_s,
                   "m1_slices": list(one.slices), "m1_fits": one.fits, "ranges": [list(r) for r in one.ranges],
                   "planning_s": secs}
            if not fit:
                phases.append(row)
                print(f"{b:>3} {'-':>13} {'-':>11} {'':>6} {'-':>16} {'-':>14}  (no M fits the memory)")
                continue
            best_off = min(fit, key=lambda p: p.unsliced_s)
            best_on = min(fit, key=lambda p: p.iteration_s)
            row.update({"best_unsliced_s": best_off.unsliced_s, "best_unsliced_M": best_off.M,
                        "best_sliced_s": best_on.iteration_s, "best_sliced_M": best_on.M,
                        "best_slices": list(best_on.slices)})
            phases.append(row)
            m1 = (f"{1e3 * one.unsliced_s:>13.1f} {1e3 * one.iteration_s:>11.1f} "
                  f"{one.unsliced_s / one.iteration_s:>5.2f}x") if one.fits else f"{'-':>13} {'-':>11} {'':>6}"
            print(f"{b:>3} {m1} {1e3 * best_off.unsliced_s:>11.1f} M={best_off.M:<3} {1e3 * best_on.iteration_s:>9.1f} "
                  f"M={best_on.M:<3} {best_off.unsliced_s / best_on.iteration_s:>5.2f}x  {_shown(best_on.slices)}")
    measured, measured_command = [], None  # part 4, and the command that measured it (None: not measured)
    if args.measure:
        measured, measured_command = measure(args.measure, args.steps), " ".join(["python"] + sys.argv)
    elif Path(args.out).exists():  # part 4 not re-run: --out keeps the part 4 it holds
        old = json.loads(Path(args.out).read_text())
        measured = old.get("measured", [])
        measured_command = old.get("measured_command", old.get("command")) if measured else None
    Path(args.out).write_text(json.dumps({
        "command": " ".join(["python"] + sys.argv), "L": L, "K": K, "profile": PROFILE.name,
        "gpt2_phases_setting": {"L": L3, "K": list(K3), "device": DEVICE3, "dtype": "float16", "cluster": LIKE3,
                                "profile": gpt2.provenance.command},
        "slice_fit": {"forward": sp.forward.__dict__, "backward": sp.backward.__dict__, "device": sp.device,
                      "date": sp.date},
        "timing": timing, "block_pipeline": rows, "gpt2_phases": phases, "measured": measured,
        "measured_command": measured_command}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
