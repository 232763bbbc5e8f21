"""Per-stage parallel strategies (issue 14): tensor parallel, sharded data parallel, recomputation.

Legend: K pipeline length, D data-parallel width (replicas of every stage), tp tensor-parallel width
(ranks of one node sharing every layer of a stage, Megatron column/row split), b micro-batch size,
W a layer's weight bytes, G its gradient bytes, out its output bytes per sample. A phase with
tensor-parallel width tp uses K · D · tp GPUs; tp is one per phase (it fixes the mesh and the rank layout),
FSDP and recomputation are per stage: a ``Strategy`` is one stage's, and a phase's stages may differ
(``stage.StageChoice`` picks each stage's; ``phase_label`` writes them).

The stage model (``stage.py``) calls ``strategy_table`` to turn the profile's per-layer costs into the
costs of one shard, and ``gather_bytes`` for FSDP's transient; everything else in it is unchanged,
so the default strategy (tp=1, dp, no recomputation) gives exactly the old numbers.

Per layer, with tp > 1 (only layers whose ``kind`` is ``attention``, ``mlp`` or ``block`` split):

    forward  = forward / tp + a · (lat_tp + b · out · per_byte_tp)     a = 1 all-reduce per half
    backward = backward / tp + a · (lat_tp + b · out · per_byte_tp)        (attention or MLP), 2 per block
    no-grad  = no-grad forward / tp + a · (…)                           (the frozen prefix: below)
    W, G     = W / tp, G / tp
    saved    = unchanged (conservative: LayerNorm inputs, residuals and dropout masks are not split
               without sequence parallelism; the profile does not separate them)

with lat_tp, per_byte_tp the ring all-reduce over tp ranks of one node (``cluster.allreduce_seconds``).
Embedding, norm and head layers are replicated over the tp ranks (each computes them whole).

With FSDP (ZeRO-3: FSDP2 ``fully_shard`` over the stage's D replicas), per layer:

    forward, no-grad += lat_ag + (W / tp) · per_byte_ag     the weights all-gathered per micro-batch
    backward        += lat_ag + (W / tp) · per_byte_ag      and again for the backward,
                     + lat_ag + (G / tp) · per_byte_ag      then the gradient reduce-scattered, in every
                                                           micro-batch's backward (FSDP2's default:
                                                           gradients stay sharded between micro-batches)
    W, G, optimizer  = sharded: / D
    sync             = none after the pipeline (the runtime skips its flat all-reduce)
    transient        = 2 · max W / tp (the layer in use and the prefetched one) + max G / tp (one
                       layer's unsharded gradient before its reduce-scatter): conservative, the
                       largest layer of the whole model

where a ring all-gather of B bytes costs half a ring all-reduce of B (lat_ag, per_byte_ag: half the
stage's data-parallel all-reduce coefficients). Frozen layers have G = 0 (no gradient, no optimizer
state, no sync) as before; in cached phases the prefix is not held at all.

The frozen prefix (layers [0, n0), run by stage 0 under no_grad before its active layers) is split and
sharded like the active layers when stage 0 runs it (``executor/hybrid.ShardedStage``: its layers' Megatron
twins over the tp group, and ``fully_shard`` over stage 0's data-parallel group when stage 0's strategy has
FSDP), so the stage model prices it from this table too: its weights W / tp (split layers; the embedding
whole) and / D under FSDP, its no-grad forward as above (/ tp plus the forward's all-reduces, plus an
all-gather per layer per micro-batch under FSDP); it has no gradient, optimizer state or reduce-scatter.
Stage 0's chosen strategy (``stage.StageChoice``) decides whether it is FSDP-sharded. A prefix the AutoCache
serves stays whole in host memory, so its cache fill (``stage.cache_setup_s``, the streamed weights) is
priced from the profile's own table (``StageModel.raw``).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cluster import Cluster
from .costs import CostTable
from .errors import PtplanError

TP_KINDS = {"attention": 1, "mlp": 1, "block": 2}
"""Megatron all-reduces per forward (and as many per backward) of a layer of this kind."""


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One stage's parallel strategy."""

    tp: int = 1
    """Tensor-parallel width (ranks of one node)."""
    fsdp: bool = False
    """Sharded data parallel (ZeRO-3) over the D replicas instead of plain all-reduce DP."""
    recompute: bool = False
    """Activation recomputation: keep only the stage's input per micro-batch."""
    recompute_layers: int = 0
    """With recomputation, Galvatron's layer-wise choice: only the stage's first r active layers are
    recomputed (one checkpoint unit), the others keep their activations; 0 = every layer of the stage."""

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1 or self.tp & (self.tp - 1):
            raise PtplanError(f"strategy tp={self.tp!r}: the tensor-parallel width must be a power of two >= 1")
        for name in ("fsdp", "recompute"):
            if not isinstance(getattr(self, name), bool):
                raise PtplanError(f"strategy {name} must be true or false, got {getattr(self, name)!r}")
        r = self.recompute_layers
        if not isinstance(r, int) or isinstance(r, bool) or r < 0 or (r and not self.recompute):
            raise PtplanError(f"strategy recompute_layers={r!r}: recompute the first r >= 1 layers (with "
                              f"recomputation on), or 0 for the whole stage")

    @property
    def label(self) -> str:
        """Short text, e.g. ``tp2·fsdp·rc``; ``dp`` for the default; ``rc2``: the first 2 layers recomputed."""
        parts = ([f"tp{self.tp}"] if self.tp > 1 else []) + (["fsdp"] if self.fsdp else []) + \
            ([f"rc{self.recompute_layers or ''}"] if self.recompute else [])
        return "·".join(parts) or "dp"

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Inverse of ``label``."""
        tp, fsdp, rc, r = 1, False, False, 0
        for part in text.split("·"):
            if m := re.fullmatch(r"tp(\d+)", part):
                tp = int(m.group(1))
            elif part == "fsdp":
                fsdp = True
            elif m := re.fullmatch(r"rc(\d*)", part):
                rc, r = True, int(m.group(1) or 0)
            elif part != "dp":
                raise PtplanError(f"strategy {text!r}: unknown part {part!r}; write e.g. tp2·fsdp·rc or dp")
        return cls(tp=tp, fsdp=fsdp, recompute=rc, recompute_layers=r)

    @property
    def is_default(self) -> bool:
        return self.tp == 1 and not self.fsdp and not self.recompute


def phase_label(tp: int, fsdp: Sequence[bool], recompute: Sequence[bool], layers: Sequence[int] = ()) -> str:
    """A phase's strategy as text from its stages' FSDP and recomputation flags (and recomputed layer counts,
    0 = all): one strategy for every stage is its ``Strategy.label`` (``tp2·fsdp·rc``, ``dp``); stages that
    differ are listed in stage order, runs of equal ones as ``×n``: ``tp2 · stages fsdp·rc2 | fsdp | dp×2``."""
    layers = list(layers) or [0] * len(recompute)
    labels = [Strategy(fsdp=f, recompute=r, recompute_layers=k).label for f, r, k in zip(fsdp, recompute, layers)]
    if len(set(labels)) <= 1:
        return Strategy(tp=tp, fsdp=bool(fsdp) and fsdp[0], recompute=bool(recompute) and recompute[0],
                        recompute_layers=layers[0] if layers else 0).label
    names: list[str] = []
    counts: list[int] = []
    for lb in labels:
        if names and names[-1] == lb:
            counts[-1] += 1
        else:
            names.append(lb)
            counts.append(1)
    body = " | ".join(lb if k == 1 else f"{lb}×{k}" for lb, k in zip(names, counts))
    return " · ".join(([f"tp{tp}"] if tp > 1 else []) + [f"stages {body}"])


def tp_allreduce_coeffs(cluster: Cluster, tp: int) -> tuple[float, float]:
    """(latency s, seconds per byte) of a ring all-reduce over tp ranks of one node; PtplanError if tp
    does not fit in a node."""
    if tp > cluster.gpus_per_node:
        raise PtplanError(f"tp={tp} exceeds the {cluster.gpus_per_node} GPUs of a node; tensor parallelism "
                          f"stays inside a node: use tp <= {cluster.gpus_per_node}")
    if tp == 1:
        return 0.0, 0.0
    ranks = list(range(tp))
    a0 = cluster.allreduce_seconds(ranks, 0.0)
    return a0, (cluster.allreduce_seconds(ranks, 1e9) - a0) / 1e9


def splittable(table: CostTable) -> np.ndarray:
    """Per layer, the all-reduces a Megatron split adds per forward (0: the layer is replicated)."""
    return np.array([TP_KINDS.get(r.kind, 0) for r in table.profile.layers], dtype=float)


def gather_bytes(table: CostTable, st: Strategy) -> float:
    """FSDP's transient (module docstring): 2 · max W / tp + max G / tp; 0 without FSDP."""
    if not st.fsdp:
        return 0.0
    split = splittable(table) > 0
    div = np.where(split, st.tp, 1)
    return float(2 * (table.param_bytes / div).max() + (table.grad_bytes / div).max())


