"""The one stage model (planner/stage.py): one formula for the partitioner, the search and the simulator."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.costs import CostTable
from ptplan.planner.errors import InfeasibleError, PtplanError
from ptplan.planner.partition import split_stages
from ptplan.planner.profile import Profile
from ptplan.planner.schedule import build_schedule, peak_inflight
from ptplan.planner.simulate import simulate
from ptplan.planner.stage import OPTIMIZER_STATE_FACTOR, PhaseShape, StageModel, links_for
from ptplan.planner.synthetic import synthetic_profile


def random_profile(rng: random.Random, blocks: int) -> Profile:
    """A small synthetic profile with every layer's times and bytes scaled at random (non-uniform layers)."""
    prof = synthetic_profile(num_blocks=blocks, hidden=rng.choice([64, 128]), seq_len=rng.choice([16, 32]),
                             vocab=rng.choice([256, 1024]), batch_sizes=(1, 2, 4, 8))
    layers = []
    for r in prof.layers:
        k = rng.uniform(0.2, 3.0)
        bwd = tuple(k * rng.uniform(1.5, 2.5) * x for x in r.forward_s)
        layers.append(replace(r, forward_s=tuple(k * x for x in r.forward_s), backward_s=bwd,
                              backward_weight_s=tuple(rng.uniform(0.2, 0.7) * x for x in bwd),
                              saved_bytes_per_sample=int(r.saved_bytes_per_sample * rng.uniform(0.5, 2)),
                              optimizer_s=rng.uniform(0, 1e-4)))
    return replace(prof, layers=tuple(layers))


def model_for(prof: Profile, cluster: Cluster, *, K: int, M: int, b: int, f: int, cache: bool = False,
              schedule: str = "1f1b", optimizer: str = "adamw", fill_from: int = 0,
              recompute: bool = False, tp: int = 1, sp: bool = False) -> StageModel:
    n0 = prof.frozen_boundary(f)
    shape = PhaseShape(K=K, M=M, b=b, D=cluster.world_size // (K * tp), frozen=n0, cache=cache, tp=tp, sp=sp,
                       inflight=peak_inflight(schedule, K, M), optimizer=optimizer,
                       weight_versions=2 if schedule == "2bw" else 1, recompute=recompute, own_p2p=schedule == "2bw",
                       device_is_host=cluster.device_is_host, action_overhead_s=cluster.action_overhead_s)
    return StageModel(CostTable(prof), shape, links_for(cluster, K), fill_from=fill_from)


