"""Typed run-log records (``planner/records.py``) against the reader's contract (``planner/runlog.py``):
one class per record type of ``FIELDS`` with the same keys and the same optional ones; every class's instances
pass ``parse_record`` and round-trip through JSON; and a real short run's log (one forked rank: two phases, the
AutoCache, evaluations, sharded checkpoints, an export, then a resume) holds only
records the classes make, each equal to its class's ``to_json``."""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any

import pytest
import torch

from ptplan.planner import records as R
from ptplan.planner.runlog import FIELDS, SCHEMA, parse_record

KIND_VALUES: dict[str, Any] = {"int": 3, "float": 0.5, "str": "x", "bool": True, "obj": {"a": 1}, "list": [1, 2]}


def _value(kind: str) -> Any:
    return KIND_VALUES[kind.rstrip("?")]


def _examples(cls: type[R.RunRecord]) -> list[R.RunRecord]:
    """An instance with only the keys FIELDS requires, and one with every optional key too (each a value of
    the field's FIELDS kind); the header's schema is the contract's."""
    spec = FIELDS[cls.TYPE]
    by_key = {R.json_key(f): f for f in dataclasses.fields(cls)}
    required = {by_key[k].name: _value(v) for k, v in spec.items() if not v.endswith("?")}
    every = {by_key[k].name: _value(v) for k, v in spec.items()}
    if cls.TYPE == "header":
        required["schema"] = every["schema"] = SCHEMA
    made = [cls(**every)]
    try:
        made.append(cls(**required))  # a class may require a key FIELDS marks optional (always written, null ok)
    except TypeError:
        pass
    return made


def test_one_class_per_record_type_with_the_contracts_keys():
    assert set(R.KINDS) == set(FIELDS)
    for kind, cls in R.KINDS.items():
        keys = {R.json_key(f): f for f in dataclasses.fields(cls)}
        assert set(keys) == set(FIELDS[kind]), kind
        for k, f in keys.items():
            optional = FIELDS[kind][k].endswith("?")
            # a field left out when None (default None) is one the reader may miss
            if f.default is None:
                assert optional, f"{kind}.{k} has default None but the reader requires it"
            if not optional:
                hint = typing.get_type_hints(cls)[f.name]
                assert not (isinstance(hint, types.UnionType) and type(None) in hint.__args__), (kind, k)


@pytest.mark.parametrize("kind", sorted(FIELDS))
def test_every_kind_passes_the_reader_and_round_trips(kind):
    cls = R.KINDS[kind]
    for rec in _examples(cls):
        obj = rec.to_json()
        assert obj["type"] == kind
        text = json.loads(json.dumps(obj))
        parsed = parse_record(text, what="test")
        assert parsed.type == kind and parsed.to_json() == obj
        assert R.record_from_json(text) == rec


def test_none_rules_and_refusals():
    step = R.StepRecord(epoch=0, step=1, phase=0, frozen_blocks=0, K=1, D=1, seconds=0.1, samples=4, loss=1.0)
    assert "lr" not in step.to_json() and "memory" not in step.to_json()  # left out while None
    fd = R.FreezeDecisionRecord(step=2, T=1, from_frozen=0, to_frozen=1, alpha=0.5, grad_norms=None,
                                steps_measured=0)
    assert fd.to_json()["grad_norms"] is None  # no default: always written
    ck = R.CheckpointRecord(step=2, format="sharded", async_=False, path="p", seconds=0.1, bytes_max=1, bytes_total=2)
    assert ck.to_json()["async"] is False and "async_" not in ck.to_json()
    with pytest.raises(TypeError, match="unknown keys"):
        R.record_from_json({"type": "epoch_end", "epoch": 0, "steps": 1, "reason": "r", "extra": 1})
    with pytest.raises(TypeError, match="no run-log record class"):
        R.record_from_json({"type": "nope"})


# -- a real short run -----------------------------------------------------------------------------------------

def real_run(tmp: str, *, resume: bool = False, epochs: int = 2) -> str:
    """One forked rank: bert-tiny, phase 0 (b=4) then phase 1 (cached, M=2); 16 samples, 4 steps an epoch,
    evaluations every 2 steps and at each epoch's end,
    sharded checkpoints every 2 steps, the final model exported. Returns the run log's path."""
    from ptplan.executor.data.dataset import TensorDataset
    from ptplan.executor.families.models import build_model
    from ptplan.executor.handplan import make_plan, spec
    from ptplan.executor.launch.local import run_world
    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.training.loop import run_training

    cache_dir = os.path.join(tmp, "cache")
    os.makedirs(cache_dir, exist_ok=True)
    cfg = RunConfig(plan="(test)", model="bert-tiny", optimizer="sgd", lr=0.05, epochs=epochs, steps_per_epoch=4,
                    progress=False, timeout_s=30, log=os.path.join(tmp, "run.jsonl"), cache="auto",
                    cache_dir=cache_dir, eval_data="(held-out)", eval_every=2, checkpoint_dir=os.path.join(tmp, "ck"),
                    checkpoint_format="sharded", checkpoint_every=2, resume=resume,
                    export=os.path.join(tmp, "hf-resumed" if resume else "hf"))

    def worker(rank: int, world: int) -> None:
        model = build_model("bert-tiny", seq_len=8, dropout=0.0, seed=0)
        plan = make_plan(model, [spec(0, K=1, D=1, M=1, b=4), spec(1, K=1, D=1, M=2, b=2, cache=True)],
                         trajectory=[0, 1], samples_per_epoch=16)
        data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
        held = TensorDataset(*model.make_batch(8, generator=torch.Generator().manual_seed(2)))
        run_training(cfg, plan, model, data, eval_dataset=held)

    res = run_world(1, worker, tmpdir=tmp, timeout_s=30, deadline_s=120)
    assert res.ok, res.explain()
    assert cfg.log is not None
    return cfg.log


@pytest.mark.multiproc
def test_a_real_runs_log_holds_only_records_the_classes_make(tmp_path, one_torch_thread):
    from ptplan.executor.training.runlog import read_records

    log = real_run(str(tmp_path), epochs=1)
    real_run(str(tmp_path), resume=True, epochs=2)
    recs = read_records(log)
    types_seen = {r["type"] for r in recs}
    assert {"header", "step", "transition", "cache_setup", "cache", "eval", "checkpoint",
            "export", "resume"} <= types_seen, types_seen
    for r in recs:
        assert R.record_from_json(r).to_json() == r, r["type"]
