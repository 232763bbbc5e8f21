"""Megatron's sequence parallelism in the runtime (issue 22 item 2): with ``Phase.sp`` the split layers' norms and
residual stream run on sequence shards (``executor/runtime/hybrid.py``: the norms' output all-gathered, the
row-parallel outputs reduce-scattered, the whole sequence gathered where a run of split layers ends).

Two gloo processes train tiny GPT-2 and tiny Llama through tp2·sp (K=1) -> a plain 2-stage pipeline -> tp2·sp with
recomputation and a split frozen prefix (K=1), equal to the single-process reference of
``tests/test_runtime_parity.py`` with SGD and AdamW; each rank's norms see S/tp tokens and the activations a split
layer saves for its backward shrink as ``planner/strategy.py`` prices them (all of them / tp with sp, only
Megatron's split part without); families without sp are refused at plan load and at run time.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import tests.test_runtime_parity as trp
from parity import assert_parity
from ptplan.executor.handplan import spec
from ptplan.executor.training.runlog import read_records
from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import plan_from_json
from tests.test_hybrid_runtime import _mixed_plan
from tests.test_tp_families import _builder, _run

CHUNKS = {0: 2, 1: 2, 2: 2}
"""Micro-batches per global batch of 8 in each phase (D*M)."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def with_sp(plan, flags):
    """``plan`` with phase i's ``sp`` = ``flags[i]``, validated as a loaded plan is."""
    phases = tuple(dataclasses.replace(ph, sp=s) for ph, s in zip(plan.phases, flags))
    plan = dataclasses.replace(plan, phases=phases)
    return plan_from_json(json.loads(json.dumps(plan.to_json())), source="test plan")


def sp_plan(model):
    """tp2·sp (K=1, M=2) -> plain K=2 pipeline -> tp2·sp·rc (K=1) with 2 frozen blocks run as split twins."""
    plan = _mixed_plan(model, [spec(0, K=1, D=1, M=2, b=4, schedule="1f1b"),
                               spec(1, K=2, D=1, M=2, b=4, schedule="1f1b"),
                               spec(2, K=1, D=1, M=2, b=4, schedule="1f1b")],
                       [(2, False, False), (1, False, False), (2, False, True)])
    return with_sp(plan, [True, False, True])


@pytest.mark.multiproc
@pytest.mark.parametrize("name,granularity,optimizer", [("gpt2-tiny", "half", "sgd"), ("gpt2-tiny", "block", "adamw"),
                                                        ("llama-tiny", "half", "adamw"), ("llama-tiny", "block", "sgd")])
def test_sequence_parallel_matches_reference(name, granularity, optimizer, tmp_path, monkeypatch):
    """tp2·sp -> K=2 -> tp2·sp·rc on 2 processes: weights after every transition and at the end within the
    parity tolerance of the single-process reference, every step's loss within 1e-5."""
    build = _builder(name, granularity)
    plan = sp_plan(build())
    assert [ph.strategy_label for ph in plan.phases] == ["tp2·sp", "dp", "tp2·sp·rc"]
    data, snaps, log, sharded = _run(build, optimizer, plan, str(tmp_path), 2)
    for r in range(2):  # the sp phases train split parameters (fewer local elements than full), the K=2 one none
        for step, n, loc, full in sharded[r]:
            sp = plan.phases[trp.COUNTS[step - 1]].sp
            assert (n > 0 and loc < full) if sp else n == 0, (r, step, n, loc, full)
    monkeypatch.setattr(trp, "_build", lambda _: build())  # the reference builds the same model
    ref, ref_losses = trp.reference(build().name, optimizer, data, chunks=CHUNKS)
    assert sorted(snaps) == [0, 2, 4, 6], sorted(snaps)
    worst = assert_parity(snaps, ref, (2, 4, 6), trp.TOL[optimizer])
    print(f"parity tp2·sp -> K2 -> tp2·sp·rc {name} {granularity} {optimizer}: max relative difference {worst:.1e}")
    steps = [r["loss"] for r in read_records(log) if r["type"] == "step"]
    assert steps == pytest.approx(ref_losses, rel=1e-5)


def test_sp_refused_for_families_without_it():
    """A plan asking sp of a post-LN family (BERT) is refused at load with the reason; so is sp without tp and a
    sequence length tp does not divide; ``tp_plan`` refuses it at run time too."""
    from ptplan.executor.families.models import build_model
    from ptplan.executor.runtime.hybrid import tp_plan
    from ptplan.planner.tp_split import sp_refusal

    bert = build_model("bert-tiny", granularity="half", dropout=0.0, seed=0, seq_len=8)
    plan = _mixed_plan(bert, [spec(0, K=1, D=1, M=2, b=4, schedule="1f1b")], [(2, False, False)])
    with pytest.raises(PtplanError, match=r"sp'.*only for the pre-LN families gpt2, llama, mistral, qwen2.*not a "
                                          r"bert model"):
        with_sp(plan, [True])
    assert "needs tp > 1" in sp_refusal("gpt2", 8, 1)
    assert "not a multiple of 4" in sp_refusal("gpt2", 10, 4)
    assert sp_refusal("llama", 8, 2) is None and sp_refusal("vit", 197, 2) is not None
    layer = next(layer for layer, s in zip(bert.layers, bert.specs) if s.kind == "attention")
    assert tp_plan(layer, 2) is not None
    with pytest.raises(PtplanError, match="sequence parallelism cannot run a BertAttentionHalf"):
        tp_plan(layer, 2, sp=True)


def test_every_sp_family_names_its_norms():
    """The families ``FamilyFacts.sequence_parallel`` marks (GPT-2, Llama, Mistral, Qwen2) name every split layer's
    pre-LN norms, which exist in the layer; the others name none (the planner never offers them sp)."""
    from ptplan.executor.families import registry
    from ptplan.planner.families import SP_FAMILIES

    for fam_name, fam in registry.families().items():
        for cls, split in fam.tp_splits.items():
            assert bool(split.norms) == (fam_name in SP_FAMILIES), (fam_name, cls.__name__)
    for name in ("gpt2-tiny", "llama-tiny", "mistral-tiny", "qwen2-tiny"):
        for g in ("half", "block"):
            model = _builder(name, g)()
            for layer in model.layers:
                split = registry.tp_split(layer)
                for path in split.norms if split else ():
                    assert "norm" in type(layer.get_submodule(path)).__name__.lower(), (name, path)
