"""Your own model through the elastic runtime (``models.custom_model``, ``examples/custom_model.py``): a
BertModel with a user-defined MLP head and a label-smoothing loss, trained on 2 processes -- a 2-stage
pipeline, then block 0 frozen and 2 data-parallel replicas -- equals a single-process reference of the
same model, data order and optimizer; and the API's checks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import epoch_order
from ptplan.executor.families.models import LayerSpec, backbone_layers, custom_model
from ptplan.executor.runtime.optim import make_optimizer
from ptplan.executor.training.runlog import read_records
from ptplan.executor.launch.local import run_world
from parity import max_rel_diff
from ptplan.planner.errors import PtplanError

ROOT = Path(__file__).resolve().parents[1]
N, B, STEPS, FREEZE_AT, LR = 48, 8, 6, 3, 2e-3


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import custom_model as ex
    finally:
        sys.path.pop(0)
    return ex


def _reference(ex, data):
    """One process: the same model and order; block 0 (and the embeddings before it) frozen from step 3;
    the loss of each step the mean over its 2 micro-batches, as the pipeline and the replicas average it."""
    model = ex.build(seed=0)
    model.train()
    opt = make_optimizer(list(model.parameters()), "adamw", lr=LR)
    x, y, m = data
    order = epoch_order(N, 0, 0)
    first_active = next(i for i, s in enumerate(model.specs) if s.block == 1)
    losses = []
    for t in range(STEPS):
        if t == FREEZE_AT:
            for layer in model.layers[:first_active]:
                for p in layer.parameters():
                    p.requires_grad_(False)
        ids = order[t * B:(t + 1) * B]
        opt.zero_grad(set_to_none=True)
        loss = sum(model.loss(model(a, attention_mask=c), b)
                   for a, b, c in zip(x[ids].chunk(2), y[ids].chunk(2), m[ids].chunk(2))) / 2
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.named_parameters()}, losses


@pytest.mark.multiproc
def test_custom_model_trains_on_two_processes_like_a_single_process_reference(example, tmp_path):
    ex = example
    model = ex.build(seed=0)
    data, held = ex.make_data(N, seed=1), ex.make_data(16, seed=2)
    plan = ex.hand_plan(model, steps=STEPS)
    cfg = RunConfig(plan="(test)", model=model.name, optimizer="adamw", lr=LR, seed=0, epochs=1,
                    steps_per_epoch=STEPS, freeze_every=FREEZE_AT, progress=False, timeout_s=60,
                    log=str(tmp_path / "run.jsonl"))
    res = run_world(2, ex.train, (cfg, plan, data, held, str(tmp_path)), tmpdir=str(tmp_path), timeout_s=60,
                    deadline_s=120)
    assert res.ok, res.explain()
    got = torch.load(tmp_path / "final.pt")
    want, losses = _reference(ex, data)
    steps = [r for r in read_records(cfg.log) if r["type"] == "step"]
    assert [(r["K"], r["D"], r["frozen_blocks"]) for r in steps] == [(2, 1, 0)] * 3 + [(1, 2, 1)] * 3
    assert [r["loss"] for r in steps] == pytest.approx(losses, rel=1e-5)
    worst, where = max_rel_diff(got, want)
    print(f"custom model, 2 processes vs single process: max rel diff {worst:.2e} ({where})")
    assert worst <= 1e-4, (worst, where)
    init = {k: v.detach() for k, v in ex.build(seed=0).named_parameters()}
    moved, _ = max_rel_diff(got, init)
    assert moved > 1e-3  # it trained: the comparison above is not between two untouched models
    # the user's loss is what was trained: label smoothing, not the plain cross-entropy of a bert adapter
    x, y, m = data
    ids = epoch_order(N, 0, 0)[:B]
    fresh = ex.build(seed=0)
    with torch.no_grad():
        out = fresh(x[ids], attention_mask=m[ids])
        plain = float(sum(F.cross_entropy(o, t) for o, t in zip(out.chunk(2), y[ids].chunk(2))) / 2)
    assert steps[0]["loss"] == pytest.approx(losses[0], rel=1e-5) and abs(plain - losses[0]) > 1e-3
    # the head (the user's module) and the unfrozen blocks trained; the frozen embeddings kept their phase-1 values
    init = dict(fresh.named_parameters())
    head = f"layers.{len(fresh.layers) - 1}.fc2.weight"
    assert not torch.equal(got[head], init[head])
    assert (torch.load(tmp_path / "summary.pt")["evals"][-1]["samples"]) == 16


class _NoMask(nn.Module):
    def forward(self, x):
        return x


def test_custom_model_checks_its_inputs(example):
    import transformers as tf

    bert = tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=100), add_pooling_layer=False)
    layers, specs = backbone_layers(bert, "block")
    assert [s.name for s in specs] == ["embeddings", "block0", "block1"]  # post-LN: no final norm
    head = example.MeanPoolMLPHead(32, 16, 3)
    ok = custom_model(layers + [head], specs + [LayerSpec("head", "head", None)], example.label_smoothing_loss,
                      name="mine", config=bert.config, seq_len=8, num_labels=3)
    assert (ok.family, ok.num_blocks, ok.name, ok.custom) == ("bert", 2, "mine", True)
    x, y, m = ok.make_batch(2, torch.Generator().manual_seed(0))
    assert x.shape == (2, 8) and y.max() < 3 and ok(x, m).shape == (2, 3)
    spec_head = LayerSpec("head", "head", None)
    with pytest.raises(PtplanError, match="one LayerSpec per layer"):
        custom_model(layers, specs + [spec_head], F.cross_entropy, name="x", config=bert.config, seq_len=8)
    with pytest.raises(PtplanError, match=r"must take forward\(x, attention_mask=None\)"):
        custom_model(layers + [_NoMask()], specs + [spec_head], F.cross_entropy, name="x", config=bert.config,
                     seq_len=8)
    swapped = [specs[0], specs[2], specs[1]]
    with pytest.raises(PtplanError, match=r"block indices must run 0, 1, ..., L-1 in order"):
        custom_model(layers, swapped, F.cross_entropy, name="x", config=bert.config, seq_len=8)
    with pytest.raises(PtplanError, match="at least one layer with a block index"):
        custom_model([head], [spec_head], F.cross_entropy, name="x", config=bert.config, seq_len=8)
    with pytest.raises(PtplanError, match="'t5' model; ptplan can cut"):
        backbone_layers(tf.T5EncoderModel(tf.T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64,
                                                      vocab_size=100)))


def test_profiler_measures_a_custom_model_under_its_name(example):
    from ptplan.executor.profiling.profiler import profile_model

    model = example.build(seed=0)
    prof = profile_model(model, device="cpu", batch_sizes=[2], warmup=0, repeats=1, progress=False)
    assert (prof.model.name, prof.model.family, prof.model.num_blocks) == ("bert-mlp-head", "bert", 4)
    assert [r.name for r in prof.layers][-2:] == ["block3.mlp", "head"]
    head = prof.layers[-1]
    assert head.params == sum(p.numel() for p in model.layers[-1].parameters()) == 64 * 128 + 128 + 128 * 4 + 4
