"""Held-out evaluation (``executor/training/evaluate.py``, ``--eval-data``): the pipelined, data-parallel evaluation of
a running job equals a single-process evaluation of the same weights.

4 forked gloo processes go K=4,D=1 -> K=2,D=2 -> K=1,D=4, evaluating every 2 steps (before each
transition and at the end) on a held-out set of 13 samples (shards of 4/3/3/3 over 4 pipelines,
micro-batches of 2 with a remainder). Rank 0's snapshot of the weights at the same step is then
evaluated in one process by ``evaluate_local`` (plain ``run_layers`` over the whole model):
loss within 1e-5 relative, accuracy exactly. Cases: BERT with the middle phase caching its frozen
prefix (the evaluation runs the prefix on the host-held weights: the cache holds training samples
only), and GPT-2 with interleaved 1F1B (V = 2 chunks per position: activations hop between ranks
and back) scored by perplexity.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.training.evaluate import evaluate_local, shard_range
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.planner.errors import PtplanError

pytestmark = pytest.mark.multiproc


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


SEQ, N, N_EVAL = 8, 48, 13


def _build(name: str):
    return build_model(name, seq_len=SEQ, granularity="half", dropout=0.1, seed=0)


def test_shards_cover_the_set_once():
    for n in (0, 1, 5, 13, 64):
        for D in (1, 2, 3, 4, 7):
            parts = [shard_range(n, D, p) for p in range(D)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert max(h - lo for lo, h in parts) - min(h - lo for lo, h in parts) <= 1


@pytest.mark.parametrize("name,schedule,V,cache", [("bert-tiny", "1f1b", 1, True),
                                                   ("gpt2-tiny", "interleaved-1f1b", 2, False),
                                                   ("llama-tiny", "1f1b", 1, False)],
                         ids=["bert-cached-prefix", "gpt2-interleaved", "llama"])
def test_pipelined_evaluation_equals_single_process_evaluation(name, schedule, V, cache, tmp_path):
    model = _build(name)
    plan = make_plan(model, [spec(0, K=4, D=1, M=4, b=2, schedule=schedule, V=V),
                             spec(1, K=2, D=2, M=2, b=2, schedule=schedule, V=V, cache=cache),
                             spec(2, K=1, D=4, M=2, b=1, schedule=schedule, V=V)], trajectory=[0, 1, 2])
    gen = torch.Generator().manual_seed(5)
    train = TensorDataset(*model.make_batch(N, generator=gen))
    held = TensorDataset(*model.make_batch(N_EVAL, generator=gen))
    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, "ram"))
    cfg = RunConfig(plan="(test)", model=name, optimizer="adamw", lr=1e-3, seed=0, freeze_every=2, steps_per_epoch=6,
                    epochs=1, progress=False, timeout_s=60, log=os.path.join(tmp, "run.jsonl"),
                    cache="auto" if cache else "off", cache_dir=os.path.join(tmp, "ram"), eval_data="(test)",
                    eval_every=2, eval_batch_size=2)

    def worker(rank: int, world: int) -> None:
        def save(event: str, step: int, weights) -> None:
            torch.save(weights, os.path.join(tmp, f"snap-{step}-{event}.pt"))

        summary = run_training(cfg, plan, model, train, hooks=Hooks(snapshots=True, on_snapshot=save),
                               eval_dataset=held)
        torch.save([(m.loss, m.samples, m.accuracy, m.perplexity) for m in summary.evals],
                   os.path.join(tmp, f"evals-{rank}.pt"))

    res = run_world(4, worker, tmpdir=tmp, timeout_s=60, deadline_s=150)
    assert res.ok, res.explain()
    recs = [r for r in read_records(cfg.log) if r["type"] == "eval"]
    assert [(r["step"], r["phase"]) for r in recs] == [(2, 0), (4, 1), (6, 2)]  # not twice at the epoch's end
    per_rank = [torch.load(os.path.join(tmp, f"evals-{r}.pt")) for r in range(4)]
    assert all(p == per_rank[0] for p in per_rank)  # the same metrics on every rank
    snaps = {int(f.split("-")[1]): torch.load(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("snap-")}
    ref_model = _build(name)
    ref_model.train()
    losses = []
    for r in recs:
        ref_model.load_state_dict(snaps[r["step"]])
        want = evaluate_local(ref_model, held, batch_size=5)
        assert r["samples"] == N_EVAL
        assert math.isclose(r["loss"], want.loss, rel_tol=1e-5), (r, want)
        if name in ("gpt2-tiny", "llama-tiny"):
            assert "accuracy" not in r and math.isclose(r["perplexity"], math.exp(want.loss), rel_tol=1e-5)
        else:
            assert "perplexity" not in r and r["accuracy"] == want.accuracy
        losses.append(r["loss"])
    assert len(set(losses)) == 3  # training moved the weights between evaluations
    assert ref_model.training  # evaluate_local leaves the mode as it found it


def test_eval_options_are_checked():
    with pytest.raises(PtplanError, match="--eval-every needs --eval-data"):
        RunConfig(plan="p", model="m", eval_every=5)
    with pytest.raises(PtplanError, match="--eval-batch-size must be at least 1"):
        RunConfig(plan="p", model="m", eval_data="x.pt", eval_batch_size=0)
