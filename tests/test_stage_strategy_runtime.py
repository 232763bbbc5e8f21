"""A phase whose stages use different strategies (issue 14, per stage) runs for real: FSDP only on the positions
whose stage says so (their gradients reduce-scattered, the others' flat all-reduce kept), recomputation only
in the chunks whose stage says so -- 4 forked gloo processes through two transitions, equal to the
single-process reference of ``tests/test_runtime_parity.py``.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from ptplan.executor.runtime.groups import chunks_of, fsdp_chunks, locate
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import spec
from parity import assert_parity, once
from tests.test_hybrid_runtime import _mixed_plan, _optimizer_params
from tests.test_runtime_parity import COUNTS, LAYOUTS, OPT, SEED, STEPS_PER_PHASE, TOL, _build, _data, reference

pytestmark = pytest.mark.multiproc


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


MIXED = [((True, False), (True, False)),    # K=2, D=2: stage 0 fsdp·rc, stage 1 dp
         (True, False),                     # K=1, D=4: fsdp
         ((False, True), (True, False))]    # K=2, D=2: stage 0 rc, stage 1 fsdp
"""Per phase (fsdp, recompute), each a bool for every stage or a tuple with one per stage."""


def _plan(model):
    _, l1, l2 = LAYOUTS[model.name]
    # micro-batches per global batch 4, 4, 8: the reference's (``CHUNKS``)
    return _mixed_plan(model, [spec(0, K=2, D=2, M=2, b=2, ranks=l1, schedule="1f1b"),
                               spec(1, K=1, D=4, M=1, b=2, ranks=l2, schedule="1f1b"),
                               spec(2, K=2, D=2, M=4, b=1, ranks=l1, schedule="1f1b")], MIXED)


def _plan_layerwise(model):
    """``_plan`` with Galvatron's layer-wise recomputation: phase 0's stage 0 (5 layers) recomputes only its first
    2, phase 2's stage 0 (3 layers) only its first one."""
    import dataclasses

    from ptplan.planner.plan import plan_from_json

    plan = _plan(model)
    layers = {0: (2, 0), 2: (1, 0)}
    phases = tuple(dataclasses.replace(ph, recompute_layers=layers.get(i, ())) for i, ph in enumerate(plan.phases))
    plan = dataclasses.replace(plan, phases=phases)
    return plan_from_json(json.loads(json.dumps(plan.to_json())), source="test plan")


MIXED_V2 = [((True, False, False, True), (True, False, True, False)),  # K=2, V=2: position 0 runs chunks 0
            (False, True),                                              # (fsdp·rc) and 2 (rc), position 1
            ((True, False), (False, True))]                             # chunks 1 (dp) and 3 (fsdp)
"""Interleaved 1F1B: per chunk, so one rank shards some of its layers and all-reduces the others."""


def _plan_v2(model):
    _, l1, l2 = LAYOUTS[model.name]
    return _mixed_plan(model, [spec(0, K=2, D=2, M=2, b=2, ranks=l1, schedule="interleaved-1f1b", V=2),
                               spec(1, K=1, D=4, M=1, b=2, ranks=l2, schedule="interleaved-1f1b", V=2),
                               spec(2, K=1, D=4, M=2, b=1, ranks=l2, schedule="interleaved-1f1b", V=2)], MIXED_V2)


def _fsdp_params() -> int:
    """Parameters in this process's optimizer that FSDP manages (DTensors on a mesh with a ``dp`` dimension)."""
    from tests.test_hybrid_runtime import live_optimizer
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) and "dp" in (p.device_mesh.mesh_dim_names or ())
               for g in live_optimizer().param_groups for p in g["params"])


