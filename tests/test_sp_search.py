"""Sequence parallelism in the planner (issue 22 item 2): its communication priced as the all-reduce it replaces
(an all-gather and a reduce-scatter of the same bytes, by hand), its activations divided as the runtime divides
them, the candidate families ``strategy.search_modes`` offers (sp beside every tp > 1 family, only where
``tp_split.sp_refusal`` allows it), and ``--strategies auto`` choosing it where memory binds (pure, no torch)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ptplan.planner.cluster import PRESETS
from ptplan.planner.costs import CostTable
from ptplan.planner.strategy import Strategy, saved_share, search_modes, search_strategies, strategy_table, \
    tp_allreduce_coeffs
from ptplan.planner.synthetic import synthetic_profile


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sp_communication_is_the_allreduce_it_replaces_by_hand(tp):
    """Per split layer and micro-batch of b samples with output bytes O per sample: Megatron's all-reduce of b·O
    bytes over tp ranks of a node (ring: 2·(tp − 1) steps of latency + b·O/tp bytes) costs what sp's all-gather plus
    reduce-scatter (tp − 1 such steps each) cost; forward and backward add one per half (two per block) and are the
    same with and without sp; only the saved activations differ."""
    prof = synthetic_profile(num_blocks=2, hidden=1024, seq_len=512, heads=16, dtype_bytes=2)
    table = CostTable(prof)
    cl = PRESETS["dgx-h100"]
    ar = tp_allreduce_coeffs(cl, tp)
    plain = strategy_table(table, Strategy(tp=tp), 1, ar, (0.0, 0.0))
    sp = strategy_table(table, Strategy(tp=tp, sp=True), 1, ar, (0.0, 0.0))
    bw, lat = cl.intra_bandwidth, cl.intra_latency_s
    for i, r in enumerate(prof.layers):
        for j, b in enumerate(table.batch_sizes):
            nbytes = b * table.out_per_sample[i]
            gather = scatter = (tp - 1) * (lat + nbytes / tp / bw)  # ring all-gather, ring reduce-scatter
            n = {"attention": 1, "mlp": 1, "block": 2}.get(r.kind, 0)
            div = tp if n else 1
            for got, base in ((sp._fwd, table._fwd), (sp._bwd, table._bwd), (sp._nog, table._nog)):
                assert got[i, j] == pytest.approx(base[i, j] / div + n * (gather + scatter), rel=1e-12)
    for name in ("_fwd", "_bwd", "_nog", "_bww", "param_bytes", "grad_bytes", "optimizer_s"):
        np.testing.assert_array_equal(getattr(sp, name), getattr(plain, name))
    split = np.array([r.kind in ("attention", "mlp") for r in prof.layers])
    assert (sp.saved_per_sample[split] < plain.saved_per_sample[split]).all()
    np.testing.assert_array_equal(sp.saved_per_sample[~split], table.saved_per_sample[~split])


def test_sp_saved_share_by_hand():
    """u + (1 − u)/tp with Megatron's units (s·b·h): attention 5 of 13 + 5·a·s/h unsplit with tp alone, only the
    gathered q/k/v input (2) with sp; MLP 5 of 21, with sp 2."""
    x = 5.0 * 16 * 512 / 1024  # 5·a·s/h = 40
    assert saved_share("attention", 2, False, x) == pytest.approx(5 / 53 + 48 / 53 / 2)
    assert saved_share("attention", 2, True, x) == pytest.approx(2 / 53 + 51 / 53 / 2)
    assert saved_share("mlp", 4, False, 0.0) == pytest.approx(5 / 21 + 16 / 21 / 4)
    assert saved_share("mlp", 4, True, 0.0) == pytest.approx(2 / 21 + 19 / 21 / 4)
    assert saved_share("block", 8, True, x) == pytest.approx(4 / 74 + 70 / 74 / 8)


def test_search_modes_offer_sp_beside_every_tp_where_it_runs():
    """With auto: the families before (every tp, its 7 FSDP x recomputation modes, in the old order), then each
    tp > 1 again with sp for the families that run it and a sequence length tp divides; never for BERT, ViT or a
    custom model; off: plain data parallel only."""
    old = [(t, f, r, False) for t in (1, 2, 4) for f, r in ((0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (2, 2), (1, 2))]
    gpt = search_modes([1, 2, 4], True, "gpt2", 128)
    assert [m for m in gpt if not m[3]] == old
    assert sorted({m[0] for m in gpt if m[3]}) == [2, 4] and len([m for m in gpt if m[3]]) == 14
    for fam in ("bert", "roberta", "distilbert", "electra", "vit", "custom", None):
        assert not any(m[3] for m in search_modes([1, 2, 4], True, fam, 128)), fam
    assert {m[0] for m in search_modes([1, 2, 4], True, "llama", 6) if m[3]} == {2}  # 6 tokens: not over 4 ranks
    assert search_modes([1], False, "gpt2", 128) == ((1, 0, 0, False),)
    sts = search_strategies(gpt)
    assert sts[0] == Strategy() and Strategy(tp=4, sp=True, fsdp=True) in sts and len(sts) == 4 * 5
    assert "tp2·sp·rc" in {s.label for s in sts}


# ---- the search ----------------------------------------------------------------------------------------------------

def _search(gib: float, batch: int, family: str | None = None):
    """Phase 0 of the shipped GPT-2 H100 profile on one DGX H100 whose GPUs have ``gib`` GiB, ``--strategies auto``
    (``family``: the profile's family replaced, e.g. by one without sp)."""
    from pathlib import Path

    from ptplan.planner.candidate import Visit
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.profile import load_profile
    from ptplan.planner.search import PhaseSearch

    prof = load_profile(Path(__file__).parents[1] / "profiles" / "gpt2_h100_bf16.json")
    if family is not None:
        prof = dataclasses.replace(prof, model=dataclasses.replace(prof.model, family=family))
    cl = dataclasses.replace(PRESETS["dgx-h100"], gpu_memory_bytes=int(gib * 2**30))
    cfg = TrainingConfig(epochs=1, samples_per_epoch=50000, batch=batch, schedule="1f1b")
    ps = PhaseSearch(prof, cl, cfg, strategies="auto")
    return ps, ps.search(0, Visit(samples=50000.0))


def test_auto_chooses_sp_where_memory_binds_and_never_offers_it_without_the_runtime():
    """GPT-2 (bf16, 8 H100s limited to 1.0-1.3 GiB each, batch 32): with sp on offer the search is never slower than
    the same search under a family without sp, and where memory binds hardest it takes tp2·sp, over 1 % faster
    than the best it finds without (which plain tp2 then has to take on a worse split; on the profile of
    2026-11-27 sp wins at 1.15-1.25 GiB, by up to 6.6 %, and plain tp2 at 1.05, 1.1 and 1.3); with 2 GiB, memory
    does not bind and it keeps plain tp (ties go to the simpler strategy); a family without sp never gets an sp
    candidate."""
    wins = []
    for gib in (1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3):
        ps, ch = _search(gib, 32)
        _, without = _search(gib, 32, family="custom-gpt")
        assert not without.cand.sp
        assert ch.objective <= without.objective * (1 + 1e-12), (gib, ch.label, without.label)
        if ch.cand.sp:
            assert ch.cand.tp == 2 and ch.label.startswith("tp2·sp"), ch.label
            wins.append(without.objective / ch.objective)
    assert wins and max(wins) > 1.01, wins
    assert not _search(2.0, 32)[1].cand.sp
    assert not any(m[3] for m in _search(2.0, 32, family="bert")[0].modes)


# ---- by hand: sp taken exactly where it makes the phase fit -------------------------------------------------------

def _one_node_of_two(limit: float, family: str = "gpt2"):
    """A 4-block synthetic GPT (h 256, S 1024, 4 heads, bf16, vocab 1000) on one node of 2 H100s whose usable memory
    (x the 0.9 memory fraction) is ``limit`` bytes, batch 1, 1F1B, ``--strategies auto``: one sample cannot split
    over D = 2 and 1F1B needs M >= K, so every candidate is K = 1, D = 1, tp = 2, M = 1, b = 1 -- plain, with sp,
    with recomputation (all or the first r layers), or sp and recomputation."""
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.search import PhaseSearch

    prof = synthetic_profile(num_blocks=4, hidden=256, seq_len=1024, heads=4, dtype_bytes=2, vocab=1000)
    if family != "gpt2":
        prof = dataclasses.replace(prof, model=dataclasses.replace(prof.model, family=family))
    cl = dataclasses.replace(PRESETS["dgx-h100"], nodes=1, gpus_per_node=2, gpu_memory_bytes=int(limit / 0.9) + 1)
    return PhaseSearch(prof, cl, TrainingConfig(epochs=1, samples_per_epoch=64, batch=1, schedule="1f1b"),
                       strategies="auto")


def test_sp_is_chosen_exactly_where_it_makes_the_phase_fit_by_hand():
    """The only difference sp makes to this phase's memory is the split layers' saved activations of its one
    micro-batch in flight: per attention half Megatron's 13 units + 5·a·s/h of scores keep 5 whole with tp alone and
    only the gathered linear input (2) with sp, per MLP half 5 of 21 and 2 -- so with b = 1 the peak falls by
    Σ saved·((u + (1 − u)/2) − (u_sp + (1 − u_sp)/2)), by hand; the activations bind (they exceed the optimizer's
    after-pipeline transient). With the usable memory halfway between the two peaks the search takes tp2·sp (no
    recomputation: sp costs no time, recomputation does) and its predicted peak is the sp peak; with room for plain
    tp2 it keeps plain tp2 (equal time: ties go to the simpler strategy). A family without sp (BERT's facts, the
    same layers) gets no sp candidate, and halfway nothing fits it (with one micro-batch in flight recomputation
    rebuilds the same activations: no smaller peak); with room for plain tp2 it plans that."""
    from ptplan.planner.candidate import Candidate, Visit
    from ptplan.planner.errors import InfeasibleError

    big = _one_node_of_two(80e9)
    prof, n = big.p, big.p.num_layers
    x = 5.0 * 4 * 1024 / 256  # 5·a·s/h = 80
    share = {"attention": ((5 + (8 + x) / 2) / (13 + x), (2 + (11 + x) / 2) / (13 + x)),
             "mlp": ((5 + 16 / 2) / 21, (2 + 19 / 2) / 21)}
    saved = {k: sum(r.saved_bytes_per_sample for r in prof.layers if r.kind == k) for k in share}
    drop = sum(saved[k] * (share[k][0] - share[k][1]) for k in share)
    mem = {sp: big.uniform_model(Candidate(K=1, D=1, M=1, b=1, cache=False, tp=2, sp=sp), 0).stage_memory([(0, n)])[0]
           for sp in (False, True)}
    assert mem[False].total - mem[True].total == pytest.approx(drop, abs=2)
    assert all(m.activations > m.transient and m.inflight == 1 for m in mem.values())
    assert drop > 0.03 * mem[False].total  # a window wide enough to sit in

    visit = Visit(samples=64.0)
    roomy = big.search(0, visit)
    assert roomy.cand.tp == 2 and not roomy.cand.sp and not roomy.cand.recompute and roomy.label == "tp2"
    mid = (mem[False].total + mem[True].total) / 2
    tight = _one_node_of_two(mid)
    ch = tight.search(0, visit)
    assert ch.cand.sp and ch.label == "tp2·sp", ch.label
    peak = max(ch.sim.rank_peak_memory_bytes)
    assert peak == pytest.approx(mem[True].total, abs=2) and peak <= tight.limit < mem[False].total
    assert ch.sim.iteration_s == pytest.approx(roomy.sim.iteration_s, rel=1e-12)  # sp costs no time

    bert = _one_node_of_two(mid, family="bert")
    assert {m[0] for m in bert.modes} == {1, 2} and not any(m[3] for m in bert.modes)
    assert not any(c.sp for c in bert.candidates(0, 0)[0])
    with pytest.raises(InfeasibleError):  # recomputation rebuilds the one micro-batch's activations: no help here
        bert.search(0, visit)
    assert _one_node_of_two(mem[False].total + 1, family="bert").search(0, visit).label == "tp2"


def test_a_planned_sp_phase_survives_the_plan_file_and_old_files_load():
    """``make_plan`` over the tight case above (no freezing policy, so a phase per frozen count) takes sp on the
    phase with nothing frozen only -- every frozen count frees enough memory for plain tp2 --, writes
    ``"sp": true`` there for the executor (``Phase.sp``, read by ``executor/runtime/elastic.py``) and omits it
    elsewhere; the JSON round trip keeps it, and a phase without the field (plan files from before sp) loads as
    sp = False."""
    import json

    from ptplan.planner.candidate import Candidate
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.plan import plan_from_json
    from ptplan.planner.planner import make_plan

    big = _one_node_of_two(80e9)
    peak = {sp: big.uniform_model(Candidate(K=1, D=1, M=1, b=1, cache=False, tp=2, sp=sp), 0).stage_memory(
        [(0, big.p.num_layers)])[0].total for sp in (False, True)}
    tight = _one_node_of_two((peak[False] + peak[True]) / 2)
    plan = make_plan(tight.p, tight.c, tight.cfg, FreezePolicy(policy="none"), strategies="auto")
    assert [ph.strategy_label for ph in plan.phases] == ["tp2·sp"] + ["tp2"] * 4
    obj = json.loads(json.dumps(plan.to_json()))
    assert [ph.get("sp") for ph in obj["phases"]] == [True] + [None] * 4
    assert [ph.sp for ph in plan_from_json(obj).phases] == [True] + [False] * 4
    del obj["phases"][0]["sp"]
    assert not any(ph.sp for ph in plan_from_json(obj).phases)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs", "zb-v"])
def test_no_sp_candidate_where_the_runtime_refuses_it(schedule):
    """On one node of 4 with V chunks per position: K = 1 (V = 2 or 4 chunks on one position) exists with and
    without tp but never with sp (``tp_split.sp_refusal``: the chunks would touch; the plan loader refuses such a
    phase); K = 2 gets sp beside plain tp2 where no rank holds two consecutive stages (interleaved, looped-bfs),
    never under zb-v, whose last position holds stages K - 1 and K (the runtime gathers the sequence only where
    a rank's run of split layers ends)."""
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.schedule import stage_to_rank
    from ptplan.planner.search import PhaseSearch
    from ptplan.planner.tp_split import sp_refusal

    prof = synthetic_profile(num_blocks=4, hidden=256, seq_len=1024, heads=4, dtype_bytes=2, vocab=1000)
    cl = dataclasses.replace(PRESETS["dgx-h100"], nodes=1, gpus_per_node=4)
    ps = PhaseSearch(prof, cl, TrainingConfig(epochs=1, samples_per_epoch=64, batch=8, schedule=schedule),
                     strategies="auto")
    got = {(c.K, c.V, c.tp, c.sp) for c in ps.candidates(0, 0)[0]}
    assert {(1, 2, 2, False), (1, 2, 4, False), (2, 2, 2, False)} <= got
    assert not any(sp and sp_refusal("gpt2", 1024, tp, K=K, V=V) for K, V, tp, sp in got)
    assert not any(sp for K, V, tp, sp in got if K == 1)
    if schedule == "zb-v":
        assert stage_to_rank("zb-v", 2, 2) == (0, 1, 1, 0) and not any(sp for *_, sp in got)
    else:
        assert {(2, 2, 2, True), (2, 4, 2, True)} <= got
