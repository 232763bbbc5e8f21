"""Held-out evaluation inside the elastic job: forward only, through the current phase's stages.

Legend: K positions per pipeline, V chunks per position (S = K·V stages), D pipelines, b samples per
evaluation micro-batch.

Every rank calls ``evaluate`` at the same point (it is collective). The eval set is split into D
contiguous shards, one per pipeline; each pipeline runs its shard b samples at a time through its
chunks in order, chunk c on the rank at position ``stage_to_rank[c]`` of that pipeline, in eval
mode under ``no_grad``. Activations go from one chunk's rank to the next with a point-to-point send
(a small header first: the receiver learns the shape and dtype); every rank reads the inputs,
attention masks and labels it needs from its own copy of the eval set, so only activations travel.
The first chunk's rank runs the frozen prefix too: inside its module when the phase recomputes it,
else (a caching phase: the AutoCache holds training samples only) with ``model.run_layers`` on the
weights it keeps in host memory for the cache fill. The rank holding the last chunk sums, per
micro-batch, the loss (the model's own loss, a mean, times its count) and the correct predictions;
one all-reduce over the world adds the pipelines' sums. So the result is the single-process
evaluation of the same weights, up to float summation order (``tests/test_evaluate.py``).

Metrics (``Metrics``): classification (BERT, ViT): mean cross-entropy per sample and accuracy;
causal LM (GPT-2): mean next-token cross-entropy per predicted token (labels -100 left out) and
perplexity = exp(loss).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ptplan.planner.errors import PtplanError

from ptplan.executor.data.dataset import Dataset
from ptplan.executor.families import CAUSAL_FAMILIES
from ptplan.executor.runtime.step import decode_head, empty_head, encode_head


@dataclass(frozen=True)
class Metrics:
    """One evaluation's results."""

    loss: float
    """Mean cross-entropy: per sample (classification) or per predicted token (causal LM)."""
    samples: int
    accuracy: float | None = None
    """Share of samples whose arg-max class is the label (classification only)."""
    perplexity: float | None = None
    """exp(loss) (causal LM only)."""
    seconds: float = 0.0

    def to_record(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"loss": self.loss, "samples": self.samples, "seconds": self.seconds}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        if self.perplexity is not None:
            out["perplexity"] = self.perplexity
        return out

    def words(self) -> str:
        """``loss 0.4123, accuracy 81.3 %`` for the summary line."""
        extra = (f", accuracy {self.accuracy:.1%}" if self.accuracy is not None else
                 f", perplexity {self.perplexity:.3g}" if self.perplexity is not None else "")
        return f"loss {self.loss:.4f}{extra} on {self.samples} samples"


def shard_range(n: int, D: int, p: int) -> tuple[int, int]:
    """Pipeline p's contiguous share [lo, hi) of n samples split over D pipelines (sizes differ by <= 1)."""
    q, r = divmod(n, D)
    lo = p * q + min(p, r)
    return lo, lo + q + (1 if p < r else 0)


def batch_counts(model: torch.nn.Module, output: Tensor, labels: Tensor) -> tuple[float, float, float]:
    """(loss sum, count, correct) of one micro-batch: the model's mean loss times what it averages over
    (samples, or next-token labels other than -100), and the correct arg-max predictions (classification)."""
    loss = float(model.loss(output, labels))
    if getattr(model, "family", None) in CAUSAL_FAMILIES:
        count = float((labels[:, 1:] != -100).sum())
        return loss * count, count, 0.0
    correct = float((output.argmax(dim=-1) == labels).sum())
    return loss * labels.shape[0], float(labels.shape[0]), correct


