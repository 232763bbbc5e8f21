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

from ptplan.executor.groups import chunks_of, fsdp_chunks, locate
from ptplan.executor.runlog import read_records
from ptplan.executor.testing import assert_parity, spec
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
    from tests.test_hybrid_runtime import _OPTIMIZER
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) and "dp" in (p.device_mesh.mesh_dim_names or ())
               for g in _OPTIMIZER[0].param_groups for p in g["params"])


def _run(name, optimizer, data, tmp, plan, world: int = 4):
    """The parity run, recording per rank after each step what its optimizer holds sharded (and how many of
    those parameters FSDP manages) and which layer ranges ran under ``torch.utils.checkpoint`` in that step."""
    from ptplan.executor.config import RunConfig
    from ptplan.executor.data import TensorDataset
    from ptplan.executor.testing import run_world
    from ptplan.executor.training import Hooks, run_training

    model = _build(name)
    o = OPT[optimizer]
    cfg = RunConfig(plan="(test)", model=name, optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                    weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=SEED,
                    freeze_every=STEPS_PER_PHASE, steps_per_epoch=len(COUNTS), epochs=1, progress=False,
                    timeout_s=60, log=os.path.join(tmp, "run.jsonl"), cache="off")

    def worker(rank: int, world: int) -> None:
        import torch.utils.checkpoint as ck

        seen: set[tuple[int, int]] = set()
        real = ck.checkpoint

        def counting(fn, *args, **kw):  # StageModule passes its bound ``_run_active``
            mod = fn.__self__
            seen.add((mod.lo, mod.hi))
            return real(fn, *args, **kw)

        ck.checkpoint = counting

        def save(event: str, step: int, weights) -> None:
            torch.save(weights, os.path.join(tmp, f"snap-{step}-{event}.pt"))

        def after(step: int, r: int) -> None:
            with open(os.path.join(tmp, f"rank-{r}.jsonl"), "a") as fh:
                fh.write(json.dumps([step, *_optimizer_params(r), sorted(seen), _fsdp_params()]) + "\n")
            seen.clear()

        run_training(cfg, plan, model, TensorDataset(*data), hooks=Hooks(snapshots=True, on_snapshot=save,
                                                                          after_step=after))

    res = run_world(world, worker, tmpdir=tmp, timeout_s=60, deadline_s=240)
    assert res.ok, res.explain()
    snaps = {int(f.split("-")[1]): torch.load(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("snap-")}
    per_rank = {r: [json.loads(x) for x in open(os.path.join(tmp, f"rank-{r}.jsonl"))] for r in range(world)}
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
            want = sorted(list(ph.partition[c]) for c in chunks_of(ph, k) if ph.recompute_at(c))
            assert ran == want, (r, step, ran, want)  # checkpointed exactly where its stage recomputes
    ref, ref_losses = reference(name, optimizer, data, **({} if chunks is None else {"chunks": chunks}))
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
                                              ("gpt2-tiny", "adamw", 1), ("bert-tiny", "sgd", 2)])
def test_per_stage_strategies_through_transitions_match_reference(name, optimizer, V, tmp_path):
    plan = (_plan if V == 1 else _plan_v2)(_build(name))
    assert [ph.mixed for ph in plan.phases] == [True, False, True]
    assert plan.phases[0].strategy_label == ("stages fsdp·rc | dp" if V == 1 else "stages fsdp·rc | dp | rc | fsdp")
    worst = _check(name, optimizer, plan, tmp_path)
    print(f"parity per-stage strategies {name} {plan.phases[0].schedule} {optimizer}: max relative difference "
          f"{worst:.1e}")


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