def _run(name, optimizer, data, tmp, plan, world: int = 4):
    """The parity run, recording per rank after each step what its optimizer holds sharded (and how many of
    those parameters FSDP manages) and which layer ranges ran under ``torch.utils.checkpoint`` in that step."""
    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.data.dataset import TensorDataset
    from parity import recorded_run

    model = _build(name)
    o = OPT[optimizer]
    cfg = RunConfig(plan="(test)", model=name, optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                    weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=SEED,
                    freeze_every=STEPS_PER_PHASE, steps_per_epoch=len(COUNTS), epochs=1, progress=False,
                    timeout_s=60, log=os.path.join(tmp, "run.jsonl"), cache="off")

    seen: set[tuple[int, int]] = set()  # per child (forked): the layer ranges checkpointed since the last step

    def before(rank: int) -> None:
        import torch.utils.checkpoint as ck

        real = ck.checkpoint

        def counting(fn, *args, **kw):  # StageModule passes its bound ``_run_active``
            mod = fn.__self__
            seen.add((mod.lo, mod.hi))
            return real(fn, *args, **kw)

        ck.checkpoint = counting

    def record(step: int, r: int) -> list:
        got = [step, *_optimizer_params(r), sorted(seen), _fsdp_params()]
        seen.clear()
        return got

    snaps, per_rank = recorded_run(cfg, plan, model, TensorDataset(*data), world=world, tmpdir=tmp, before=before,
                                   record=record, deadline_s=240)
    return snaps, cfg.log, per_rank


