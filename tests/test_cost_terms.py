"""Issue 22 item 2: each cost term of the one stage model against a hand computation."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ptplan.planner.costs import CostTable
from ptplan.planner.errors import PtplanError
from ptplan.planner.strategy import Strategy, strategy_table, tp_saved_share
from ptplan.planner.synthetic import synthetic_profile

MiB = 2**20


def _megatron_profile(h: int, a: int, s: int, blocks: int = 2):
    """A synthetic profile whose block halves save exactly Megatron's bytes (16-bit) per sample."""
    prof = synthetic_profile(num_blocks=blocks, hidden=h, seq_len=s, vocab=128, dtype_bytes=2)
    prof = dataclasses.replace(prof, model=dataclasses.replace(prof.model, config={**prof.model.config, "n_head": a}))
    sbh = s * h
    saved = {"attention": 13 * sbh + 5 * a * s * s, "mlp": 21 * sbh}
    layers = tuple(dataclasses.replace(r, saved_bytes_per_sample=saved.get(r.kind, r.saved_bytes_per_sample))
                   for r in prof.layers)
    return dataclasses.replace(prof, layers=layers)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_activations_under_tp_follow_megatron(tp):
    # per layer (attention + mlp half), b = 1: s·h·(10 + 24/t + 5·a·s/(h·t)) bytes with tp t
    h, a, s = 1024, 16, 512
    table = CostTable(_megatron_profile(h, a, s))
    shard = strategy_table(table, Strategy(tp=tp), 1, (0.0, 0.0), (0.0, 0.0))
    block = shard.saved_per_sample[1] + shard.saved_per_sample[2]
    assert block == pytest.approx(s * h * (10 + 24 / tp + 5 * a * s / (h * tp)))
    whole = table.saved_per_sample[1] + table.saved_per_sample[2]
    assert whole == pytest.approx(s * h * (34 + 5 * a * s / h))
    sp = strategy_table(table, Strategy(tp=tp, sp=True), 1, (0.0, 0.0), (0.0, 0.0))
    # sequence parallelism: all / tp but the two column-parallel inputs the runtime keeps gathered (2·s·h each)
    assert sp.saved_per_sample[1] + sp.saved_per_sample[2] == pytest.approx(4 * s * h + (whole - 4 * s * h) / tp)
    # replicated layers (embedding, final norm, head) keep theirs
    for i in (0, table.n - 2, table.n - 1):
        assert shard.saved_per_sample[i] == table.saved_per_sample[i]
    assert shard.cum_saved[-1] == pytest.approx(shard.saved_per_sample.sum())


def test_the_audit_numbers():
    # the audit's layer: 276 MiB unsplit, Megatron 164 MiB at tp 2 and 108 MiB at tp 4 (5·a·s/h ≈ 19.1)
    h, a, s = 1024, 16, 256  # 5·a·s/h = 20, the audit's layer had about 19.1: ratios agree within 1 %
    table = CostTable(_megatron_profile(h, a, s))
    whole = table.saved_per_sample[1] + table.saved_per_sample[2]
    for tp, ratio in ((2, 164 / 276), (4, 108 / 276)):
        share = tp_saved_share(table, tp)
        got = (table.saved_per_sample[1] * share[1] + table.saved_per_sample[2] * share[2]) / whole
        assert got == pytest.approx(ratio, rel=0.01)


def test_sequence_parallel_needs_tp():
    with pytest.raises(PtplanError, match="needs tp > 1"):
        Strategy(sp=True)
    assert Strategy.parse("tp2·sp·fsdp") == Strategy(tp=2, sp=True, fsdp=True)
    assert Strategy(tp=4, sp=True).label == "tp4·sp"


# ---- token slices: α–β per message, tp all-reduces and the overhead per slice --------------------------------

