"""gloo on this machine: point-to-point and all-reduce time against message size, fitted to latency + bytes/bandwidth.

The numbers behind the ``cpu:N`` cluster preset (``planner/cluster.py``). Two processes (fork), one
torch thread each, loopback TCP; per size the median of ``--repeats`` timed repeats after warm-up.

- p2p: a ping-pong (rank 0 sends, rank 1 sends the same size back); one-way time = round trip / 2,
  measured the way the pipeline sends (``dist.isend``/``dist.irecv`` + ``wait``, as
  ``torch.distributed.pipelining`` batches them).
- all-reduce: ``dist.all_reduce`` of a float32 tensor over both ranks.
- gradient all-reduce as the runtime does it (``ElasticRuntime._allreduce_grads``): the bytes split
  over 16 gradient tensors, flattened into one buffer (``torch.cat``), all-reduced, divided by the
  width and copied back -- what a data-parallel step really pays.

A least-squares line t = a + bytes / bw over the sizes gives the latency a and bandwidth bw.

    python bench/comm_bench.py [--repeats 20] [--out bench/results/comm_bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

SIZES = (4, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _worker(rank: int, world: int, port: int, repeats: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {"p2p": {}, "allreduce": {}, "grad_allreduce": {}}
    for nbytes in SIZES:
        t = torch.zeros(max(nbytes // 4, 1))
        times = []
        for r in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.isend(t, 1).wait()
                dist.irecv(t, 1).wait()
            else:
                dist.irecv(t, 0).wait()
                dist.isend(t, 0).wait()
            if r >= 3:
                times.append((time.perf_counter() - t0) / 2)
        out["p2p"][nbytes] = statistics.median(times)
        times = []
        for r in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if r >= 3:
                times.append(time.perf_counter() - t0)
        out["allreduce"][nbytes] = statistics.median(times)
        grads = list(torch.zeros(max(nbytes // 4, 16)).chunk(16))
        times = []
        for r in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world)
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
            if r >= 3:
                times.append(time.perf_counter() - t0)
        out["grad_allreduce"][nbytes] = statistics.median(times)
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def fit(points: dict[int, float]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the least-squares line seconds = latency + bytes / bandwidth."""
    x = np.array(list(points), dtype=float)
    y = np.array(list(points.values()), dtype=float)
    slope, icpt = np.polyfit(x, y, 1)
    return max(float(icpt), 0.0), 1.0 / slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default="bench/results/comm_bench.json")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, args.port, args.repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(60)
    print(f"{'bytes':>10} {'p2p one-way ms':>15} {'all-reduce ms':>14} {'grad all-reduce ms':>19}")
    for n in SIZES:
        print(f"{n:>10} {1e3 * res['p2p'][n]:>15.3f} {1e3 * res['allreduce'][n]:>14.3f} "
              f"{1e3 * res['grad_allreduce'][n]:>19.3f}")
    fits = {k: fit(v) for k, v in res.items()}
    for k, (lat, bw) in fits.items():
        print(f"{k}: latency {lat * 1e6:.0f} us, bandwidth {bw / 1e9:.2f} GB/s")
    lat_ar, bw_ar = fits["grad_allreduce"]
    # the cluster's ring model for n=2: 2(n-1)/n * bytes/bw + 2(n-1) * lat = bytes/bw + 2 lat
    print(f"gradient all-reduce as the ring model's link (n=2): latency {lat_ar / 2 * 1e6:.0f} us, "
          f"bandwidth {bw_ar / 1e9:.2f} GB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": platform.node(), "cpus": os.cpu_count(), "repeats": args.repeats,
        "p2p_one_way_s": res["p2p"], "allreduce_s": res["allreduce"],
        "fit": {k: {"latency_s": lat, "bandwidth_Bps": bw} for k, (lat, bw) in fits.items()},
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