def finish(model: torch.nn.Module, loss_sum: float, count: float, correct: float, samples: int,
           seconds: float = 0.0) -> Metrics:
    """Metrics from the summed counts (shared by the pipelined and the single-process evaluation)."""
    if count <= 0:
        raise PtplanError(f"the eval set has no {'predicted tokens' if getattr(model, 'family', None) in CAUSAL_FAMILIES else 'samples'} "
                          f"to score ({samples} samples)")
    loss = loss_sum / count
    if getattr(model, "family", None) in CAUSAL_FAMILIES:
        return Metrics(loss=loss, samples=samples, perplexity=math.exp(min(loss, 700.0)), seconds=seconds)
    return Metrics(loss=loss, samples=samples, accuracy=correct / samples, seconds=seconds)


def evaluate_local(model: torch.nn.Module, dataset: Dataset, batch_size: int, device: torch.device | None = None
                   ) -> Metrics:
    """The single-process evaluation of ``model`` (all its layers held): the reference ``evaluate`` equals."""
    device = device or torch.device("cpu")
    n = len(dataset)
    sums = [0.0, 0.0, 0.0]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for a in range(0, n, batch_size):
                x, y, m = (None if t is None else t.to(device)
                           for t in dataset.batch(torch.arange(a, min(a + batch_size, n))))
                out = model.run_layers(x, 0, len(model.layers), m)
                for i, v in enumerate(batch_counts(model, out, y)):
                    sums[i] += v
    finally:
        model.train(was)
    return finish(model, sums[0], sums[1], sums[2], samples=n)


def _send(t: Tensor, dst: int, device: torch.device) -> None:
    dist.send(encode_head(t, device), dst)  # the pipeline's own codec: what training sends, evaluation sends
    dist.send(t.contiguous(), dst)


def _recv(src: int, device: torch.device) -> Tensor:
    head = empty_head(device)
    dist.recv(head, src)
    shape, dtype = decode_head(head)
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src)
    return buf


def evaluate(rt, dataset: Dataset, batch_size: int) -> Metrics:
    """Evaluate the model as the runtime ``rt`` (``runtime.ElasticRuntime``) holds it now, on every rank
    (collective; the same Metrics on every rank). See the module docstring."""
    if batch_size < 1:
        raise PtplanError(f"the eval batch size must be at least 1, got {batch_size}")
    t0 = time.perf_counter()
    rt.drain()  # a flush-free schedule's outstanding updates first: evaluate the weights training has reached
    ph, model, device = rt.phase, rt.model, rt.device
    p = rt.groups.place.pipeline
    row = ph.ranks[p]
    where = ph.stage_to_rank()
    S = len(where)
    holder = [row[where[c]] for c in range(S)]
    me = rt.rank
    cached = rt._caches(ph)
    lo, hi = shard_range(len(dataset), ph.D, p)
    sums = torch.zeros(4, dtype=torch.float64)  # loss sum, count, correct, samples
    modules = list(rt.chunks.values())
    for mod in modules:
        mod.eval()
    try:
        with torch.no_grad():
            for a in range(lo, hi, batch_size):
                ids = torch.arange(a, min(a + batch_size, hi))
                x, y, m = (None if t is None else t.to(device) for t in dataset.batch(ids))
                h: Tensor | None = None
                for c in range(S):
                    if holder[c] != me:
                        continue
                    if c == 0:
                        h = x
                        if cached and ph.frozen_layers:
                            h = model.run_layers(h, 0, ph.frozen_layers, m)
                    elif holder[c - 1] != me:
                        h = _recv(holder[c - 1], device)
                    assert h is not None
                    h = rt.chunks[c](h, attention_mask=m)
                    if c < S - 1 and holder[c + 1] != me:
                        _send(h, holder[c + 1], device)
                if holder[S - 1] == me:
                    assert h is not None
                    ls, cnt, ok = batch_counts(model, h, y)
                    sums += torch.tensor([ls, cnt, ok, float(len(ids))], dtype=torch.float64)
    finally:
        for mod in modules:
            mod.train()
    if device.type == "cuda":
        sums = sums.to(device)
    dist.all_reduce(sums)  # each sample is scored once, on its pipeline's last rank
    loss_sum, count, correct, samples = (float(v) for v in sums.cpu())
    return finish(model, loss_sum, count, correct, int(samples), time.perf_counter() - t0)