def test_each_slice_message_pays_the_latency():
    from ptplan.planner.schedule import terapipe
    from ptplan.planner.simulate import SliceCosts, StageCost, simulate

    sc = SliceCosts(tokens=(3, 1), forward_s=((1.0, 1.0),) * 2, backward_s=((1.0, 1.0),) * 2)
    base = [StageCost(forward_s=1.0, backward_s=1.0), StageCost(forward_s=1.0, backward_s=1.0)]
    t0 = simulate(terapipe(2, 1, 2), base, slice_costs=sc).iteration_s
    # α = 0.1 s, β·bytes = 0.4 s for the whole micro-batch: the first slice (3 of 4 tokens) reaches stage 1 after
    # 0.1 + 0.4·3/4 = 0.4 s (was 0.5·3/4 = 0.375 s with the latency scaled with the slice)
    sent = [dataclasses.replace(base[0], send_forward_s=0.5, send_forward_latency_s=0.1), base[1]]
    assert simulate(terapipe(2, 1, 2), sent, slice_costs=sc).iteration_s - t0 == pytest.approx(0.1 + 0.4 * 3 / 4)
    with pytest.raises(PtplanError, match="part of it"):
        StageCost(forward_s=1.0, backward_s=1.0, send_forward_s=0.1, send_forward_latency_s=0.2)


