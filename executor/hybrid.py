"""Sharded stages for issue 14: FSDP2 ``fully_shard`` (``Phase.fsdp``) and Megatron tensor parallelism
with DTensor ``parallelize_module`` (``Phase.tp``) of one rank's active layers in a phase.

Legend: D pipelines, so D ranks at each pipeline position hold the same stage (its data-parallel group);
tp ranks run each stage of a pipeline together (its tensor-parallel group, ``groups``).

Entering (``ShardedStage.enter``, after the transition has given every rank of the group full copies of
its active layers and of their optimizer state): each active layer is copied (``copy.deepcopy``) and the
copy is sharded with ``fully_shard`` over a ``DeviceMesh`` made from the position's data-parallel group
(``DeviceMesh.from_group``), one FSDP unit per layer; the canonical layer's storage is freed (only 1/D
of it stays, in the copy). The run's one optimizer (``optim``) keeps its parameter order: each canonical
parameter in its param groups is replaced by the copy's sharded (DTensor) parameter, and its state
tensors by DTensor shards with the same placement (``distribute_tensor``, no communication: every rank
holds the full state). FSDP reduce-scatters (averages over D) each layer's gradient in the backward,
so the runtime's flat all-reduce is skipped.

Leaving (``leave``; before a transition, a gather, a cache change, or the end): every sharded parameter
and state tensor is all-gathered (``full_tensor``) into the canonical parameter's storage, the
optimizer gets its canonical parameters back, and the copies are dropped -- so the transition code
(``transition``) moves plain full tensors, as in any phase.

Tensor parallelism (``tp_plan``) works the same way over the stage's tensor-parallel group: each active
layer with a plan (BERT's attention and MLP halves, or whole blocks) is copied and split Megatron-style --
query, key and value column-wise (each rank its heads), the attention output row-wise; the MLP's first
linear column-wise, its second row-wise -- DTensor all-reducing the row-parallel outputs in the forward
and the input gradients in the backward; its norms and biases of the row-parallel linears stay
replicated (plain tensors in the copy, equal on every tp rank). Layers without a plan (embeddings, the
head) are not copied: every tp rank runs them whole, on the same input, with the same gradients. The
data-parallel all-reduce then runs on each rank's local shards, over the ranks with its tp index.

The canonical layers are copied rather than sharded in place because ``fully_shard`` changes a module
for good (its class, its hooks, its parameters); a layer trains sharded in one phase and plain in the next.
The price: entering holds a full second copy of one layer at a time, until ``fully_shard`` frees it.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn

from .optim import ensure_state, state_keys


class ShardedStage:
    """The active layers ``owned`` of this rank, sharded over ``group`` while it is entered: ``kind`` "fsdp"
    (``fully_shard``) or "tp" (``parallelize_module`` with ``tp_plan``)."""

    def __init__(self, layers: nn.ModuleList, layer_params: list[list[nn.Parameter]], owned: list[int],
                 opt: torch.optim.Optimizer, group, ranks: list[int], device: torch.device,
                 release: Callable[[int], None], place: Callable[[int], None], kind: str = "fsdp") -> None:
        assert kind in ("fsdp", "tp"), kind
        self.layers, self.layer_params, self.owned, self.opt = layers, layer_params, owned, opt
        self.group, self.ranks, self.device, self.kind = group, sorted(ranks), device, kind
        self._release, self._place = release, place
        self.copies: dict[int, nn.Module] = {}
        """Layer index -> its sharded copy (while entered)."""
        self.live: dict[int, nn.Parameter] = {}
        """id(canonical parameter) -> the sharded parameter training in its place."""

    def _slots(self) -> dict[int, tuple[int, int]]:
        return {id(p): (g, j) for g, group in enumerate(self.opt.param_groups) for j, p in enumerate(group["params"])}

    def enter(self) -> None:
        """Shard every owned layer (collective over ``group``)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, distribute_tensor

        mesh = DeviceMesh.from_group(self.group, self.device.type, mesh=self.ranks)
        slots, keys = self._slots(), state_keys(self.opt)
        for i in self.owned:
            if self.kind == "tp" and tp_plan(self.layers[i], len(self.ranks)) is None:
                continue  # replicated: every tp rank runs the canonical layer whole
            full_state = {id(p): ensure_state(self.opt, p) for p in self.layer_params[i]}
            twin = copy.deepcopy(self.layers[i])
            if self.kind == "fsdp":
                fully_shard(twin, mesh=mesh)
            else:
                _parallelize(twin, mesh)
            for p, q in zip(self.layer_params[i], twin.parameters(), strict=True):
                assert p.shape == q.shape, (p.shape, q.shape)
                g, j = slots[id(p)]
                self.opt.param_groups[g]["params"][j] = q
                self.opt.state[q] = {k: (distribute_tensor(v, mesh, q.placements, src_data_rank=None)
                                         if v.shape == p.shape and isinstance(q, DTensor) else
                                         v.clone() if v.shape == p.shape else v)
                                     for k, v in zip(keys, full_state[id(p)])}
                self.opt.state.pop(p, None)
                self.live[id(p)] = q
            self.copies[i] = twin
            self._release(i)

    def leave(self) -> None:
        """Bring every sharded parameter and its state back into the canonical layers (collective)."""
        from torch.distributed.tensor import DTensor

        slots = self._slots()
        keys = state_keys(self.opt)
        with torch.no_grad():
            for i in self.copies:
                self._place(i)
                for p in self.layer_params[i]:
                    q = self.live.pop(id(p))
                    p.data.copy_(q.full_tensor() if isinstance(q, DTensor) else q.detach())
                    st = self.opt.state.pop(q, {})
                    if st:
                        self.opt.state[p] = {k: (st[k].full_tensor() if isinstance(st[k], DTensor) else st[k])
                                             for k in keys}
                    g, j = slots[id(q)]
                    self.opt.param_groups[g]["params"][j] = p
                    p.grad = None
        self.copies.clear()

    def params(self, i: int) -> list[nn.Parameter]:
        """Layer i's parameters training now (sharded ones for an owned layer)."""
        return [self.live.get(id(p), p) for p in self.layer_params[i]]


