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


def _run(name, optimizer, data, tmp, plan):
    """The parity run, recording per rank after each step what its optimizer holds sharded and which layer
    ranges ran under ``torch.utils.checkpoint`` in that step."""
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
                fh.write(json.dumps([step, *_optimizer_params(r), sorted(seen)]) + "\n")
            seen.clear()

        run_training(cfg, plan, model, TensorDataset(*data), hooks=Hooks(snapshots=True, on_snapshot=save,
                                                                          after_step=after))

    res = run_world(4, worker, tmpdir=tmp, timeout_s=60, deadline_s=150)
    assert res.ok, res.explain()
    snaps = {int(f.split("-")[1]): torch.load(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("snap-")}
    per_rank = {r: [json.loads(x) for x in open(os.path.join(tmp, f"rank-{r}.jsonl"))] for r in range(4)}
    return snaps, cfg.log, per_rank


@pytest.mark.parametrize("name,optimizer,V", [("bert-tiny", "sgd", 1), ("bert-tiny", "adamw", 1), ("gpt2-tiny", "sgd", 1),
                                              ("gpt2-tiny", "adamw", 1), ("bert-tiny", "sgd", 2)])
def test_per_stage_strategies_through_transitions_match_reference(name, optimizer, V, tmp_path):
    data = _data(_build(name))
    plan = (_plan if V == 1 else _plan_v2)(_build(name))
    assert [ph.mixed for ph in plan.phases] == [True, False, True]
    assert plan.phases[0].strategy_label == ("stages fsdp·rc | dp" if V == 1 else "stages fsdp·rc | dp | rc | fsdp")
    snaps, log, per_rank = _run(name, optimizer, data, str(tmp_path), plan)
    for r in range(4):
        assert [s[0] for s in per_rank[r]] == list(range(1, 7))
        for step, n, loc, full, ran in per_rank[r]:
            ph = plan.phases[COUNTS[step - 1]]
            k = locate(ph, r).stage
            if fsdp_chunks(ph, k):  # this position's stage is FSDP-sharded: 1/D of each parameter
                assert n > 0 and loc < full and loc <= -(-full // ph.D) + n, (r, step, n, loc, full)
            else:  # a plain data-parallel stage of the same phase: nothing sharded
                assert n == 0, (r, step, n)
            want = sorted(list(ph.partition[c]) for c in chunks_of(ph, k) if ph.recompute_at(c))
            assert ran == want, (r, step, ran, want)  # checkpointed exactly where its stage recomputes
    ref, ref_losses = reference(name, optimizer, data)
    assert sorted(snaps) == [0, 2, 4, 6], sorted(snaps)
    worst = assert_parity(snaps, ref, (2, 4, 6), TOL[optimizer])
    print(f"parity per-stage strategies {name} {plan.phases[0].schedule} {optimizer}: max relative difference "
          f"{worst:.1e}")
    steps = [x for x in read_records(log) if x["type"] == "step"]
    for x, want in zip(steps, ref_losses):
        assert math.isclose(x["loss"], want, rel_tol=1e-5), (x["step"], x["loss"], want)
    trans = [x for x in read_records(log) if x["type"] == "transition"]
    assert trans[0]["bytes"]["optimizer_state"] > 0, trans