def random_split(rng: random.Random, lo: int, hi: int, K: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(lo + 1, hi), K - 1))
    b = [lo, *cuts, hi]
    return list(zip(b[:-1], b[1:]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_closed_form_inflight_is_what_the_generated_schedule_holds(name):
    """The memory model uses peak_inflight before any schedule exists; the simulator counts the real lists."""
    for K, M in itertools.product(range(1, 9), range(1, 17)):
        if name == "1f1b" and M < K:
            continue
        sched = build_schedule(name, K, M)
        r = simulate(sched, [replace_cost() for _ in range(K)])
        assert r.peak_inflight == peak_inflight(name, K, M), (K, M)


def replace_cost():
    from ptplan.planner.simulate import StageCost

    return StageCost(forward_s=1.0, backward_s=2.0)


@pytest.mark.parametrize("seed", range(4))
def test_partitioner_search_and_simulator_see_one_stage_model(seed):
    """For random phases and splits: the partitioner's per-stage evaluation, the whole-split evaluation, the
    simulator's memory and the break-down's totals are the same numbers: the last two to the byte, also where
    tensor parallelism makes the terms fractional bytes and many micro-batches are in flight (the break-down's
    total once differed from the simulator's by up to one byte per micro-batch in flight: 118 bytes at GPipe's
    M = 128 with tp 4, which ``ptplan plan`` stopped on)."""
    rng = random.Random(seed)
    fractional = 0
    for _ in range(25):
        prof = random_profile(rng, rng.randint(2, 5))
        cluster = rng.choice([get_preset("paper"), Cluster.uniform(nodes=2, gpus_per_node=4), get_preset("cpu:4")])
        f = rng.randint(0, prof.num_blocks)
        n0 = prof.frozen_boundary(f)
        n_active = prof.num_layers - n0
        K = rng.choice([k for k in (1, 2, 4) if k <= n_active and cluster.world_size % k == 0])
        schedule = rng.choice(["gpipe", "1f1b"])
        M = rng.choice([m for m in (1, 2, 4, 8, 64, 128) if schedule == "gpipe" or m >= K])
        cache = f > 0 and rng.random() < 0.5
        tp = rng.choice([t for t in (1, 2, 4) if cluster.world_size % (K * t) == 0])
        m = model_for(prof, cluster, K=K, M=M, b=rng.choice([1, 2, 4]), f=f, cache=cache, schedule=schedule,
                      optimizer=rng.choice(["adamw", "sgd"]), tp=tp, sp=tp > 1 and rng.random() < 0.5)
        ranges = random_split(rng, n0, prof.num_layers, K)
        lo, hi = np.array([r[0] for r in ranges]), np.array([r[1] for r in ranges])
        t_all, mem_all = m.evaluate_split(m.prepare(lo, hi))
        for s in range(K):
            t_s, mem_s = m.evaluate(s, m.prepare(lo, hi), slice(s, s + 1))
            assert t_s[0] == pytest.approx(t_all[s]) and mem_s[0] == pytest.approx(mem_all[s])
        costs = m.stage_costs(ranges)
        sim = simulate(build_schedule(schedule, K, M), costs)
        breakdown = m.stage_memory(ranges)
        assert tuple(x.total for x in breakdown) == sim.stage_peak_memory_bytes
        # the model's fractional bytes, each term truncated to whole bytes: at most one per micro-batch in flight and
        # one for each of the two other terms
        assert [x.total for x in breakdown] == pytest.approx(list(mem_all), abs=max(m.shape.inflight) + 2)
        fractional += any(float(x) != int(x) for x in mem_all)
        for x in breakdown:  # each term whole bytes of its own: where they are fractional (tp > 1) each of the
            # six terms and the total's three drop under a byte, the total's activations up to one per micro-batch
            parts = x.weights + x.gradients + x.optimizer + x.buffers + max(x.activations, x.transient)
            assert x.total == parts if tp == 1 else abs(x.total - parts) <= x.inflight + 9
        # busy = forward + backward + both sends (+ the prefix or the cache read on stage 0)
        for s, c in enumerate(costs):
            extra = c.prefix_s + c.setup_s / M
            assert t_all[s] == pytest.approx(c.forward_s + c.backward_s + c.send_forward_s + c.send_backward_s + extra)
    assert fractional >= 3


def test_what_each_stage_holds():
    prof = synthetic_profile(num_blocks=6, hidden=128, seq_len=32)
    t = CostTable(prof)
    f = 3
    n0 = prof.frozen_boundary(f)
    gpu = Cluster.uniform(nodes=1, gpus_per_node=4)
    ranges = [(n0, n0 + 3), (n0 + 3, prof.num_layers)]
    plain = model_for(prof, gpu, K=2, M=4, b=2, f=f).stage_memory(ranges)
    cached = model_for(prof, gpu, K=2, M=4, b=2, f=f, cache=True).stage_memory(ranges)
    w0 = float(t.cum_param[n0 + 3] - t.cum_param[n0])
    prefix = float(t.cum_param[n0])
    assert plain[0].weights == int(w0 + prefix)  # recomputing: the frozen weights sit on stage 0
    assert cached[0].weights == int(w0)  # cached: they stay in host memory
    assert cached[0].buffers - plain[0].buffers == int(4 * 2 * t.out_per_sample[n0 - 1])  # the shard's rows
    assert plain[1].weights == cached[1].weights  # other stages do not care
    boundary = 2 * t.out_per_sample[n0 + 2]
    assert plain[0].buffers == int(4 * boundary) and plain[1].buffers == int(4 * boundary)  # M receive buffers
    assert plain[0].inflight == 2 and plain[1].inflight == 1  # 1F1B on K=2
    # D > 1: the flat all-reduce buffer; AdamW on a GPU: its foreach temporary (one weight-sized buffer)
    assert plain[1].transient == max(plain[1].gradients, plain[1].weights)
    one = model_for(prof, Cluster.uniform(nodes=1, gpus_per_node=2), K=2, M=4, b=2, f=f).stage_memory(ranges)
    assert one[1].transient == one[1].weights  # D = 1: no all-reduce buffer, the optimizer temporary remains
    cpu = model_for(prof, get_preset("cpu:2"), K=2, M=4, b=2, f=f).stage_memory(ranges)
    assert cpu[1].transient == 0  # CPU torch steps tensor by tensor; D = 1
    sgd = model_for(prof, gpu, K=2, M=4, b=2, f=f, optimizer="sgd").stage_memory(ranges)
    assert sgd[1].optimizer * OPTIMIZER_STATE_FACTOR["adamw"] == plain[1].optimizer * OPTIMIZER_STATE_FACTOR["sgd"]


def test_fill_iterations_cost_more_and_refresh_from_a_cached_count_costs_less():
    prof = synthetic_profile(num_blocks=6, hidden=128, seq_len=32)
    f = 4
    n0 = prof.frozen_boundary(f)
    gpu = Cluster.uniform(nodes=1, gpus_per_node=4)
    ranges = [(n0, prof.num_layers)]
    full = model_for(prof, gpu, K=1, M=2, b=2, f=f, cache=True, fill_from=0).stage_costs(ranges, fill=True)
    part = model_for(prof, gpu, K=1, M=2, b=2, f=f, cache=True,
                     fill_from=prof.frozen_boundary(2)).stage_costs(ranges, fill=True)
    steady = model_for(prof, gpu, K=1, M=2, b=2, f=f, cache=True).stage_costs(ranges)
    assert full[0].setup_s > part[0].setup_s > steady[0].setup_s > 0


def test_bad_splits_are_refused():
    prof = synthetic_profile(num_blocks=2)
    m = model_for(prof, get_preset("cpu:2"), K=2, M=2, b=1, f=0)
    with pytest.raises(PtplanError, match="contiguous"):
        m.stage_costs([(0, 3), (4, prof.num_layers)])
    with pytest.raises(PtplanError, match="has no prefix"):
        model_for(prof, get_preset("cpu:2"), K=1, M=1, b=1, f=0, cache=True)


def brute(m: StageModel, K: int, limit: float):
    """Every split as (bottleneck, sum of squares, ranges) that fits ``limit``, by the model's own numbers."""
    out = []
    a, n = m.start, m.n
    for cuts in itertools.combinations(range(a + 1, n), K - 1):
        b = (a, *cuts, n)
        lo, hi = np.array(b[:-1]), np.array(b[1:])
        t, mem = m.evaluate_split(m.prepare(lo, hi))
        if mem.max() <= limit:
            out.append((float(t.max()), float((t * t).sum()), tuple(zip(b[:-1], b[1:]))))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_split_under_the_stage_models_memory_is_exact(seed):
    """The audit: three memory formulas missed feasible splits. The split is exact under the one model."""
    rng = random.Random(100 + seed)
    checked = 0
    for _ in range(40):
        prof = random_profile(rng, rng.randint(2, 4))
        cluster = rng.choice([Cluster.uniform(nodes=1, gpus_per_node=4), get_preset("cpu:4")])
        f = rng.randint(0, prof.num_blocks - 1)
        n_active = prof.num_layers - prof.frozen_boundary(f)
        K = rng.choice([k for k in (1, 2, 4) if k <= n_active])
        M = rng.choice([m for m in (4, 8) if m >= K])
        m = model_for(prof, cluster, K=K, M=M, b=rng.choice([1, 4]), f=f, cache=f > 0 and rng.random() < 0.5)
        splits_any = brute(m, K, float("inf"))
        peaks = sorted(
            float(m.evaluate_split(m.prepare(np.array([r[0] for r in sp[2]]), np.array([r[1] for r in sp[2]])))[1].max())
            for sp in splits_any)
        limit = rng.choice(peaks) * rng.choice([1.0, 0.999, 1.001])
        splits = brute(m, K, limit)
        if not splits:
            with pytest.raises(InfeasibleError):
                split_stages(m, K, limit)
            continue
        p = split_stages(m, K, limit)
        best = min(s[0] for s in splits)
        assert p.bottleneck == pytest.approx(best, rel=1e-12)
        assert max(p.stage_memory) <= limit * (1 + 1e-9)
        tied = [s for s in splits if s[0] <= best * (1 + 1e-12)]
        assert sum(c * c for c in p.stage_costs) == pytest.approx(min(s[1] for s in tied), rel=1e-9)
        checked += 1
    assert checked >= 20


def test_a_split_that_fits_only_by_each_stage_own_in_flight_count_is_found():
    """The audit's 6-9 GiB case: a conservative bound (the worst stage's in-flight count for every stage)
    refused a K=2 split that fits; the exact per-stage model finds it."""
    prof = synthetic_profile(num_blocks=8, hidden=1024, seq_len=512, batch_sizes=(1, 2, 4, 8))
    for gib in (6, 7, 8, 9):
        cluster = Cluster(name=f"{gib}g", nodes=1, gpus_per_node=2, gpu_memory_bytes=gib << 30, gpu_name="toy",
                          intra_bandwidth=1e10, intra_latency_s=1e-5, inter_bandwidth=1e10, inter_latency_s=1e-5)
        limit = 0.9 * cluster.gpu_memory_bytes
        for b in (1, 2, 4, 8):
            m = model_for(prof, cluster, K=2, M=8, b=b, f=0)
            conservative = replace(m.shape, inflight=(2, 2))
            cons = StageModel(m.t, conservative, m.links)
            try:
                split_stages(cons, 2, limit)
                continue
            except InfeasibleError:
                pass
            try:
                p = split_stages(m, 2, limit)
            except InfeasibleError:
                continue
            assert max(p.stage_memory) <= limit
            return
    pytest.fail("no 6-9 GiB case where only the exact per-stage memory fits")


# ---- PipeDream-2BW: two weight versions, with and without recomputation ----------------------------
def test_a_stage_of_r_layers_or_fewer_recomputing_its_first_r_is_priced_as_recomputing_them_all():
    """``recompute_layers`` r at least a stage's length: the runtime recomputes the whole stage
    (``stage_strategies`` gives it 0), so its time and memory are whole-stage recomputation's, term by term, in
    every schedule (before: its micro-batches in flight were priced without their outputs)."""
    prof = synthetic_profile(num_blocks=6, hidden=128, seq_len=32)
    gpu = Cluster.uniform(nodes=1, gpus_per_node=2)
    ranges = [(0, 5), (5, prof.num_layers)]  # 5 layers, then the rest
    for schedule, M in (("1f1b", 4), ("gpipe", 8)):
        whole = model_for(prof, gpu, K=2, M=M, b=2, f=0, schedule=schedule, recompute=True)
        r = replace(whole.shape, recompute_layers=prof.num_layers)
        first_r = StageModel(whole.t, r, whole.links)
        assert first_r.stage_strategies(ranges) == whole.stage_strategies(ranges)
        assert first_r.stage_memory(ranges) == whole.stage_memory(ranges), schedule
        assert first_r.stage_costs(ranges) == whole.stage_costs(ranges), schedule


def test_two_bw_memory_by_hand():
    """K=2, M=4, b=2, 3 frozen blocks, AdamW, one node of 2 GPUs (D=1): every term of every stage
    computed here from the profile's per-layer numbers, against the stage model."""
    prof = synthetic_profile(num_blocks=6, hidden=128, seq_len=32)
    t = CostTable(prof)
    f, K, M, b = 3, 2, 4, 2
    n0 = prof.frozen_boundary(f)
    gpu = Cluster.uniform(nodes=1, gpus_per_node=2)
    ranges = [(n0, n0 + 3), (n0 + 3, prof.num_layers)]
    L = prof.layers
    W = [sum(x.param_bytes for x in L[lo:hi]) for lo, hi in ranges]
    G = [sum(x.grad_bytes for x in L[lo:hi]) for lo, hi in ranges]
    saved = [sum(x.saved_bytes_per_sample for x in L[lo:hi]) for lo, hi in ranges]
    out = [L[hi - 1].output_bytes_per_sample for _, hi in ranges]
    a_in = [L[lo - 1].output_bytes_per_sample for lo, _ in ranges]  # stage 0's input: the frozen prefix's output
    prefix = sum(x.param_bytes for x in L[:n0])
    # 2BW's own loop: one gradient buffer on stage 0 (torch's runtime: M), no activation receive buffers on
    # stage 1; there each micro-batch in flight holds its received input until its backward
    buffers = [b * out[0], 0]
    gpu_temp = [W[0], W[1]]  # AdamW's foreach temporary on a GPU, D = 1: no all-reduce buffer
    for recompute in (False, True):
        one = model_for(prof, gpu, K=K, M=M, b=b, f=f, schedule="1f1b", recompute=recompute).stage_memory(ranges)
        two = model_for(prof, gpu, K=K, M=M, b=b, f=f, schedule="2bw", recompute=recompute).stage_memory(ranges)
        for s in range(K):
            held = K - s  # micro-batches in flight on stage s, 1F1B and 2BW alike
            full = b * (saved[s] + out[s])
            # with recomputation, each micro-batch in flight keeps its input and its output (held until its backward)
            acts = held * b * (a_in[s] + out[s]) + full if recompute else held * (full + (b * a_in[s] if s > 0 else 0))
            # 2 versions, 2 gradients (mini-batch t's, held for its update until t+2 starts, beside t+1's), AdamW
            static = 2 * W[s] + 2 * G[s] + 2 * W[s] + buffers[s] + (prefix if s == 0 else 0)
            # 2BW never drains: its update's temporaries live beside the micro-batches in flight (they add)
            want = static + acts + gpu_temp[s] if not recompute else \
                static + full + held * b * (a_in[s] + out[s]) + gpu_temp[s]
            x = two[s]
            assert (x.weights, x.gradients, x.optimizer, x.buffers) == (2 * W[s] + (prefix if s == 0 else 0), 2 * G[s],
                                                                          2 * W[s], buffers[s]), (recompute, s)
            assert (x.activations, x.inflight, x.transient) == (acts, held, gpu_temp[s]), (recompute, s)
            assert x.total == want, (recompute, s)
            assert x.total == x.weights + x.gradients + x.optimizer + x.buffers + x.activations + x.transient
            # only the active layers' weights count twice: 2BW holds one more copy of them (frozen: one)
            assert x.weights - one[s].weights == W[s]
            assert one[s].buffers == M * b * out[0]  # torch's runtime: M receive buffers each way


def test_two_bw_with_recomputation_is_the_papers_formula():
    """PipeDream-2BW's memory model, 2|W|/d + d·|A_input(b)| (Narayanan et al. 2021), for stage 0 of d = K
    uniform stages (no frozen layers, one block per stage): weights twice, and the stage's input for
    each of the K micro-batches in flight; the stage model adds what the paper leaves out (gradient,
    optimizer state, receive buffers, one micro-batch rebuilt for its backward, the update's temporaries, which
    2BW's steady state never drains before, and each micro-batch's output, which the runtime keeps until its
    backward) — checked term by term."""
    prof = synthetic_profile(num_blocks=8, hidden=64, seq_len=16)
    t = CostTable(prof)
    gpu = Cluster.uniform(nodes=1, gpus_per_node=4)
    K, M, b = 4, 8, 4
    blocks = [(lo, lo + 2) for lo in range(1, 1 + 2 * K, 2)]  # layer 0 embeds; then one block (2 halves) each
    ranges = [(0, blocks[0][1]), *blocks[1:-1], (blocks[-1][0], prof.num_layers)]
    m = model_for(prof, gpu, K=K, M=M, b=b, f=0, schedule="2bw", recompute=True)
    mem = m.stage_memory(ranges)
    costs = m.stage_costs(ranges)
    for s in (1, 2):  # the uniform middle stages: |W|/d = one block
        lo, hi = ranges[s]
        W_d = float(t.cum_param[hi] - t.cum_param[lo])
        A_in = b * float(t.out_per_sample[lo - 1])
        A_out = b * float(t.out_per_sample[hi - 1])
        full = b * float(t.cum_saved[hi] - t.cum_saved[lo] + t.out_per_sample[hi - 1])
        x = mem[s]
        paper = 2 * W_d + (K - s) * A_in
        assert x.inflight == K - s
        assert x.weights + x.activations - full - (K - s) * A_out == pytest.approx(paper)
        assert x.total == pytest.approx(paper + (K - s) * A_out + x.gradients + x.optimizer + x.buffers + full
                                        + x.transient)
        assert costs[s].activation_bytes_per_mb == int(A_in + A_out)
    # recomputation trades the backward's time for memory: the stage's forward runs again before it
    plain = model_for(prof, gpu, K=K, M=M, b=b, f=0, schedule="2bw").stage_costs(ranges)
    for a, c in zip(plain, costs):
        assert c.backward_s == pytest.approx(a.backward_s + a.forward_s - gpu.action_overhead_s * (K > 1))
        assert c.activation_bytes_per_mb < a.activation_bytes_per_mb


def test_two_bw_split_agrees_with_the_simulator():
    """The partitioner's evaluation, the break-down and the simulator's memory are one number for 2BW."""
    rng = random.Random(7)
    for _ in range(10):
        prof = random_profile(rng, rng.randint(3, 5))
        f = rng.randint(0, 2)
        n0 = prof.frozen_boundary(f)
        K = rng.choice([1, 2, 4])
        M = rng.choice([m for m in (4, 8) if m >= K])
        m = model_for(prof, get_preset("paper"), K=K, M=M, b=2, f=f, schedule="2bw", recompute=rng.random() < 0.5)
        ranges = random_split(rng, n0, prof.num_layers, K)
        lo, hi = np.array([r[0] for r in ranges]), np.array([r[1] for r in ranges])
        _, mem_all = m.evaluate_split(m.prepare(lo, hi))
        sim = simulate(build_schedule("2bw", K, M), m.stage_costs(ranges))
        breakdown = m.stage_memory(ranges)
        assert tuple(x.total for x in breakdown) == sim.stage_peak_memory_bytes
        assert [x.total for x in breakdown] == pytest.approx(list(mem_all), abs=2)


def test_weight_versions_are_checked():
    with pytest.raises(PtplanError, match=r"weight_versions=3; a stage keeps 1 weight version, or 2 with PipeDream-2BW"):
        PhaseShape(K=1, M=1, b=1, D=1, frozen=0, cache=False, inflight=(1,), weight_versions=3)


# ---- the backward's working set (issue 22's GPU runs) ------------------------------------------------
@pytest.mark.parametrize("recompute", [False, True])
def test_backward_working_set_by_hand(recompute):
    """A stage holds, while a backward runs, b x the largest per-sample working set of its layers (+ that layer's
    accumulate bytes with M > 1) on top of its micro-batches in flight; the stage with the head less b x the
    head's output (the runtime keeps the loss, not the output). Checked against a profile without the terms."""
    prof = synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512)
    n = prof.num_layers
    wk = [(7 if r.kind == "mlp" else 3) * 1000 + 10 * i for i, r in enumerate(prof.layers)]
    wk[-1] = 40 * prof.layers[-1].output_bytes_per_sample  # a language-model head: far over its output
    acc = [r.grad_bytes // 2 for r in prof.layers]
    worked = replace(prof, layers=tuple(replace(r, backward_working_bytes_per_sample=w, accumulate_bytes=a)
                                        for r, w, a in zip(prof.layers, wk, acc)))
    gpu = Cluster.uniform(nodes=1, gpus_per_node=2)
    ranges = [(0, 5), (5, n)]
    b = 2
    for M in (1, 4):
        sched = "1f1b" if M >= 2 else "gpipe"
        base = model_for(prof, gpu, K=2, M=M, b=b, f=0, schedule=sched, recompute=recompute).stage_memory(ranges)
        mem = model_for(worked, gpu, K=2, M=M, b=b, f=0, schedule=sched, recompute=recompute).stage_memory(ranges)
        for (lo, hi), x, x0 in zip(ranges, mem, base):
            w = max(b * wk[i] + (acc[i] if M > 1 else 0) for i in range(lo, hi))
            if hi == n:
                w = max(w - b * prof.layers[-1].output_bytes_per_sample, 0)
            assert w > 0
            assert x.activations == x0.activations + w, (M, lo)
            assert (x.weights, x.gradients, x.optimizer, x.buffers, x.transient) == \
                (x0.weights, x0.gradients, x0.optimizer, x0.buffers, x0.transient)
            assert x.total == x.weights + x.gradients + x.optimizer + x.buffers + max(x.activations, x.transient)


@pytest.mark.parametrize("schedule, K, V", [("zb-v", 4, 2), ("interleaved-1f1b", 1, 2), ("interleaved-1f1b", 2, 2)])
def test_receive_buffers_only_where_the_neighbouring_stage_is_on_another_rank(schedule, K, V):
    """Consecutive stages on one rank pass activations and gradients in place (``executor/runtime/step.py``: no
    RECV between them), so only a stage whose neighbour is on another rank holds M receive buffers for it: zb-v's
    middle stages K-1 and K share a rank, and interleaved K = 1 has no messages at all. Found by an audit: rank 3
    of zb-v K=4 was charged 96 MiB of buffers it never allocates."""
    from ptplan.planner.candidate import Candidate
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.schedule import stage_to_rank
    from ptplan.planner.search import PhaseSearch

    prof = synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512)
    t = CostTable(prof)
    M, b = 8, 1
    search = PhaseSearch(prof, Cluster.uniform(nodes=1, gpus_per_node=K), TrainingConfig(epochs=1, samples_per_epoch=8,
                                                                                          batch=8, schedule=schedule))
    model = search.uniform_model(Candidate(K=K, D=1, M=M, b=b, cache=False, schedule=schedule, V=V), 0)
    S, n = K * V, prof.num_layers
    cuts = [round(i * n / S) for i in range(S + 1)]
    ranges = list(zip(cuts[:-1], cuts[1:]))
    ranks = stage_to_rank(schedule, K, V)
    for s, ((lo, hi), x) in enumerate(zip(ranges, model.stage_memory(ranges))):
        want = 0
        if s > 0 and ranks[s - 1] != ranks[s]:
            want += M * b * t.out_per_sample[lo - 1]  # the activation arriving from another rank
        if s < S - 1 and ranks[s + 1] != ranks[s]:
            want += M * b * t.out_per_sample[hi - 1]  # the gradient coming back from another rank
        assert x.buffers == want, (s, ranks)
    if K == 1:
        assert all(x.buffers == 0 for x in model.stage_memory(ranges))


def test_zero_bubble_stash_by_hand():
    """ZB-H1 on K = 4, M = 8: stage s > 0 holds up to s + 1 micro-batches between their B and their W
    (``peak_stashed``: 0 2 3 4; stage 0 runs its whole backward in W), each keeping what its B left for its W,
    b · Σ stash[lo:hi]; the stage model adds exactly that to the peak, the static and the activations, and nothing
    else. 1F1B, which has no W, and a profile without the stash price none."""
    from ptplan.planner.schedule import peak_stashed

    assert peak_stashed("zb-h1", 2, 16) == (0, 2)
    assert peak_stashed("zb-h1", 4, 8) == (0, 2, 3, 4)
    assert peak_stashed("zb-v", 4, 8, 2) == (0, 2, 3, 4, 3, 2, 1, 1)
    assert peak_stashed("1f1b", 4, 8) == (0, 0, 0, 0) == peak_stashed("gpipe", 4, 8)
    prof = synthetic_profile(num_blocks=6, hidden=64, seq_len=16)
    rng = random.Random(3)
    prof = replace(prof, layers=tuple(replace(r, backward_stash_bytes_per_sample=0 if r.index == 0 else
                                              rng.randrange(100, 5000)) for r in prof.layers))
    gpu = Cluster.uniform(nodes=1, gpus_per_node=4)
    K, M, b = 4, 8, 2
    ranges = random_split(rng, 0, prof.num_layers, K)
    stashed = peak_stashed("zb-h1", K, M)
    base = dict(K=K, M=M, b=b, D=1, frozen=0, cache=False, inflight=peak_inflight("zb-h1", K, M),
                device_is_host=False, action_overhead_s=gpu.action_overhead_s)
    plain = StageModel(CostTable(prof), PhaseShape(**base), links_for(gpu, K))
    zb = StageModel(CostTable(prof), PhaseShape(**base, stashed=stashed), links_for(gpu, K))
    for s, ((lo, hi), x, y) in enumerate(zip(ranges, plain.stage_memory(ranges), zb.stage_memory(ranges))):
        want = stashed[s] * b * sum(r.backward_stash_bytes_per_sample for r in prof.layers[lo:hi])
        assert y.total - x.total == want and y.activations - x.activations == want, s
        assert (y.weights, y.gradients, y.optimizer, y.buffers) == (x.weights, x.gradients, x.optimizer, x.buffers)
        _, mem = zb.evaluate(s, zb.prepare(np.array([lo]), np.array([hi])))
        assert int(mem[0]) == y.total  # the partitioner's evaluation is the breakdown's total
    none = replace(prof, layers=tuple(replace(r, backward_stash_bytes_per_sample=0) for r in prof.layers))
    assert StageModel(CostTable(none), PhaseShape(**base, stashed=stashed), links_for(gpu, K)).stage_memory(ranges) \
        == StageModel(CostTable(none), PhaseShape(**base), links_for(gpu, K)).stage_memory(ranges)
