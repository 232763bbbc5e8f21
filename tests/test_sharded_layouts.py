"""Sharded checkpoints across layouts (issue 23 item 2): saved on a pipeline, resumed on FSDP, saved there and
resumed on tensor parallelism -- the same two processes, three ways of holding the model.

Pinned, at each resume: every weight and optimizer-state tensor right after loading equals the saved one exactly
(the gathered full tensors: FSDP's shards and tp's halves are gathered back before comparing), and the chain
pipeline -> FSDP -> tp ends where the uninterrupted pipeline run ends (the runtime parity tests' SGD tolerance:
each layout sums the gradients in another order).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from parity import max_rel_diff
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.training.runlog import read_records
from test_hybrid_runtime import with_strategies
from test_sharded_checkpoint import TOL, _cfg, _model, _run, _saved

pytestmark = pytest.mark.multiproc

LAYOUTS = {
    # name: (per phase (0 and 1 frozen blocks): K, D, M, micro-batch; strategy per phase as with_strategies takes it)
    "pipeline": ([(2, 1, 2, 4), (1, 2, 1, 4)], [(1, False, False), (1, False, False)]),
    "fsdp": ([(1, 2, 1, 4), (1, 2, 1, 4)], [(1, True, False), (1, True, False)]),
    "tp": ([(1, 1, 2, 4), (1, 1, 2, 4)], [(2, False, False), (2, False, False)]),
}
"""Every layout runs on 2 processes with a global batch of 8 (D·M·b), so any of them continues another's run."""


def _layout_plan(model, name: str):
    shapes, strategies = LAYOUTS[name]
    phases = [spec(f, K=K, D=D, M=M, b=b) for f, (K, D, M, b) in enumerate(shapes)]
    plan = make_plan(model, phases, trajectory=[0, 1], samples_per_epoch=16)
    return with_strategies(plan, strategies)


def _flat(path: str) -> dict[str, torch.Tensor]:
    loaded = torch.load(path)
    return {**loaded["weights"], **{f"optim.{n}.{k}": v for n, st in loaded["state"].items() for k, v in st.items()}}


def test_a_run_moves_from_a_pipeline_to_fsdp_to_tensor_parallel_and_ends_where_it_would_have(tmp_path,
                                                                                               one_torch_thread):
    model = _model()
    data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
    tmp, ck = str(tmp_path), str(tmp_path / "ck")
    plans = {name: _layout_plan(model, name) for name in LAYOUTS}
    sizes = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model.layers]
    whole = sum(sizes) + sum(sizes[plans["fsdp"].phases[1].frozen_layers:])  # weights + active layers' momentum
    for plan in plans.values():
        assert {ph.world for ph in plan.phases} == {2}
    want = _run(tmp, 2, _cfg(tmp, "ref", freeze_every=5, epochs=5, momentum=0.9), plans["pipeline"], model, data)

    chain = [("pipeline", 2), ("fsdp", 4), ("tp", 5)]  # (layout, the epoch it runs to): steps 4, 8, then 10
    got = None
    for i, (name, epochs) in enumerate(chain):
        loaded = os.path.join(tmp, f"loaded-{name}.pt")
        saved = None
        if i > 0:  # what the previous layout saved, read back in this process before the resume
            meta = json.load(open(os.path.join(ck, "sharded.json")))
            assert meta["world_size"] == 2 and meta["position"]["global_step"] == 2 * chain[i - 1][1]
            shutil.copytree(ck, tmp_path / f"saved-{i}")
            saved = _saved(str(tmp_path / f"saved-{i}" / meta["folder"]))
            if chain[i - 1][0] == "fsdp":  # written as FSDP's shards: each rank half the state, none gathered it
                assert sum(meta["bytes"]) == whole and max(meta["bytes"]) < 0.55 * whole, (meta["bytes"], whole)
        cfg = _cfg(tmp, "chain", freeze_every=5, epochs=epochs, momentum=0.9, checkpoint_dir=ck, resume=i > 0,
                   async_checkpoint=name == "fsdp")  # FSDP's shards staged by DCP's async save
        got = _run(tmp, 2, cfg, plans[name], model, data, loaded=loaded if i > 0 else None)
        if saved is not None:
            flat = _flat(loaded)
            assert sorted(flat) == sorted(saved), name
            for k, v in saved.items():
                assert torch.equal(flat[k], v), (name, k)
    assert got is not None
    final = json.load(open(os.path.join(ck, "sharded.json")))  # step 10, written as tp's halves
    assert final["position"]["global_step"] == 10 and max(final["bytes"]) < 0.75 * whole, (final["bytes"], whole)
    written = _saved(os.path.join(ck, final["folder"]))
    assert all(torch.equal(written[k], v) for k, v in got.items())
    resumes = [r["step"] for r in read_records(os.path.join(tmp, "chain.jsonl")) if r["type"] == "resume"]
    assert resumes == [4, 8], resumes
    saves = [(r["step"], r["async"]) for r in read_records(os.path.join(tmp, "chain.jsonl")) if r["type"] == "checkpoint"]
    assert saves == [(2, False), (4, False), (6, True), (8, True), (10, False)], saves
    assert [ph.strategy_label for ph in plans["tp"].phases] == ["tp2", "tp2"]
    assert all(ph.any_fsdp for ph in plans["fsdp"].phases)
    d, where = max_rel_diff(got, want)
    assert d <= TOL, (d, where)
