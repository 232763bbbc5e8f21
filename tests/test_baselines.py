"""Baselines side by side (planner/baselines.py): each row against a hand computation on a small synthetic profile."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ptplan.planner.baselines import baselines
from ptplan.planner.cluster import Cluster
from ptplan.planner.config import TrainingConfig
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.simulate import gpipe_closed_form
from ptplan.planner.synthetic import synthetic_profile

FREEZE = FreezePolicy(policy="none")


def toy(memory: int = 64 << 30, bandwidth: float = 1e9, latency: float = 1e-5) -> Cluster:
    return Cluster(name="toy", nodes=1, gpus_per_node=4, gpu_memory_bytes=memory, gpu_name="toy",
                   intra_bandwidth=bandwidth, intra_latency_s=latency, inter_bandwidth=bandwidth,
                   inter_latency_s=latency, host_memory_bytes=64 << 30)


def rows(prof, cluster, cfg):
    return {r.key: r for r in baselines(prof, cluster, cfg, FREEZE)}


def test_data_parallel_is_the_hand_computed_step():
    """K=1, D=4: iteration = M·Σ(forward + backward at b) + one ring all-reduce of every gradient + the optimizer
    steps, for the best M; the training time is that over epochs x N // batch steps."""
    prof = synthetic_profile(num_blocks=2, hidden=64, seq_len=16, vocab=256)
    cl = toy()
    cfg = TrainingConfig(epochs=2, samples_per_epoch=160, batch=16, schedule="gpipe")
    got = rows(prof, cl, cfg)["data-parallel"]
    grad = sum(r.grad_bytes for r in prof.layers)
    ar = cl.allreduce_seconds(range(4), grad)
    opt = sum(r.optimizer_s or 0.0 for r in prof.layers)  # the synthetic profile measured no optimizer step
    hand = {}
    for M in (1, 2, 4):  # 4 samples per replica, micro-batches of 4 // M (all measured sizes)
        i = prof.batch_sizes.index(4 // M)
        hand[M] = M * sum(r.forward_s[i] + r.backward_s[i] for r in prof.layers) + ar + opt
    M = min(hand, key=hand.get)
    assert (got.K, got.D, got.tp, got.fsdp, got.M) == (1, 4, 1, False, M)
    assert got.iteration_s == pytest.approx(hand[M], rel=1e-9)
    assert got.seconds == pytest.approx(2 * (160 // 16) * hand[M], rel=1e-9)
    assert got.fits and got.error is None


def test_pipeline_only_is_gpipe_closed_form_on_uniform_layers():
    """K=W=4, D=1, 8 identical layers, links of no cost: GPipe's (M+K-1)(f+b) with f, b of two layers."""
    base = synthetic_profile(num_blocks=3, hidden=64, seq_len=16, vocab=256)
    one = base.layers[1]
    layers = tuple(replace(one, index=i, name=f"l{i}", kind="attention", block=i // 2, optimizer_s=None)
                   for i in range(8))
    prof = replace(base, layers=layers, model=replace(base.model, num_blocks=4))
    cl = toy(bandwidth=1e15, latency=1e-12)
    cfg = TrainingConfig(epochs=1, samples_per_epoch=64, batch=8, schedule="gpipe")
    got = rows(prof, cl, cfg)["pipeline-only"]
    assert (got.K, got.D) == (4, 1)
    i = prof.batch_sizes.index(got.micro_batch_size)
    f, b = 2 * one.forward_s[i], 2 * one.backward_s[i]
    assert got.iteration_s == pytest.approx(gpipe_closed_form(4, got.M, f, b).makespan_s, rel=1e-6)


def test_memory_is_stated_and_rows_that_do_not_fit_say_so():
    """On GPUs too small for a replica, pure data parallel is still priced, with its peak (at least the weights,
    gradients and optimizer state of every layer) and 'does not fit'; FSDP shards them over 4 and needs less;
    the best uniform strategy is one that fits."""
    prof = synthetic_profile(num_blocks=4, hidden=128, seq_len=16, vocab=1024)
    state = sum(r.param_bytes + r.grad_bytes + r.optimizer_bytes for r in prof.layers)
    cl = toy(memory=int(state * 0.8))
    got = rows(prof, cl, TrainingConfig(epochs=1, samples_per_epoch=64, batch=16))
    dp, fsdp, best = got["data-parallel"], got["fsdp"], got["best-uniform"]
    assert dp.peak_memory_bytes >= state and not dp.fits and "does not fit" in dp.fit_text
    assert dp.limit_bytes == int(cl.gpu_memory_bytes * 0.9)
    assert fsdp.fsdp and fsdp.peak_memory_bytes < dp.peak_memory_bytes
    assert best.fits and best.seconds is not None


def test_tensor_parallel_row_uses_the_widest_tp_in_a_node():
    prof = synthetic_profile(num_blocks=2, hidden=64, seq_len=16, vocab=256, heads=4)
    got = rows(prof, toy(), TrainingConfig(epochs=1, samples_per_epoch=64, batch=16))["tensor-parallel"]
    assert (got.K, got.tp, got.D) == (1, 4, 1) and got.iteration_s and got.seconds
    assert "tp=4" in got.note


def test_a_gpu_profile_on_another_devices_cluster_is_warned():
    """Issue 22: an H100 profile on the RTX 5000 cluster, GPU profiles on cpu:N get a warning; the GPU's own
    cluster and CPU profiles do not (those have their own warning on GPU clusters)."""
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.planner import device_mismatch
    from ptplan.planner.profile import load_profile
    h100 = load_profile("profiles/bert-base_h100_bf16.json")
    rtx = load_profile("profiles/bert-base_rtx5000_fp32.json")
    cpu = load_profile("profiles/bert-base_cpu_fp32.json")
    assert "Quadro RTX 5000" in device_mismatch(h100, get_preset("paper"))
    assert "CPU processes" in device_mismatch(rtx, get_preset("cpu:4"))
    assert device_mismatch(h100, get_preset("dgx-h100")) is None
    assert device_mismatch(rtx, get_preset("paper")) is None
    assert device_mismatch(cpu, get_preset("cpu:4")) is None and device_mismatch(cpu, get_preset("paper")) is None


def test_cpu_clusters_can_plan_the_autocache():
    """Issue 22: on cpu:N the processes' limits took all of the RAM, so the AutoCache never fitted ('needs 0.0 GiB
    ... has 0.0 GiB'). Now the cache and the processes share it: with the cache on, the cache fits where its rows
    fit the RAM, each process gets what the cache leaves, and a cache too big says how big against what RAM."""
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.search import PhaseSearch, Visit
    prof = synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=256)
    cl = get_preset("cpu:4")
    cfg = TrainingConfig(epochs=2, samples_per_epoch=256, batch=16, cache="on")
    s = PhaseSearch(prof, cl, cfg)
    ch = s.search(3, Visit(samples=256.0))
    assert ch.cand.cache
    n0 = prof.frozen_boundary(3)
    need = s.host_bytes_per_node(ch.cand, n0, 0)
    assert s.stage_limit(ch.cand, n0, 0) == pytest.approx(
        min(s.limit, (cl.host_memory_bytes * 0.9 - need) / 4) / ch.cand.V)
    big = replace(cfg, samples_per_epoch=int(cl.host_memory_bytes // 4096 // 16 * 16))  # rows over the RAM
    ok, why = PhaseSearch(prof, cl, big).host_fits(ch.cand, n0, 0)
    assert not ok and "shared with its 4 processes" in why and "0.0 GiB" not in why.split("but")[1][:20]
