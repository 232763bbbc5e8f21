"""Realistic Plan objects for tests (a ViT-B/16-like model on the paper's cluster, and a 1024-GPU one).

Until the planner exists these stand in for ``ptplan plan``'s output. The numbers are plausible, not
measured: a toy cost model per layer, an optimal contiguous partition, and a small discrete-event
simulation of GPipe / 1F1B for pipeline 0 that emits the same typed events the planner will.
"""
from __future__ import annotations

import json

from ptplan.planner.partition import optimal_partition
from ptplan.planner.plan import (Baseline, Phase, Plan, Prediction, TimelineEvent, TrajectoryPoint,
                                 plan_from_json)

GIB = 1 << 30
MB = 1 << 20

# Per-sample costs of one ViT-B/16 layer (fp32, 197 tokens) on an RTX-5000-class GPU.
# kind -> (params, forward seconds per sample, saved-for-backward bytes per sample)
_VIT_LAYER = {
    "embedding": (0.74e6, 0.05e-3, 2 * MB),
    "attention": (2.36e6, 0.11e-3, 14 * MB),
    "mlp": (4.72e6, 0.16e-3, 9 * MB),
    "block": (7.08e6, 0.27e-3, 23 * MB),
    "norm": (1.5e3, 0.005e-3, MB // 2),
    "head": (0.08e6, 0.002e-3, 8 * 1024),
}
_BOUNDARY_BYTES_PER_SAMPLE = 197 * 768 * 4
_WORKSPACE = GIB // 2


def vit_layers(num_blocks: int = 12, granularity: str = "half") -> list[str]:
    """Layer kinds in execution order: embedding, blocks or halves, norm, head."""
    mid = ["attention", "mlp"] * num_blocks if granularity == "half" else ["block"] * num_blocks
    return ["embedding", *mid, "norm", "head"]


def frozen_boundary(num_blocks: int, granularity: str, f: int) -> int:
    """Index of the first active layer with f frozen blocks (the embedding freezes with block 0)."""
    per = 2 if granularity == "half" else 1
    return 0 if f == 0 else 1 + per * f


def _partition(costs: list[float], lo: int, K: int) -> tuple[tuple[int, int], ...]:
    """Optimal contiguous partition of layers [lo, len(costs)) into K stages (minimise the slowest)."""
    return optimal_partition(costs[lo:], K).shifted(lo)


def _schedule(kind: str, K: int, M: int, s: int) -> list[tuple[str, int]]:
    """The per-rank action list of stage s: GPipe (all forwards, then all backwards) or 1F1B."""
    if kind == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warm = min(K - 1 - s, M)
    ops = [("F", m) for m in range(warm)]
    for i in range(M - warm):
        ops += [("F", warm + i), ("B", i)]
    ops += [("B", m) for m in range(M - warm, M)]
    return ops


def simulate(*, schedule: str, K: int, M: int, fwd: list[float], bwd: list[float], prefix_s: float,
             cache: bool, comm_s: float, allreduce_s: list[float]) -> tuple[list[TimelineEvent], float, float, float]:
    """Event simulation of one iteration of pipeline 0; returns (events, iteration_s, bubble, exposed all-reduce)."""
    ops = [_schedule(schedule, K, M, s) for s in range(K)]
    ptr, free = [0] * K, [0.0] * K
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    link_f, link_b = [0.0] * K, [0.0] * K
    events: list[TimelineEvent] = []

    def ev(s: int, kind: str, mb: int, a: float, b: float) -> None:
        events.append(TimelineEvent(rank=s, stage=s, kind=kind, mb=mb, start=a, end=b))

    def send(s: int, to: int, kind: str, m: int, t: float, link: list[float]) -> float:
        a = max(t, link[min(s, to)])
        link[min(s, to)] = a + comm_s
        ev(s, "SEND_" + kind, m, a, a + comm_s)
        ev(to, "RECV_" + kind, m, a, a + comm_s)
        return a + comm_s

    arrive_f: dict[tuple[int, int], float] = {}
    arrive_b: dict[tuple[int, int], float] = {}
    busy = 0.0
    while any(ptr[s] < len(ops[s]) for s in range(K)):
        progressed = False
        for s in range(K):
            while ptr[s] < len(ops[s]):
                kind, m = ops[s][ptr[s]]
                if kind == "F":
                    if s > 0 and (s, m) not in arrive_f:
                        break
                    t = max(free[s], arrive_f.get((s, m), 0.0))
                    if s == 0 and prefix_s > 0:
                        ev(0, "CACHE" if cache else "PREFIX", m, t, t + prefix_s)
                        t += prefix_s
                        busy += prefix_s
                    ev(s, "F", m, t, t + fwd[s])
                    f_end[(s, m)] = free[s] = t + fwd[s]
                    busy += fwd[s]
                    if s < K - 1:
                        arrive_f[(s + 1, m)] = send(s, s + 1, "F", m, free[s], link_f)
                else:
                    if (s, m) not in f_end or (s < K - 1 and (s, m) not in arrive_b):
                        break
                    t = max(free[s], arrive_b.get((s, m), 0.0))
                    ev(s, "B", m, t, t + bwd[s])
                    b_end[(s, m)] = free[s] = t + bwd[s]
                    busy += bwd[s]
                    if s > 0:
                        arrive_b[(s - 1, m)] = send(s, s - 1, "B", m, free[s], link_b)
                ptr[s] += 1
                progressed = True
        assert progressed, "schedule deadlocked"
    pipe_end = max(e.end for e in events)
    end = pipe_end
    for s in range(K):
        if allreduce_s[s] > 0:
            ev(s, "ALLREDUCE", -1, free[s], free[s] + allreduce_s[s])
            end = max(end, free[s] + allreduce_s[s])
    events.sort(key=lambda e: (e.rank, e.start, e.kind))
    bubble = max(0.0, 1.0 - busy / (K * pipe_end))
    return events, end, bubble, end - pipe_end


def _phase(*, kinds: list[str], granularity: str, num_blocks: int, f: int, K: int, world: int, gpus_per_node: int,
           global_batch: int, micro_batch: int, schedule: str, cache: bool, intra_bw: float, inter_bw: float,
           timeline: bool = True) -> Phase:
    D = world // K
    M = global_batch // (D * micro_batch)
    lo = frozen_boundary(num_blocks, granularity, f)
    costs = [_VIT_LAYER[k][1] * 3 for k in kinds]  # forward + backward
    partition = _partition(costs, lo, K)
    fwd = [sum(_VIT_LAYER[kinds[i]][1] for i in range(a, b)) * micro_batch for a, b in partition]
    bwd = [2 * x for x in fwd]
    prefix_fwd = sum(_VIT_LAYER[kinds[i]][1] for i in range(lo)) * 0.9 * micro_batch
    prefix_s = (0.02 * prefix_fwd if cache else prefix_fwd) if lo else 0.0
    comm_s = _BOUNDARY_BYTES_PER_SAMPLE * micro_batch / intra_bw
    params = [sum(_VIT_LAYER[kinds[i]][0] for i in range(a, b)) for a, b in partition]
    spans_nodes = K * D > gpus_per_node
    bw = inter_bw if spans_nodes else intra_bw
    allreduce = [2 * (D - 1) / D * p * 4 / bw if D > 1 else 0.0 for p in params]
    events, it_s, bubble, ar_s = simulate(schedule=schedule, K=K, M=M, fwd=fwd, bwd=bwd, prefix_s=prefix_s,
                                         cache=cache, comm_s=comm_s, allreduce_s=allreduce)
    frozen_params = sum(_VIT_LAYER[kinds[i]][0] for i in range(lo))
    mem = []
    for s, (a, b) in enumerate(partition):
        in_flight = M if schedule == "gpipe" else min(K - s, M)
        act = sum(_VIT_LAYER[kinds[i]][2] for i in range(a, b)) * micro_batch * in_flight
        weights = params[s] * 16 + (frozen_params * 4 if s == 0 else 0)
        mem.append(int(weights + act + _WORKSPACE))
    compute = [(fwd[s] + bwd[s]) * M + (prefix_s * M if s == 0 else 0.0) for s in range(K)]
    pred = Prediction(iteration_s=it_s, samples_per_s=global_batch / it_s, bubble_fraction=bubble,
                      allreduce_s=ar_s, stage_compute_s=tuple(compute), stage_peak_memory_bytes=tuple(mem),
                      cache_host_bytes=(_BOUNDARY_BYTES_PER_SAMPLE * 50_000 if cache else 0))
    ranks = tuple(tuple(p * K + s for s in range(K)) for p in range(D))
    return Phase(frozen_blocks=f, frozen_layers=lo, K=K, D=D, M=M, micro_batch_size=micro_batch,
                 schedule=schedule, partition=partition, cache=cache, ranks=ranks, predicted=pred,
                 timeline=tuple(events) if timeline else ())


def make_plan(*, model: str = "vit-base-patch16", num_blocks: int = 12, granularity: str = "half",
              nodes: int = 2, gpus_per_node: int = 8, gpu_memory_bytes: int = 16 * GIB,
              gpu_name: str = "Quadro RTX 5000", cluster_name: str = "paper",
              intra_bw: float = 15.75e9, inter_bw: float = 5e9,
              frozen_per_epoch: tuple[int, ...] = (0, 4, 7, 9, 10, 11, 11, 12, 12, 12), alpha: float = 1 / 3,
              k_for: dict[int, int] | None = None, global_batch: int = 512, micro_batch: int = 32,
              samples_per_epoch: int = 50_000, schedule: str = "1f1b", timeline: bool = True,
              transition_s: float = 3.0) -> Plan:
    """A plan with one phase per frozen-block count reached, K shrinking as blocks freeze."""
    kinds = vit_layers(num_blocks, granularity)
    world = nodes * gpus_per_node
    counts = sorted(set(frozen_per_epoch))
    if k_for is None:
        k_for = {f: (8 if f == 0 else 4 if f <= 7 else 2 if f <= 10 else 1) for f in counts}
    common = dict(kinds=kinds, granularity=granularity, num_blocks=num_blocks, world=world,
                  gpus_per_node=gpus_per_node, global_batch=global_batch, micro_batch=micro_batch,
                  schedule=schedule, intra_bw=intra_bw, inter_bw=inter_bw, timeline=timeline)
    phases = tuple(_phase(f=f, K=k_for[f], cache=f >= 7, **common) for f in counts)
    base = _phase(f=0, K=k_for[counts[0]], cache=False, **common)
    iters = samples_per_epoch // global_batch
    traj, prev = [], None
    for e, f in enumerate(frozen_per_epoch):
        pi = counts.index(f)
        secs = iters * phases[pi].predicted.iteration_s + (transition_s if prev not in (None, pi) else 0.0)
        traj.append(TrajectoryPoint(epoch=e, frozen_blocks=f, phase=pi, iterations=iters, seconds=secs))
        prev = pi
    total = sum(t.seconds for t in traj)
    base_s = len(frozen_per_epoch) * iters * base.predicted.iteration_s
    inputs = {
        "profile": {"model": model, "family": "vit", "num_blocks": num_blocks, "num_layers": len(kinds),
                    "granularity": granularity, "seq_len": 197, "dtype": "float32",
                    "device": "NVIDIA GeForce RTX 3090", "device_kind": "cuda", "fingerprint": "3f9a1c07be52d4e1"},
        "cluster": {"name": cluster_name, "nodes": nodes, "gpus_per_node": gpus_per_node,
                    "gpu_memory_bytes": gpu_memory_bytes, "gpu_name": gpu_name,
                    "intra_node_bandwidth": intra_bw, "inter_node_bandwidth": inter_bw,
                    "intra_node_latency": 5e-6, "inter_node_latency": 2e-5},
        "training": {"epochs": len(frozen_per_epoch), "samples_per_epoch": samples_per_epoch,
                     "global_batch": global_batch, "batch_policy": "constant-global", "schedule": schedule,
                     "optimizer": "adamw"},
        "freeze": {"policy": "geometric", "alpha": alpha},
    }
    plan = Plan(inputs=inputs, phases=phases, trajectory=tuple(traj),
                totals={"seconds": total, "samples": float(samples_per_epoch * len(frozen_per_epoch)),
                        "speedup": base_s / total},
                baseline=Baseline(phase=base, seconds=base_s))
    return roundtrip(plan)


def roundtrip(plan: Plan) -> Plan:
    """Validate through the JSON contract (as ``load_plan`` would) and return the reloaded plan."""
    return plan_from_json(json.loads(json.dumps(plan.to_json())), source="fixture plan")


def vit_paper_plan() -> Plan:
    """ViT-B/16, half granularity (27 layers), 2 nodes x 8 x 16 GB, alpha = 1/3 over 10 epochs, 1F1B."""
    return make_plan()


def vit_paper_plan_gpipe() -> Plan:
    """Same as ``vit_paper_plan`` with the GPipe schedule."""
    return make_plan(schedule="gpipe")


def plan_without_timeline() -> Plan:
    """A plan whose phases carry no timeline events."""
    return make_plan(timeline=False)


def large_plan(nodes: int = 128) -> Plan:
    """1024 GPUs (128 nodes x 8 H100 80 GB): D from 128 to 1024."""
    return make_plan(nodes=nodes, gpus_per_node=8, gpu_memory_bytes=80 * GIB, gpu_name="NVIDIA H100 80GB HBM3",
                     cluster_name="h100x128", intra_bw=450e9, inter_bw=50e9,
                     global_batch=16 * 1024 * 8, micro_batch=16, samples_per_epoch=1_281_167)


def single_phase_plan() -> Plan:
    """One phase only (nothing ever freezes), on a single 2-GPU node."""
    return make_plan(nodes=1, gpus_per_node=2, frozen_per_epoch=(0, 0, 0), k_for={0: 2}, cluster_name="cpu-box",
                     global_batch=64, micro_batch=8)