def strategy_table(table: CostTable, st: Strategy, D: int, tp_ar: tuple[float, float],
                   dp_ar: tuple[float, float]) -> CostTable:
    """The per-shard cost table of ``table`` under strategy ``st`` (module docstring). ``tp_ar``: the tp
    group's all-reduce (latency, s/byte); ``dp_ar``: the stage's data-parallel all-reduce coefficients."""
    if st.tp == 1 and not st.fsdp:
        return table
    t = copy.copy(table)
    t._cache = {}
    a = splittable(table)
    div = np.where(a > 0, st.tp, 1).astype(float)
    bs = table.batch_sizes[None, :]
    comm = a[:, None] * (tp_ar[0] + bs * table.out_per_sample[:, None] * tp_ar[1]) if st.tp > 1 else 0.0
    fwd, bwd, nog = table._fwd / div[:, None] + comm, table._bwd / div[:, None] + comm, table._nog / div[:, None] + comm
    bww = table._bww / div[:, None]
    W, G = table.param_bytes / div, table.grad_bytes / div
    sync = G
    if st.fsdp and D > 1:
        ag = (dp_ar[0] + W * dp_ar[1]) / 2.0
        # FSDP2 reduce-scatters each layer's gradient in every micro-batch's backward (half an
        # all-reduce's bytes); there is no sync after the pipeline (the runtime skips its all-reduce)
        rs = np.where(G > 0, (dp_ar[0] + G * dp_ar[1]) / 2.0, 0.0)
        fwd, bwd, nog = fwd + ag[:, None], bwd + (ag + rs)[:, None], nog + ag[:, None]  # frozen: no rs
        sync = np.zeros_like(G)
        W, G = W / D, G / D
        t.optimizer_s = table.optimizer_s / div / D
    else:
        t.optimizer_s = table.optimizer_s / div
    t._fwd, t._bwd, t._nog, t._bww = fwd, bwd, nog, bww
    t.param_bytes, t.grad_bytes = W, G
    t.cum_param, t.cum_grad = _cum(W), _cum(G)
    t.cum_sync = _cum(sync)
    t.cum_opt_s = _cum(t.optimizer_s)
    t.max_param_upto = np.concatenate(([0.0], np.maximum.accumulate(W)))
    return t


def min_table(a: CostTable, b: CostTable) -> CostTable:
    """Per layer, the smaller of every time, byte and sync term of two cost tables of one profile (e.g. one
    tp width with and without FSDP): any stage built from either table, layer by layer, costs at least this
    one's sums, so ``search.PhaseSearch.lower_bound`` stays a lower bound for a candidate whose stages each
    choose their strategy."""
    t = copy.copy(a)
    t._cache = {}
    for name in ("_fwd", "_bwd", "_nog", "_bww", "param_bytes", "grad_bytes", "optimizer_s"):
        setattr(t, name, np.minimum(getattr(a, name), getattr(b, name)))
    t.cum_param, t.cum_grad, t.cum_opt_s = _cum(t.param_bytes), _cum(t.grad_bytes), _cum(t.optimizer_s)
    t.cum_sync = _cum(np.minimum(np.diff(a.cum_sync), np.diff(b.cum_sync)))
    t.max_param_upto = np.concatenate(([0.0], np.maximum.accumulate(t.param_bytes)))
    return t


def _cum(a: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(a)))