_BERT_HALF = {"BertAttentionHalf": ("attention.", ()), "BertMLPHalf": ("", ("intermediate.", "output.")),
              "BertBlock": ("layer.attention.", ("layer.intermediate.", "layer.output."))}
"""Per BERT layer class: where its BertAttention sits (None: no attention) and its MLP's two modules."""


def tp_plan(layer: nn.Module, tp: int) -> dict[str, object] | None:
    """The Megatron split of one layer for ``parallelize_module`` (module path -> ColwiseParallel or
    RowwiseParallel), or None when the layer has none (it runs replicated). Layers: BERT's attention and MLP
    halves and blocks, whose heads and intermediate width ``tp`` divides."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind = type(layer).__name__
    if kind not in _BERT_HALF:
        return None
    att, mlp = _BERT_HALF[kind]
    plan: dict[str, object] = {}
    if kind != "BertMLPHalf":
        heads = layer.get_submodule(att + "self").num_attention_heads
        if heads % tp:
            return None
        plan.update({att + "self.query": ColwiseParallel(), att + "self.key": ColwiseParallel(),
                     att + "self.value": ColwiseParallel(), att + "output.dense": RowwiseParallel()})
    if mlp:
        if layer.get_submodule(mlp[0] + "dense").out_features % tp:
            return None
        plan.update({mlp[0] + "dense": ColwiseParallel(), mlp[1] + "dense": RowwiseParallel()})
    return plan


def tp_families() -> tuple[str, ...]:
    """Model families whose Transformer layers ``tp_plan`` splits."""
    return ("bert",)


def _parallelize(layer: nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    plan = tp_plan(layer, tp)
    assert plan is not None
    parallelize_module(layer, mesh, plan)
    for name, _ in plan.items():
        if name.endswith("self.query"):  # each rank holds heads/tp heads (views use the head size)
            att = layer.get_submodule(name.removesuffix(".query"))
            att.num_attention_heads //= tp
            att.all_head_size //= tp


def local(t: Tensor) -> Tensor:
    """This rank's part of a tensor (a DTensor's local shard; a plain tensor itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
