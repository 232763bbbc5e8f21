"""Per-stage strategies (planner/strategy.py) in the one stage model: tensor parallel, FSDP, recomputation."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ptplan.planner.cluster import get_preset
from ptplan.planner.costs import CostTable
from ptplan.planner.errors import PtplanError
from ptplan.planner.schedule import peak_inflight
from ptplan.planner.stage import OPTIMIZER_STATE_FACTOR, PhaseShape, StageModel, links_for
from ptplan.planner.strategy import Strategy, gather_layers, splittable, tp_allreduce_coeffs, tp_saved_share
from ptplan.planner.synthetic import synthetic_profile


def model(prof, *, K=2, M=4, b=2, D=4, tp=1, fsdp=False, recompute=False, frozen=0, cluster="dgx-h100"):
    cl = get_preset(cluster)
    shape = PhaseShape(K=K, M=M, b=b, D=D, frozen=frozen, cache=False, inflight=peak_inflight("1f1b", K, M),
                       tp=tp, fsdp=fsdp, recompute=recompute, tp_ar=tp_allreduce_coeffs(cl, tp))
    return StageModel(CostTable(prof), shape, links_for(cl, K)), cl


def test_labels_round_trip_and_bad_strategies_are_refused():
    for st in (Strategy(), Strategy(tp=2), Strategy(tp=4, fsdp=True, recompute=True), Strategy(fsdp=True)):
        assert Strategy.parse(st.label) == st
    assert Strategy(tp=2, fsdp=True, recompute=True).label == "tp2·fsdp·rc"
    assert Strategy().label == "dp" and Strategy().is_default
    for bad in (dict(tp=3), dict(tp=0), dict(fsdp=1)):
        with pytest.raises(PtplanError):
            Strategy(**bad)
    with pytest.raises(PtplanError, match="unknown part"):
        Strategy.parse("tp2·zero")
    with pytest.raises(PtplanError, match="inside a node"):
        tp_allreduce_coeffs(get_preset("dgx-h100"), 16)


def test_tensor_parallel_terms_by_hand():
    prof = synthetic_profile(num_blocks=4, hidden=256, seq_len=64, vocab=1024)
    base, _ = model(prof)
    m, cl = model(prof, tp=2)
    ranges = [(0, 5), (5, prof.num_layers)]
    t = CostTable(prof)
    a = splittable(t)
    assert list(a[:3]) == [0, 1, 1] and a[-1] == 0  # embedding replicated, attention / MLP split, head replicated
    lat, per = tp_allreduce_coeffs(cl, 2)
    assert lat > 0 and per > 0
    tm = t.at(2)
    div = np.where(a > 0, 2.0, 1.0)
    for (lo, hi), c, c0 in zip(ranges, m.stage_costs(ranges), base.stage_costs(ranges)):
        comm = float((a[lo:hi] * (lat + 2 * t.out_per_sample[lo:hi] * per)).sum())
        assert c.forward_s == pytest.approx(float((tm.fwd[lo:hi] / div[lo:hi]).sum()) + comm
                                            + (c0.forward_s - float(tm.fwd[lo:hi].sum())), rel=1e-9)
        assert c.backward_s == pytest.approx(float((tm.bwd[lo:hi] / div[lo:hi]).sum()) + comm
                                             + (c0.backward_s - float(tm.bwd[lo:hi].sum())), rel=1e-9)
    for (lo, hi), mb, mb0 in zip(ranges, m.stage_memory(ranges), base.stage_memory(ranges)):
        w = float((t.param_bytes[lo:hi] / div[lo:hi]).sum())
        assert mb.weights == int(w)
        assert mb.optimizer == int(OPTIMIZER_STATE_FACTOR["adamw"] * w)
        # activations divide where Megatron's split divides them (was: unchanged, "conservative"): each
        # micro-batch in flight holds b · (Σ saved · share + the stage's output), share = u + (1 - u)/2 on the
        # attention / MLP halves (tests/test_cost_terms.py checks share against Megatron's formula)
        share = tp_saved_share(t, 2)
        per_mb = 2 * (float((t.saved_per_sample[lo:hi] * share[lo:hi]).sum()) + t.out_per_sample[hi - 1])
        assert mb.activations == int(mb.inflight * per_mb) and mb.activations < mb0.activations
        assert mb.total < mb0.total


def test_tensor_parallel_divides_the_backward_working_set_as_the_activations():
    """Under tp = 2 a layer's backward working set divides as its saved activations (``tp_saved_share``) and its
    accumulate bytes as its gradients (split layers / 2): the stage holds b x the largest of (working · share +
    accumulate / div) over its layers, the head's stage less b x the head's output -- by hand, on top of the
    activations of the same shape without the fields."""
    prof = synthetic_profile(num_blocks=4, hidden=256, seq_len=64, vocab=1024)
    wk = [1000 * (i % 3 + 1) for i in range(prof.num_layers)]
    wk[-1] = 50 * prof.layers[-1].output_bytes_per_sample
    acc = [r.grad_bytes for r in prof.layers]
    worked = replace(prof, layers=tuple(replace(r, backward_working_bytes_per_sample=w, accumulate_bytes=a)
                                        for r, w, a in zip(prof.layers, wk, acc)))
    ranges = [(0, 5), (5, prof.num_layers)]
    t = CostTable(prof)
    share = tp_saved_share(t, 2)
    div = np.where(splittable(t) > 0, 2.0, 1.0)
    m0, _ = model(prof, tp=2)  # M = 4 > 1, b = 2
    m1, _ = model(worked, tp=2)
    for (lo, hi), x0, x1 in zip(ranges, m0.stage_memory(ranges), m1.stage_memory(ranges)):
        w = max(2 * wk[i] * share[i] + acc[i] / div[i] for i in range(lo, hi))
        if hi == prof.num_layers:
            w = max(w - 2 * t.out_per_sample[-1], 0.0)
        assert w > 0
        assert abs(x1.activations - (x0.activations + w)) <= 1, (lo, hi)  # each rounded down to whole bytes


def test_fsdp_shards_state_and_reduce_scatters():
    prof = synthetic_profile(num_blocks=4, hidden=256, seq_len=64, vocab=1024)
    ranges = [(0, 9), (9, prof.num_layers)]  # stage 1: the final norm and the head, smaller than a block's MLP
    base, _ = model(prof, D=4)
    m, _ = model(prof, D=4, fsdp=True)
    t = CostTable(prof)
    W, G = gather_layers(t, Strategy(fsdp=True))
    assert (W == t.param_bytes).all() and (G == t.grad_bytes).all()  # tp 1: whole layers
    extra = 2 * t.param_bytes.max() + t.grad_bytes.max()  # the whole model's largest layer
    for (lo, hi), mb, mb0, c, c0 in zip(ranges, m.stage_memory(ranges), base.stage_memory(ranges),
                                        m.stage_costs(ranges), base.stage_costs(ranges)):
        assert mb.weights == int(mb0.weights / 4) or abs(mb.weights - mb0.weights / 4) <= 1
        assert abs(mb.gradients - mb0.gradients / 4) <= 1 and abs(mb.optimizer - mb0.optimizer / 4) <= 1
        # the transient over the stage's own layers: the layer in use and the next (or its all-gather's buffer)
        # whole, and one layer's unsharded gradient; at most the whole model's
        own = 2 * t.param_bytes[lo:hi].max() + t.grad_bytes[lo:hi].max()
        assert own <= extra and mb.buffers - mb0.buffers == pytest.approx(own, abs=2)
        assert (own < extra) == (lo == 9)
        # all-gathers per micro-batch make forward and backward slower, and every backward reduce-scatters
        # its gradients (FSDP2's default, what the executor runs): no all-reduce after the pipeline
        L = m.links
        lat, pb = float(np.mean(L.ar_lat)), float(np.mean(L.ar_per_byte))
        W, G = t.param_bytes[lo:hi], t.grad_bytes[lo:hi]
        gather = float(((lat + W * pb) / 2).sum())
        scatter = float(((lat + G * pb) / 2)[G > 0].sum())
        assert c.forward_s - c0.forward_s == pytest.approx(gather)
        assert c.backward_s - c0.backward_s == pytest.approx(gather + scatter)
        assert c0.allreduce_s > 0 and c.allreduce_s == 0.0
        # no flat all-reduce buffer either: only AdamW's foreach temporary of the shard (GPU cluster)
        assert mb.transient == mb.weights < mb0.transient


def test_frozen_prefix_has_no_gradient_terms_under_any_strategy():
    """An uncached frozen prefix is split and sharded as the executor runs it (``hybrid.ShardedStage``): its
    attention and MLP halves' weights / tp, the embedding whole, everything / D under FSDP on stage 0; its no-grad
    forward / tp plus the forward's Megatron all-reduces, plus an all-gather per layer per micro-batch under FSDP;
    no gradient, optimizer, reduce-scatter or all-reduce term."""
    prof = synthetic_profile(num_blocks=4, hidden=256, seq_len=64, vocab=1024)
    n0 = prof.frozen_boundary(2)
    raw = CostTable(prof)
    a = splittable(raw)
    b = 2
    nog = np.diff(raw.at(b).cum_nograd)
    for tp, fsdp in ((1, False), (2, False), (1, True), (2, True)):
        m, cl = model(prof, tp=tp, fsdp=fsdp, frozen=n0, b=b)
        D = m.shape.D
        ranges = [(n0, n0 + 2), (n0 + 2, prof.num_layers)]
        mem = m.stage_memory(ranges)
        t = m.t
        assert mem[0].gradients == int(t.cum_grad[n0 + 2] - t.cum_grad[n0])  # active layers only
        f = OPTIMIZER_STATE_FACTOR[m.shape.optimizer]
        assert mem[0].optimizer == int(f * (t.cum_param[n0 + 2] - t.cum_param[n0]))  # no state for the prefix
        c0 = m.stage_costs(ranges)[0]
        assert c0.allreduce_s == pytest.approx(0.0 if fsdp else float(m.links.ar_lat[0] + (
            t.cum_sync[n0 + 2] - t.cum_sync[n0]) * m.links.ar_per_byte[0]))  # the active layers' sync only
        div = np.where(a > 0, tp, 1) * (D if fsdp else 1)
        prefix_w = float((raw.param_bytes[:n0] / div[:n0]).sum())
        assert mem[0].weights == int(t.cum_param[n0 + 2] - t.cum_param[n0] + prefix_w)
        assert mem[1].weights == int(t.cum_param[prof.num_layers] - t.cum_param[n0 + 2])  # stage 1: no prefix
        lat, per = tp_allreduce_coeffs(cl, tp)
        want = nog[:n0] / np.where(a > 0, tp, 1)[:n0]
        if tp > 1:  # the forward's Megatron all-reduces
            want = want + a[:n0] * (lat + b * raw.out_per_sample[:n0] * per)
        if fsdp:  # each prefix layer all-gathered per micro-batch (half a ring all-reduce of its tp shard)
            L = m.links
            dlat, dper = float(np.mean(L.ar_lat)), float(np.mean(L.ar_per_byte))
            want = want + (dlat + raw.param_bytes[:n0] / np.where(a > 0, tp, 1)[:n0] * dper) / 2
        assert m.prefix_s == pytest.approx(float(want.sum()))
        if fsdp:  # FSDP's transient over each stage's own layers; stage 0 also gathers the prefix's in its forward
            plain, _ = model(prof, tp=tp, fsdp=False, frozen=n0, b=b)
            W, G = (x / np.where(a > 0, tp, 1) for x in (raw.param_bytes, raw.grad_bytes))
            for s, ((lo, hi), x, y) in enumerate(zip(ranges, mem, plain.stage_memory(ranges))):
                own = 2 * W[lo:hi].max() + G[lo:hi].max() + (2 * W[:n0].max() if s == 0 else 0.0)
                assert x.buffers - y.buffers == pytest.approx(own, abs=2), (tp, s)
        if tp > 1 or fsdp:
            assert mem[0].weights < int(t.cum_param[n0 + 2] - t.cum_param[n0] + raw.cum_param[n0])
        # the cached phase keeps the prefix whole in host memory: not on the device, its fill priced whole
        mc = StageModel(raw, replace(m.shape, cache=True), m.links)
        assert mc.stage_memory(ranges)[0].weights == int(t.cum_param[n0 + 2] - t.cum_param[n0])
        assert mc.prefix_s == 0.0 and mc.fill_setup_s >= m.shape.M * float(raw.at(b).cum_nograd[n0])


def test_a_layer_larger_than_a_gpu_fits_only_with_tensor_parallel_and_fsdp():
    """Memory-bound case: one MLP half of hidden 32768 has 8·h² = 8.6e9 parameters; its weights,
    gradients and AdamW state alone (128.0 GiB) exceed an 80 GiB H100, so no pipeline split can hold it;
    tp8·fsdp·rc over 4 nodes (D=4) holds the whole model in 44.5 GiB per GPU (K=1, M=1, b=1)."""
    prof = synthetic_profile(num_blocks=2, hidden=32768, seq_len=1024, vocab=32000)
    cap = get_preset("h100-4node").gpu_memory_bytes
    n = prof.num_layers
    plain, _ = model(prof, K=1, M=1, b=1, D=1, cluster="h100-4node")
    one_layer = np.diff(plain.cum_state)  # weights + gradients + optimizer state of each layer alone
    assert one_layer.max() > cap and prof.layers[int(one_layer.argmax())].kind == "mlp"
    hybrid, _ = model(prof, K=1, M=1, b=1, D=4, tp=8, fsdp=True, recompute=True, cluster="h100-4node")
    assert max(x.total for x in hybrid.stage_memory([(0, n)])) < cap


# ---- the search with strategies (planner/search.py, strategies="auto") ----------------------------
import random  # noqa: E402

from ptplan.planner.cluster import Cluster  # noqa: E402
from ptplan.planner.config import TrainingConfig  # noqa: E402
from ptplan.planner.errors import InfeasibleError  # noqa: E402
from ptplan.planner.search import PhaseSearch, Visit, exhaustive  # noqa: E402
from tests.test_search import random_case  # noqa: E402


@pytest.mark.parametrize("seed", range(4))
def test_search_with_strategies_picks_what_exhaustive_simulation_picks(seed):
    """Every candidate (K, M, cache, schedule, tp, fsdp, rc) split and simulated: the bounded search agrees."""
    rng = random.Random(100 + seed)
    compared = 0
    for _ in range(6):
        prof, cluster, cfg = random_case(rng)
        for f in sorted({0, rng.randint(0, prof.num_blocks)}):
            visit = Visit(samples=float(cfg.samples_per_epoch), fill_from=0)
            ref = exhaustive(PhaseSearch(prof, cluster, cfg, strategies="auto"), f, visit)
            s = PhaseSearch(prof, cluster, cfg, strategies="auto")
            if ref is None:
                with pytest.raises(InfeasibleError):
                    s.search(f, visit)
                continue
            got = s.search(f, visit)
            assert (got.cand, got.ranges) == (ref.cand, ref.ranges), (seed, f, cfg)
            compared += 1
    assert compared >= 6


def test_strategies_off_is_the_old_search_and_auto_is_never_worse():
    prof = synthetic_profile(num_blocks=6, hidden=512, seq_len=128, vocab=4096)
    cluster = Cluster.uniform(nodes=2, gpus_per_node=4)
    cfg = TrainingConfig(epochs=2, samples_per_epoch=4096, batch=64)
    old, off, auto = PhaseSearch(prof, cluster, cfg), PhaseSearch(prof, cluster, cfg, strategies="off"), \
        PhaseSearch(prof, cluster, cfg, strategies="auto")
    assert off.strategies == (Strategy(),) and len(auto.strategies) == 20  # tp 1, 2, 4 x fsdp x rc; tp 2, 4 with sp too
    for f in (0, 3, 6):
        v = Visit(samples=4096.0)
        a, b, c = old.search(f, v), off.search(f, v), auto.search(f, v)
        assert (a.cand, a.ranges, a.objective) == (b.cand, b.ranges, b.objective)
        assert c.objective <= a.objective * (1 + 1e-12)


def test_memory_bound_model_is_refused_without_strategies_and_planned_with_them():
    """The layer larger than an H100 (test above): pipeline x DP refuses with the numbers, auto plans it."""
    prof = synthetic_profile(num_blocks=2, hidden=32768, seq_len=1024, vocab=32000, batch_sizes=(1, 2, 4))
    cluster = get_preset("h100-4node")
    cfg = TrainingConfig(epochs=1, samples_per_epoch=1024, batch=32, allow_extrapolation=True)
    with pytest.raises(InfeasibleError, match=r"(?s)layer 2 alone needs 16\d\.\d\d GiB \(the least .*\) but one device "
                                              r"has 72\.00 GiB"
                                              r".*--strategies auto"):
        PhaseSearch(prof, cluster, cfg).search(0, Visit(samples=64.0))
    got = PhaseSearch(prof, cluster, cfg, strategies="auto").search(0, Visit(samples=64.0))
    # measured: tp4·fsdp, K=1, D=8, M=2, 65.0 GiB per GPU
    assert got.cand.tp > 1 or got.cand.fsdp
    assert max(m.total for m in got.memory) <= cluster.gpu_memory_bytes * cfg.memory_fraction


def test_an_infeasible_search_names_each_reasons_strategy_and_covers_every_K():
    """Hundreds of candidates fail; the eight reasons shown must say which strategy each is (before, "K=1, M=1: ..."
    repeated for the strategies of K = 1 alone, telling them apart by nothing), differ, and cover every K tried."""
    import re

    prof = synthetic_profile(num_blocks=4, hidden=16384, seq_len=1024, vocab=32000, batch_sizes=(1, 2, 4))
    cluster = Cluster.uniform(nodes=1, gpus_per_node=8, like="p3.16xlarge")
    cfg = TrainingConfig(epochs=1, samples_per_epoch=256, batch=64, allow_extrapolation=True)
    with pytest.raises(InfeasibleError) as e:
        PhaseSearch(prof, cluster, cfg, strategies="auto").search(0, Visit(samples=64.0))
    lines = [ln.strip() for ln in str(e.value).splitlines() if ln.strip().startswith("K=")]
    assert len(lines) == 8 and len(set(lines)) == 8, lines
    assert {int(re.match(r"K=(\d+)", ln).group(1)) for ln in lines} == {1, 2, 4, 8}
    tags = [ln.split(":", 1)[0] for ln in lines]
    assert any("per stage" in t or "tp" in t or "rc" in t or "fsdp" in t for t in tags), tags
    assert re.search(r"\(\+\d+ more\)", str(e.value))


def test_48_blocks_on_64_gpus_all_phases_prune_to_a_few_exact_evaluations():
    """Every phase of a 48-block model on 8 x 8 H100s with strategies: the bounds let only a small share of
    the ~44,000 candidates through to the exact split and the simulator (the time target, 5 s on the
    2-core box, is measured by ``python bench/plan_bench.py``: its ``hybrid`` row)."""
    prof = synthetic_profile(num_blocks=48, hidden=2048, batch_sizes=(1, 2, 4, 8, 16, 32))
    s = PhaseSearch(prof, Cluster.uniform(nodes=8, like="dgx-h100"),
                    TrainingConfig(epochs=10, samples_per_epoch=1_000_000, batch=1024), strategies="auto")
    total = sum(len(s.candidates(f, prof.frozen_boundary(f))[0]) for f in range(49))
    for f in range(49):
        s.search(f, Visit(samples=1e6))
    print(f"48 blocks, 64 GPUs, 49 phases, strategies auto: {s.evaluated} of {total} candidates evaluated")
    assert total > 10_000 and s.evaluated < total / 100