def _check(name, optimizer, plan, tmp, world: int = 4, chunks=None) -> float:
    """Parity with the reference after every transition and at the end, every step's loss; per rank and step:
    FSDP manages parameters exactly on the positions whose stage says fsdp (and shards them 1/D), tp splits
    every position's, and exactly the chunks whose stage recomputes ran under ``checkpoint``."""
    data = _data(_build(name))
    snaps, log, per_rank = _run(name, optimizer, data, str(tmp), plan, world)
    for r in range(world):
        assert [x[0] for x in per_rank[r]] == list(range(1, 7))
        for step, n, loc, full, ran, n_fsdp in per_rank[r]:
            ph = plan.phases[COUNTS[step - 1]]
            k = locate(ph, r).stage
            if fsdp_chunks(ph, k):  # this position's stage is FSDP-sharded: 1/D of each parameter
                assert n_fsdp > 0 and loc < full and (ph.tp > 1 or loc <= -(-full // ph.D) + n), (r, step, n, loc, full)
            else:  # a plain data-parallel (or tp-only) stage of the same phase: nothing FSDP manages
                assert n_fsdp == 0 and (n > 0) == (ph.tp > 1), (r, step, n, n_fsdp)
            want = sorted([ph.partition[c][0], ph.partition[c][0] + ph.recompute_layers_at(c)]
                          if ph.recompute_layers_at(c) else list(ph.partition[c])
                          for c in chunks_of(ph, k) if ph.recompute_at(c))
            assert ran == want, (r, step, ran, want)  # checkpointed exactly where (and what) its stage recomputes
    key = ("reference", name, optimizer) + (() if chunks is None else (tuple(sorted(chunks.items())),))
    kw = {} if chunks is None else {"chunks": chunks}
    ref, ref_losses = once(key, lambda: reference(name, optimizer, data, **kw))
    assert sorted(snaps) == [0, 2, 4, 6], sorted(snaps)
    worst = assert_parity(snaps, ref, (2, 4, 6), TOL[optimizer])
    steps = [x for x in read_records(log) if x["type"] == "step"]
    assert len(steps) == len(ref_losses)
    for x, want in zip(steps, ref_losses):
        assert math.isclose(x["loss"], want, rel_tol=1e-5), (x["step"], x["loss"], want)
    trans = [x for x in read_records(log) if x["type"] == "transition"]
    assert trans[0]["bytes"]["optimizer_state"] > 0, trans
    return worst


@pytest.mark.parametrize("name,optimizer,V", [("bert-tiny", "sgd", 1), ("bert-tiny", "adamw", 1), ("gpt2-tiny", "sgd", 1),
                                              ("gpt2-tiny", "adamw", 1), ("bert-tiny", "sgd", 2),
                                              ("bert-tiny", "adamw", "layerwise"), ("gpt2-tiny", "sgd", "layerwise")])
def test_per_stage_strategies_through_transitions_match_reference(name, optimizer, V, tmp_path):
    plan = {1: _plan, 2: _plan_v2, "layerwise": _plan_layerwise}[V](_build(name))
    assert [ph.mixed for ph in plan.phases] == [True, False, True]
    assert plan.phases[0].strategy_label == {1: "stages fsdp·rc | dp", 2: "stages fsdp·rc | dp | rc | fsdp",
                                             "layerwise": "stages fsdp·rc2 | dp"}[V]
    worst = _check(name, optimizer, plan, tmp_path)
    print(f"parity per-stage strategies {name} {plan.phases[0].schedule} {optimizer} {plan.phases[0].strategy_label} "
          f"-> {plan.phases[2].strategy_label}: max relative difference {worst:.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_per_stage_fsdp_next_to_tensor_parallel_on_eight_processes_matches_reference(optimizer, tmp_path):
    """llama-tiny on 8 processes, K x D x tp = 2 x 2 x 2: stage 0 tp2 x FSDP (2-D mesh), stage 1 tp2 with
    recomputation; then plain data parallel (K=2, D=4); then stage 0 tp2 with recomputation, stage 1 tp2 x FSDP."""
    plan = _mixed_plan(_build("llama-tiny"), [spec(0, K=2, D=2, M=2, b=2, schedule="1f1b"),
                                              spec(1, K=2, D=4, M=2, b=1, schedule="1f1b"),
                                              spec(2, K=2, D=2, M=2, b=2, schedule="1f1b")],
                       [(2, (True, False), (False, True)), (1, False, False), (2, (False, True), (True, False))])
    assert [ph.strategy_label for ph in plan.phases] == ["tp2 · stages fsdp | rc", "dp", "tp2 · stages rc | fsdp"]
    worst = _check("llama-tiny", optimizer, plan, tmp_path, world=8, chunks={0: 4, 1: 8, 2: 4})
    print(f"parity per-stage strategies with tp2, 8 processes, llama-tiny 1f1b {optimizer}: max relative "
          f"difference {worst:.1e}")


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
def test_recomputing_the_first_layers_keeps_their_input_and_the_others_activations(name):
    """Galvatron's layer-wise choice (``Phase.recompute_layers``, ``runtime.recompute_first``): a middle stage
    with M=3 micro-batches in flight that recomputes its first r=2 layers saves their input and the other
    layers' activations as the profiler measured them -- ``planner/stage.py``'s per_mb = b * (out[lo-1] +
    sum saved[lo+r:hi]) --, reruns only those r layers in each backward, and gives the same gradients."""
    from ptplan.executor.profiling.live_bytes import memory_pass
    from ptplan.executor.runtime.stage import recompute_first
    from ptplan.executor.runtime.stage import StageModule
    from tests.test_hybrid_runtime import _saved_bytes_in_flight

    torch.manual_seed(0)
    model = _build(name)
    model.train()
    b, M, lo, hi, r = 2, 3, 1, len(model.layers) - 1, 2
    x, y, mask = model.make_batch(b * M, generator=torch.Generator().manual_seed(5))
    mem = memory_pass(model, x[:b], y[:b], None if mask is None else mask[:b], b)
    out, saved = mem.output, mem.saved
    with torch.no_grad():
        h = model.layers[0](x, attention_mask=mask)
    xs = [t.detach().requires_grad_(True) for t in h.chunk(M)]
    ms = mask.chunk(M) if mask is not None else [None] * M
    grads, got = {}, {}
    for first in (0, r):
        stage = StageModule(model.layers, lo, hi, 0)
        if first:
            recompute_first(stage, first)
        calls = [0, 0]
        hooks = [model.layers[lo].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)),
                 model.layers[lo + r].register_forward_pre_hook(lambda *_: calls.__setitem__(1, calls[1] + 1))]
        nbytes, outs = _saved_bytes_in_flight(stage, xs, ms)
        fwd = list(calls)
        for o in outs:
            o.float().pow(2).mean().backward()
        for hk in hooks:
            hk.remove()
        got[first] = (nbytes, fwd, [calls[0] - fwd[0], calls[1] - fwd[1]])
        grads[first] = {p: p.grad.clone() for p in stage.parameters()}
        stage.zero_grad(set_to_none=True)
    want = b * M * (out[lo - 1] + sum(saved[lo + r:hi])) + (0 if mask is None else mask.untyped_storage().nbytes())
    print(f"{name}: saved in flight recomputing the first {r} layers {got[r][0]} B (model: {want} B), "
          f"all kept {got[0][0]} B")
    assert got[r][0] == pytest.approx(want, rel=0.02), (got[r][0], want)
    assert got[r][0] < got[0][0]
    assert got[0][1:] == ([M, M], [0, 0]) and got[r][1:] == ([M, M], [M, 0])  # only the first r layers rerun
    for p in grads[0]:
        torch.testing.assert_close(grads[r][p], grads[0][p], rtol=1e-6, atol=1e-8)