def _tp_model(tp: int):
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.stage import PhaseShape, StageModel, links_for
    from ptplan.planner.strategy import tp_allreduce_coeffs

    prof = synthetic_profile(num_blocks=4, hidden=256, seq_len=64, vocab=1024)
    cl = get_preset("dgx-h100")
    cl = dataclasses.replace(cl, action_overhead_s=1e-4)
    shape = PhaseShape(K=2, M=2, b=2, D=1, frozen=0, cache=False, inflight=(2, 1), tp=tp,
                       tp_ar=tp_allreduce_coeffs(cl, tp), action_overhead_s=cl.action_overhead_s)
    return prof, StageModel(CostTable(prof), shape, links_for(dataclasses.replace(cl, gpus_per_node=8 // tp), 2)), cl


def test_stage_costs_say_what_their_totals_hold():
    from ptplan.planner.strategy import splittable, tp_allreduce_coeffs

    prof, m, cl = _tp_model(4)
    t = CostTable(prof)
    lat, per = tp_allreduce_coeffs(cl, 4)
    a = splittable(t)
    ranges = [(0, 5), (5, prof.num_layers)]
    for (lo, hi), c in zip(ranges, m.stage_costs(ranges)):
        # Megatron: one all-reduce of the half's b·out bytes per attention / MLP half, forward and backward
        assert c.tp_comm_latency_s == pytest.approx(float(a[lo:hi].sum()) * lat)
        assert c.tp_comm_s == pytest.approx(float((a[lo:hi] * (lat + 2 * t.out_per_sample[lo:hi] * per)).sum()))
        div = np.where(a[lo:hi] > 0, 4.0, 1.0)
        assert c.forward_s - c.tp_comm_s - c.overhead_s == pytest.approx(float((t.at(2).fwd[lo:hi] / div).sum()))
        assert c.overhead_s == 1e-4
    c0, c1 = m.stage_costs(ranges)
    assert c0.send_forward_latency_s == pytest.approx(cl.intra_latency_s) and c0.send_backward_latency_s == 0.0
    assert c1.send_backward_latency_s == pytest.approx(cl.intra_latency_s) and c1.send_forward_latency_s == 0.0


def test_slice_costs_by_hand():
    from ptplan.planner.simulate import StageCost
    from ptplan.planner.terapipe import SliceCost, StageSliceModel, slice_costs

    flat = SliceCost(const=0.0, per_token=1.0, per_context=0.0, per_pair=0.0)  # t ∝ s: slices share the work
    model = StageSliceModel(blocks=(1.0,), token_forward_s=(0.0,), token_backward_s=(0.0,), forward=flat,
                            backward=flat)
    c = StageCost(forward_s=1.0 + 0.2 + 0.05, backward_s=2.0 + 0.2 + 0.05, tp_comm_s=0.2, tp_comm_latency_s=0.08,
                  overhead_s=0.05)
    sc = slice_costs(model, [c], 100, (75, 25))
    # forward of slice j = 1.0·s_j/L + 0.05 (its action) + 0.08 (its all-reduces' α) + 0.12·s_j/L (their bytes)
    assert sc.forward_s[0] == pytest.approx((0.75 + 0.05 + 0.08 + 0.09, 0.25 + 0.05 + 0.08 + 0.03))
    assert sc.backward_s[0] == pytest.approx((1.5 + 0.05 + 0.08 + 0.09, 0.5 + 0.05 + 0.08 + 0.03))
    # two slices cost the stage 2·(0.05 + 0.08) more than one: slicing's extra actions and all-reduces are priced
    assert sum(sc.forward_s[0]) - c.forward_s == pytest.approx(0.05 + 0.08)


def test_token_slices_with_tensor_parallelism_are_planned():
    """TeraPipe's own configuration (slices with tp inside each stage) is planned by ``sliced_phase`` (each slice
    paying its own all-reduces: ``test_slice_costs_by_hand``); a tp the model's heads do not divide is refused."""
    import random

    from ptplan.planner.cluster import get_preset
    from ptplan.planner.profile import SliceFit, SlicePoint, SliceProfile, load_profile
    from ptplan.planner.terapipe import sliced_phase
    from pathlib import Path

    prof = load_profile(Path(__file__).resolve().parents[1] / "profiles" / "gpt2_cpu_fp32.json")
    rng = random.Random(0)

    def fit():
        return SliceFit(const=rng.uniform(1e-4, 5e-4), per_token=rng.uniform(1e-4, 1e-3), per_context=1e-7,
                        per_pair=1e-8, fit_error=0.0, max_error=0.0)
    pts = tuple(SlicePoint(b=1, s=s, c=c, forward_s=1.0, backward_s=1.0) for s in (1, 2) for c in (0, 1))
    prof = dataclasses.replace(prof, token_slices=SliceProfile(unit="block", points=pts, forward=fit(),
                                                               backward=fit(), device="synthetic", date="-"))
    cl = get_preset("h100-4node")
    ph = sliced_phase(prof, K=4, M=1, b=1, tp=4, cluster=cl, granularity=16)
    assert len(ph.slices) > 1 and ph.iteration_s < ph.unsliced_s and ph.fits
    with pytest.raises(PtplanError, match="cannot split"):
        sliced_phase(prof, K=4, M=1, b=1, tp=8, cluster=cl)  # 12 heads do not split over 8 ranks


# ---- the per-action overhead: measured by the profiler, charged by the planner -------------------------------

def test_the_profiler_measures_the_action_overhead_and_the_planner_charges_it():
    import torch

    from ptplan.executor.families.models import build_model
    from ptplan.executor.profiling.profiler import profile_model
    from ptplan.planner.cluster import charged_overheads, get_preset

    torch.set_num_threads(1)
    prof = profile_model(build_model("bert-tiny", seq_len=8), device="cpu", batch_sizes=[1], warmup=0, repeats=1,
                         progress=False)
    o = prof.measurement["action_overhead_s"]
    assert 1e-6 < o < 0.05  # host seconds per forward or backward action of the step interpreter
    # a CPU profile's overhead is charged on a CPU cluster where it is larger than the cluster's own figure ...
    cpu = dataclasses.replace(get_preset("cpu:2"), action_overhead_s=0.0)
    assert charged_overheads(cpu, prof).action_overhead_s == o
    assert charged_overheads(get_preset("cpu:2"), prof).action_overhead_s == max(o, get_preset("cpu:2").action_overhead_s)
    # ... and never on a GPU cluster (a Python overhead on this CPU says nothing of a GPU host)
    assert charged_overheads(get_preset("dgx-h100"), prof) is get_preset("dgx-h100")
    gpu_prof = dataclasses.replace(prof, device=dataclasses.replace(prof.device, kind="cuda"))
    assert charged_overheads(get_preset("dgx-h100"), gpu_prof).action_overhead_s == o


def test_the_overhead_is_measured_on_the_interpreter_the_executor_runs():
    """The profiler times the executor's own step interpreter (issue 21: it timed torch's ScheduleGPipe, 64 us an
    action on the 2-core box, where the interpreter takes 26 us): every action it runs is the interpreter's."""
    import torch

    from ptplan.executor.profiling.overhead import measure_action_overhead
    from ptplan.executor.runtime import step as step_mod

    step_mod.TRACE = []
    try:
        o = measure_action_overhead(torch.device("cpu"), low=2, high=4, repeats=1)
        ran = list(step_mod.TRACE)
    finally:
        step_mod.TRACE = None
    assert o is not None and o >= 0.0
    # (2 + 4 micro-batches) x (forward + backward) + ALLREDUCE per step, 3 steps (2 warm-up + 1) at each M
    assert sum(1 for _, a in ran if a.startswith("0F")) == 3 * (2 + 4), ran[:8]


def test_charged_overhead_prices_each_extra_action():
    """The stage model puts the per-action overhead o into every forward and backward, so the simulated iteration
    grows by o per action on its critical path."""
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.schedule import gpipe
    from ptplan.planner.simulate import simulate
    from ptplan.planner.stage import PhaseShape, StageModel, links_for

    prof = synthetic_profile(num_blocks=2, hidden=64, seq_len=16, vocab=100)
    cl = get_preset("dgx-h100")
    t = CostTable(prof)
    ranges = [(0, 3), (3, prof.num_layers)]

    def it(o: float) -> float:
        sh = PhaseShape(K=2, M=4, b=1, D=1, frozen=0, cache=False, inflight=(4, 4), action_overhead_s=o)
        return simulate(gpipe(2, 4), StageModel(t, sh, links_for(cl, 2)).stage_costs(ranges)).iteration_s

    # GPipe on 2 stages, M = 4: the critical path holds M + 1 forwards and M + 1 backwards (M on the slower stage,
    # one on the other) whatever the stage times, so o adds 2·(M + 1)·o
    assert it(1e-3) - it(0.0) == pytest.approx(2 * 5 * 1e-3, rel=1e-6)


# ---- kernel efficiency by GEMM size (planner/devices.py) -----------------------------------------------------

def test_efficiency_falls_for_small_matrices():
    from ptplan.planner.devices import get_device

    h100 = get_device("h100")
    e, peak = h100.efficiency, h100.matmul_peak("bfloat16")
    half = peak * e.matmul_half_s  # 989.4e12 · 5e-6 = 4.947e9 FLOPs: a GEMM this big reaches half of matmul_max
    assert h100.efficiency_at(half, "bfloat16") == pytest.approx(e.matmul_max / 2)
    assert h100.efficiency_at(99 * half, "bfloat16") == pytest.approx(0.99 * e.matmul_max)
    # a 4096³ GEMM: 2·4096³ = 1.374e11 FLOPs -> 0.75 · 1.374e11 / (1.374e11 + 4.947e9) = 0.724 of the peak
    f = 2 * 4096**3
    assert h100.efficiency_at(f, "bfloat16") == pytest.approx(0.75 * f / (f + 4.947e9), rel=1e-3)
    # roofline: a bandwidth-bound op takes bytes / (0.8 · 3.35 TB/s) + launch
    assert h100.op_seconds(0.0, 1e9, "bfloat16") == pytest.approx(4e-6 + 1e9 / (0.8 * 3350e9))
    assert h100.op_seconds(f, 0.0, "bfloat16") == pytest.approx(4e-6 + f / (peak * h100.efficiency_at(f, "bfloat16")))


# ---- α–β messages and collectives, bytes from the profile's dtype, the data-parallel all-reduce ---------------

def test_messages_and_collectives_are_alpha_beta():
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.stage import PhaseShape, StageModel, links_for

    cl = get_preset("dgx-h100")  # NVLink: α = 5 us, 450 GB/s
    assert cl.p2p_seconds(0, 1, 1e9) == pytest.approx(5e-6 + 1e9 / 450e9)
    # ring all-reduce of n = 4 ranks: 2(n-1) steps of α, 2(n-1)/n of the bytes over the link
    assert cl.allreduce_seconds([0, 1, 2, 3], 1e9) == pytest.approx(6 * 5e-6 + 1.5 * 1e9 / 450e9)
    # the stage model's boundary bytes are the profile's (its dtype): bf16 GPT, b = 3 -> 3 · s · h · 2 bytes
    prof = synthetic_profile(num_blocks=2, hidden=64, seq_len=16, vocab=100, dtype_bytes=2)
    sh = PhaseShape(K=2, M=1, b=3, D=2, frozen=0, cache=False, inflight=(1, 1))
    m = StageModel(CostTable(prof), sh, links_for(get_preset("h100-4node"), 2))
    c0, c1 = m.stage_costs([(0, 3), (3, prof.num_layers)])
    assert c0.send_forward_s == pytest.approx(5e-6 + 3 * 16 * 64 * 2 / 450e9)
    assert c1.send_backward_s == pytest.approx(c0.send_forward_s)
    # gradient bytes in the profile's dtype (2 B per parameter) in the data-parallel all-reduce
    grads = sum(r.params for r in prof.layers[:3]) * 2
    assert grads == sum(r.grad_bytes for r in prof.layers[:3])
    assert c0.allreduce_s == pytest.approx(m.links.ar_lat[0] + grads * m.links.ar_per_byte[0])


def test_the_data_parallel_all_reduce_follows_the_last_backward():
    """The runtime all-reduces a stage's gradients in one flat buffer after the schedule's step
    (executor/runtime/elastic.py ``_allreduce_grads``), not bucket by bucket during the backward; the simulator
    does exactly that: each stage's all-reduce starts after its own last backward (overlapping only the other
    stages' remaining work). GPipe, K = 2, M = 2, f = b = 1 s, all-reduce 0.5 s: stage 1 ends its backwards at 5 s
    and all-reduces until 5.5 s, stage 0 ends at 6 s and all-reduces until 6.5 s."""
    from ptplan.planner.schedule import gpipe
    from ptplan.planner.simulate import StageCost, simulate

    c = StageCost(forward_s=1.0, backward_s=1.0, allreduce_s=0.5)
    r = simulate(gpipe(2, 2), [c, c])
    assert r.iteration_s == pytest.approx(6.5)


# ---- refusals revisited: plan what the runtime can run ------------------------------------------------------

def test_2bw_with_strategies_plans_only_what_the_runtime_runs():
    from pathlib import Path

    from ptplan.executor.training.validate import check_strategies
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import make_plan
    from ptplan.planner.profile import load_profile

    prof = load_profile(Path(__file__).resolve().parents[1] / "profiles" / "bert-large_a100_bf16.json")
    cfg = TrainingConfig(epochs=2, samples_per_epoch=4096, batch=256, schedule="2bw", allow_extrapolation=True)
    plan = make_plan(prof, get_preset("dgx-h100"), cfg, FreezePolicy(policy="manual", manual=(0, 12)),
                     strategies="auto")
    assert any(ph.schedule == "2bw" for ph in plan.phases)
    for ph in plan.phases:
        if ph.schedule == "2bw":
            assert ph.tp == 1 and not ph.any_fsdp and not ph.recompute_layers
    check_strategies(plan)  # the executor's own check accepts every phase


def test_ptplan_plan_says_why_it_does_not_slice_a_phase():
    from types import SimpleNamespace

    from ptplan.planner.terapipe import slice_refusal

    ph = SimpleNamespace(V=1, tp=4, any_fsdp=False, any_recompute=False, schedule="gpipe")
    assert "tp=4" in slice_refusal(ph) and "tensor-parallel twins" in slice_refusal(ph)
    assert slice_refusal(SimpleNamespace(V=1, tp=1, any_fsdp=False, any_recompute=False, schedule="1f1b")) is None


def test_terapipes_own_setting_tp8_by_48_stages_is_planned():
    """GPT-3 175B's shape (96 blocks, width 12,288, 96 heads, 2,048 tokens) as a synthetic profile with analytic
    slice costs, on 48 nodes of 8 GPUs: K = 48 stages, each tp 8 inside its node. Planned in well under a second,
    sliced, and fitting the memory."""
    from ptplan.planner.cluster import Cluster
    from ptplan.planner.terapipe import sliced_phase

    p = synthetic_profile(num_blocks=96, hidden=12288, seq_len=2048, vocab=50257, dtype_bytes=2, heads=96,
                          slices=True, flops_per_s=100e12, batch_sizes=(1, 2, 4))
    cl = Cluster.uniform(nodes=48, gpus_per_node=8, like="dgx-h100")
    ph = sliced_phase(p, K=48, M=2, b=1, tp=8, cluster=cl, granularity=16)
    assert len(ph.slices) > 1 and sum(ph.slices) == 2048 and ph.fits
    assert ph.iteration_s < ph.unsliced_s


def test_fsdp_collectives_across_nodes_by_hand():
    """What ptplan prices for ZeRO-3 / FSDP when the shard group spans nodes (bench/published.py's ZeRO-3 root cause):
    per layer and micro-batch an all-gather of its weights in the forward, again in the backward, and a reduce-scatter
    of its gradient, each a ring over the whole data-parallel group of n ranks -- (n-1)·α + (n-1)/n · bytes / bw with
    bw the node's NICs together (8 x 25 GB/s on dgx-a100, not NVLink's 300 GB/s) -- added to the compute, not
    overlapped; one NIC per node at X bytes/s makes bw = X (the bench's fitted per-GPU ZeRO-3 rate)."""
    from ptplan.planner.cluster import Cluster
    from ptplan.planner.stage import links_for

    prof = synthetic_profile(num_blocks=2, hidden=64, seq_len=16, vocab=100, dtype_bytes=2)
    t = CostTable(prof)
    for nics, inter, bw in ((8, 25e9, 200e9), (1, 30e9, 30e9)):
        cl = dataclasses.replace(Cluster.uniform(nodes=4, like="dgx-a100"), nics_per_node=nics, inter_bandwidth=inter)
        n, alpha = 32, 10e-6  # 4 nodes x 8 GPUs; the IB latency (> NVLink's 5 us)
        lk = links_for(cl, 1)
        assert lk.ar_lat[0] == pytest.approx(2 * (n - 1) * alpha)
        assert lk.ar_per_byte[0] == pytest.approx(2 * (n - 1) / n / bw)
        sh = strategy_table(t, Strategy(fsdp=True), n, (0.0, 0.0), (float(lk.ar_lat[0]), float(lk.ar_per_byte[0])))
        b, j = 2, 1  # micro-batch size 2 (column 1), the first attention half
        W, G = prof.layers[j].param_bytes, prof.layers[j].grad_bytes
        ag = (n - 1) * alpha + (n - 1) / n * W / bw
        rs = (n - 1) * alpha + (n - 1) / n * G / bw
        assert sh._fwd[j, 1] == pytest.approx(prof.layers[j].forward_s[1] + ag)
        assert sh._bwd[j, 1] == pytest.approx(prof.layers[j].backward_s[1] + ag + rs)
        assert sh.param_bytes[j] == pytest.approx(W / n) and sh.grad_bytes[j] == pytest.approx(G / n)
        assert sh.cum_sync[-1] == 0.0  # no all-reduce after the pipeline
        assert t.batch_sizes[1] == b
