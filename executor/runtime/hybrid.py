"""Sharded stages for issue 14: FSDP2 ``fully_shard`` (``Phase.fsdp``) and Megatron tensor parallelism
with DTensor ``parallelize_module`` (``Phase.tp``) of one rank's active layers in a phase.

Legend: D pipelines, so D ranks at each pipeline position hold the same stage (its data-parallel group);
tp ranks run each stage of a pipeline together (its tensor-parallel group, ``groups``).

Entering (``ShardedStage.enter``, after the transition has given every rank of the group full copies of
its active layers and of their optimizer state): each active layer is copied (``copy.deepcopy``) and the
copy is sharded with ``fully_shard`` over a ``DeviceMesh`` made from the position's data-parallel group
(``DeviceMesh.from_group``), one FSDP unit per layer, resharded after every forward (``shard_layer``: all-
gathered in each micro-batch's forward and again in its backward, never held whole between them); the
canonical layer's storage is freed (only 1/D of it stays, in the copy). The run's one optimizer (``optim``) keeps its parameter order: each canonical
parameter in its param groups is replaced by the copy's sharded (DTensor) parameter, and its state
tensors by DTensor shards with the same placement (``distribute_tensor``, no communication: every rank
holds the full state). FSDP reduce-scatters (averages over D) each layer's gradient in the backward,
so the runtime's flat all-reduce is skipped.

Leaving (``leave``; before a transition, a gather, a cache change, or the end): every sharded parameter
and state tensor is all-gathered (``full_tensor``) into the canonical parameter's storage, the
optimizer gets its canonical parameters back, and the copies are dropped -- so the transition code
(``transition``) moves plain full tensors, as in any phase.

Tensor parallelism (``tp_plan``) works the same way over the stage's tensor-parallel group: each active
layer with a plan (the attention and MLP halves, or whole blocks, of every family: BERT and RoBERTa,
DistilBERT, ViT, GPT-2, Llama, Mistral, Qwen2; each family file's ``tp_splits`` names its layer classes'
modules, found through ``families.registry``; GPT-2's ``Conv1D``s first become ``nn.Linear``s holding the
transposed weights, the fused q|k|v rows reordered per rank, ``families.gpt2.conv1d_twin``) is copied and split Megatron-style -- query, key and value column-wise (each rank its
heads; with grouped-query attention its G/tp key/value heads and the H/tp query heads that read them, so tp
must divide G), the attention output row-wise; the MLP's first linear column-wise (Llama's gate and up
projections both), its second row-wise --, DTensor all-reducing the row-parallel outputs in the forward and
the input gradients in the backward. Every Hugging Face attention here views its projections with -1 heads,
so the copy runs its local heads; its stored head counts are divided by tp as well (``_LOCAL_COUNTS``).
Rotary embeddings act per head and Mistral's sliding window is in the mask (``families/llama.py``): both unchanged by
the split. Norms stay plain tensors and the row-parallel biases replicated DTensors, equal on every tp rank.
Layers without a plan (embeddings, the head) are not copied: every tp rank runs them whole, on the same
input, with the same gradients. The data-parallel all-reduce then runs on each rank's local shards, over the
ranks with its tp index. On leaving, a GPT-2 copy's tensors (weights and state) are mapped back to the
Conv1D layout. A tp that does not divide a layer's heads, key/value heads or MLP width is an error
(``ptplan plan --strategies auto`` never chooses one and ``ptplan run`` refuses it before launch:
``planner/tp_split.py``, used by ``search.PhaseSearch`` and ``validate.check_model``).

Sequence parallelism (``Phase.sp``, Megatron's; ``tp_plan(sp=True)``, torchtitan's llama plan): each split layer's
pre-LN norms (``Split.norms``: GPT-2, Llama, Mistral, Qwen2; ``FamilyFacts.sequence_parallel``) run on the rank's
S/tp tokens with replicated weights and all-gather their output for the column-parallel linears, and the
row-parallel linears reduce-scatter their output to sequence shards (``Shard(1)``) instead of all-reducing it, so
the residual stream between split layers is a ``Shard(1)`` DTensor (its ``shape`` still the whole sequence's, so
the layers' masks and positions are unchanged). Where a run of consecutive split layers begins, the whole hidden
state is cut to the rank's shard, and after its last layer -- before a replicated layer, a stage boundary or a
send -- it is all-gathered back (``_sequence_bounds``). A replicated parameter then sees only its rank's tokens:
its partial gradient is all-reduced as it arrives (``_replicated_grads_reduced``; FSDP2 does it for the layers it
shards). Each rank's norms save S/tp tokens; the column-parallel linears keep their gathered input whole (Megatron
re-gathers it in the backward instead), which ``planner/strategy.py``'s ``saved_share`` prices. Measured
(``pytest -s tests/test_sequence_parallel.py``, against the single-process reference): 2 processes tp2·sp -> K=2 ->
tp2·sp·rc, gpt2-tiny SGD 3.7e-07 / AdamW 2.5e-06, llama-tiny SGD 2.2e-07 / AdamW 5.1e-06; 4 processes tp2·sp·fsdp ->
tp2·sp (K=2) -> tp2·sp·fsdp·rc, llama-tiny SGD 2.2e-07 / AdamW 5.4e-06.

The frozen prefix (stage 0 of a phase that runs it rather than reading the AutoCache; ``prefix``) is treated
like the active layers but has no gradient and no optimizer state: each prefix layer with a split gets a
Megatron twin over the tp group, and when stage 0's strategy has FSDP (D > 1) the prefix layers are
``fully_shard``-ed over its data-parallel group (``shard_layer``; frozen, FSDP only all-gathers them in every
no-grad forward and never reduce-scatters). The canonical storage is released while split and the
full weights are gathered back into it on leaving (no optimizer slot or state moves); ``stage.stage_module``
runs the twins. A prefix served by the AutoCache is never entered: it stays whole in host memory.
``tests/test_frozen_prefix_runtime.py`` checks parity through transitions and each rank's local sizes.

Measured (``pytest -s tests/test_tp_families.py``, 4 gloo processes, tp2 (K=2) -> FSDP (K=2, D=2) -> tp2 with
recomputation (K=1, D=2) against the single-process reference, max relative difference): SGD 1.6e-07 to
5.5e-07, AdamW 1.7e-06 to 2.8e-05 for ViT, DistilBERT, Llama, Mistral (4-token sliding window), Qwen2 and
RoBERTa; 8 processes, llama-tiny tp2 x FSDP on a 2 x 2 x 2 mesh -> dp -> tp2 x FSDP (1 x 4 x 2): SGD 2.0e-07,
AdamW 5.9e-05. BERT and GPT-2: ``tests/test_hybrid_runtime.py``.

The canonical layers are copied rather than sharded in place because ``fully_shard`` changes a module
for good (its class, its hooks, its parameters); a layer trains sharded in one phase and plain in the next.
The price: entering holds a full second copy of one layer at a time, until ``fully_shard`` frees it.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ptplan.executor.families.gpt2 import conv1d_twin as _gpt2_twin  # noqa: F401 -- tests/test_hybrid_runtime.py
from ptplan.executor.families.registry import tp_families, tp_twin  # noqa: F401 -- tp_families for validate.py
from ptplan.executor.families.registry import tp_split as split_of
from ptplan.planner.families import SP_FAMILIES
from ptplan.executor.runtime.optim import ensure_state, state_keys


class ShardedStage:
    """The active layers ``owned`` of this rank, while it is entered: split over the tensor-parallel group
    ``tp`` (``parallelize_module`` with ``tp_plan``) and/or sharded over the data-parallel group ``dp``
    (``fully_shard``); each a (process group, its ranks) pair or None. With both, the mesh is 2-D
    (``dp`` x ``tp``, ``mesh[p][j]`` the rank of replica p with tp index j), as FSDP2 + TP wants it."""

    def __init__(self, layers: nn.ModuleList, layer_params: list[list[nn.Parameter]], owned: list[int],
                 opt: torch.optim.Optimizer, *, dp: tuple | None, tp: tuple | None, device: torch.device,
                 release: Callable[[int], None], place: Callable[[int], None],
                 fsdp_layers: set[int] | None = None, prefix: list[int] | None = None, sp: bool = False) -> None:
        assert dp is not None or tp is not None
        self.layers, self.layer_params, self.owned, self.opt = layers, layer_params, owned, opt
        self.prefix: list[int] = list(prefix or [])
        """The frozen prefix layers this rank runs (stage 0 of a phase that does not cache them): split like active
        layers over ``tp`` and, when ``fsdp_layers`` names them, sharded over ``dp``; they have no gradient and no
        optimizer state, so only their weights move (FSDP all-gathers them in the no-grad forward)."""
        self.dp, self.tp, self.device = dp, tp, device
        self.sp = sp and tp is not None
        """Sequence parallelism (``Phase.sp``): the split layers' norms and residual stream on sequence shards, the
        row-parallel outputs reduce-scattered and the norms' outputs all-gathered (``tp_plan``); the hidden state
        is whole again (all-gathered) after each run of consecutive split layers (``_sequence_bounds``)."""
        self.fsdp_layers: set[int] = set() if dp is None else set(owned) if fsdp_layers is None else set(fsdp_layers)
        """The owned layers FSDP shards over ``dp`` (all of them unless ``fsdp_layers`` names some: a phase whose
        stages differ shards only its FSDP stages' layers; the prefix's too when stage 0 has FSDP); FSDP reduce-scatters their gradients in the backward,
        so the runtime's flat all-reduce leaves them out."""
        self.fsdp = bool(self.fsdp_layers)
        """Whether FSDP shards any layer here."""
        self._release, self._place = release, place
        self.copies: dict[int, nn.Module] = {}
        """Layer index -> its sharded copy (while entered)."""
        self.live: dict[int, nn.Parameter] = {}
        """id(canonical parameter) -> the sharded parameter training in its place."""
        self.back: dict[int, Callable[[Tensor], Tensor]] = {}
        """id(canonical parameter) -> how a full tensor of its twin maps back to its layout (GPT-2's Conv1D
        weights train transposed in ``nn.Linear``s, ``families.registry.tp_twin``); identity when absent."""
        self._frozen_back: dict[int, dict[str, Callable[[Tensor], Tensor]]] = {}
        """A split frozen prefix layer -> its parameters' maps back to the canonical layout (GPT-2)."""
        self._reduce_scatters: list[Any] = []
        """The reduce-scatter inputs FSDP2 keeps in flight, one list for every layer sharded here (``shard_layer``)."""

    def _slots(self) -> dict[int, tuple[int, int]]:
        return {id(p): (g, j) for g, group in enumerate(self.opt.param_groups) for j, p in enumerate(group["params"])}

    def _meshes(self):
        """(data-parallel mesh or None, tensor-parallel mesh or None), slices of one mesh when both."""
        from torch.distributed.device_mesh import DeviceMesh

        kind = self.device.type
        if self.dp is not None and self.tp is not None:
            (dg, dranks), (tg, tranks) = self.dp, self.tp
            j = sorted(set(dranks) & set(tranks))[0] - min(tranks)  # this rank's tp index
            grid = [[r - j + t for t in range(len(tranks))] for r in sorted(dranks)]  # [replica][tp index]
            mesh = DeviceMesh.from_group([dg, tg], kind, mesh=grid, mesh_dim_names=("dp", "tp"))
            return mesh["dp"], mesh["tp"]
        if self.dp is not None:
            return DeviceMesh.from_group(self.dp[0], kind, mesh=sorted(self.dp[1]), mesh_dim_names=("dp",)), None
        assert self.tp is not None, "a sharded stage has a data-parallel or a tensor-parallel group"
        return None, DeviceMesh.from_group(self.tp[0], kind, mesh=sorted(self.tp[1]), mesh_dim_names=("tp",))

    def enter(self) -> None:
        """Shard every owned layer (collective over the groups)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        dp_mesh, tp_mesh = self._meshes()
        slots, keys = self._slots(), state_keys(self.opt)
        split_layers: list[int] = []
        for i in [*self.prefix, *self.owned]:
            split = tp_mesh is not None and tp_plan(self.layers[i], tp_mesh.size(), self.sp) is not None
            if split:
                split_layers.append(i)
            shard = dp_mesh is not None and i in self.fsdp_layers
            if not split and not shard:
                continue  # replicated (every tp rank runs the canonical layer whole), or a plain-DP stage's layer
            if i in self.prefix:
                self.copies[i] = self._frozen_twin(i, tp_mesh if split else None, dp_mesh if shard else None)
                self._release(i)
                continue
            full_state = {id(p): ensure_state(self.opt, p) for p in self.layers[i].parameters()}
            twin = copy.deepcopy(self.layers[i])
            maps: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]] = {}
            if split:
                maps = tp_twin(twin, tp_mesh.size())
                _parallelize(twin, tp_mesh, self.sp)
            if shard:
                shard_layer(twin, dp_mesh, self._reduce_scatters)
            elif split and self.sp:
                _replicated_grads_reduced(twin)  # FSDP2 does this itself for the layers it shards
            by_name = dict(twin.named_parameters())
            for name, p in self.layers[i].named_parameters():
                q = by_name[name]
                to, back = maps.get(name, (_same, _same))
                assert to(p.detach()).shape == q.shape, (name, p.shape, q.shape)
                g, j = slots[id(p)]
                self.opt.param_groups[g]["params"][j] = q
                self.opt.state[q] = {k: (distribute_tensor(to(v), q.device_mesh, q.placements, src_data_rank=None)
                                         if v.shape == p.shape and isinstance(q, DTensor) else
                                         to(v).clone() if v.shape == p.shape else v)
                                     for k, v in zip(keys, full_state[id(p)])}
                if name in maps:
                    self.back[id(p)] = back
                self.opt.state.pop(p, None)
                self.live[id(p)] = q
            self.copies[i] = twin
            self._release(i)
        if self.sp:
            _sequence_bounds(self.copies, split_layers, tp_mesh)

    def _frozen_twin(self, i: int, tp_mesh, dp_mesh) -> nn.Module:
        """A frozen prefix layer's split and/or sharded copy: no optimizer slot or state to move; its
        parameters stay frozen (``requires_grad`` off), so FSDP only all-gathers them in the forward."""
        twin = copy.deepcopy(self.layers[i])
        if tp_mesh is not None:
            maps = tp_twin(twin, tp_mesh.size())
            _parallelize(twin, tp_mesh, self.sp)
            self._frozen_back[i] = {n: back for n, (_, back) in maps.items()}
        twin.requires_grad_(False)
        if dp_mesh is not None:
            shard_layer(twin, dp_mesh)
        twin.eval()
        return twin

    def leave(self) -> None:
        """Bring every sharded parameter and its state back into the canonical layers (collective)."""
        from torch.distributed.tensor import DTensor

        slots = self._slots()
        keys = state_keys(self.opt)
        with torch.no_grad():
            for i in self.copies:
                self._place(i)
                if i in self.prefix:  # frozen: the weights only (every rank gathers every shard)
                    back_of = self._frozen_back.pop(i, {})
                    by_name = dict(self.copies[i].named_parameters())
                    for name, p in self.layers[i].named_parameters():
                        q = by_name[name]
                        p.data.copy_(back_of.get(name, _same)(q.full_tensor() if isinstance(q, DTensor) else q.detach()))
                    continue
                for p in self.layer_params[i]:
                    q = self.live.pop(id(p))
                    back = self.back.pop(id(p), _same)
                    p.data.copy_(back(q.full_tensor() if isinstance(q, DTensor) else q.detach()))
                    st = self.opt.state.pop(q, {})
                    if st:
                        self.opt.state[p] = {k: (back(st[k].full_tensor()) if isinstance(st[k], DTensor) else
                                                 back(st[k]) if st[k].shape == q.shape else st[k]) for k in keys}
                    g, j = slots[id(q)]
                    self.opt.param_groups[g]["params"][j] = p
                    p.grad = None
        self.copies.clear()

    def params(self, i: int) -> list[nn.Parameter]:
        """Layer i's parameters training now (sharded ones for an owned layer)."""
        return [self.live.get(id(p), p) for p in self.layer_params[i]]


_LOCAL_COUNTS = ("num_attention_heads", "num_heads", "n_heads", "num_key_value_heads", "all_head_size",
                 "embed_dim", "split_size")
"""Attention attributes that count heads or their width, divided by tp in a rank's copy (BERT's
``num_attention_heads``/``all_head_size``, GPT-2's ``num_heads``/``embed_dim``/``split_size``: its forward
splits the fused q|k|v by ``split_size``; DistilBERT's ``n_heads``, ViT's ``num_attention_heads``)."""


def _width(m: nn.Module) -> int:
    """Output features of an ``nn.Linear`` or a GPT-2 ``Conv1D`` (``nf``)."""
    return int(getattr(m, "nf", None) or m.out_features)


def split_widths(layer: nn.Module) -> dict[str, int]:
    """The widths tensor parallelism must divide in one layer (as ``planner.tp_split.split_widths`` reads
    them from a config): its attention heads, key/value heads (grouped-query attention), MLP width; {} for
    a layer without a split."""
    sp = split_of(layer)
    if sp is None:
        return {}
    out: dict[str, int] = {}
    if sp.attention is not None:
        att = layer.get_submodule(sp.attention)
        hd = int(getattr(att, "head_dim", None) or att.attention_head_size)
        widths = [_width(layer.get_submodule(n)) for n in sp.qkv]
        if len(widths) == 1:  # GPT-2's fused q|k|v
            out["attention heads"] = widths[0] // (3 * hd)
        else:
            out["attention heads"] = widths[0] // hd
            if widths[1] != widths[0]:
                out["key/value heads"] = widths[1] // hd
    if sp.up:
        out["intermediate size"] = _width(layer.get_submodule(sp.up[0]))
    return out


def shard_layer(layer: nn.Module, dp_mesh, reduce_scatters: list[Any] | None = None) -> None:
    """``fully_shard`` one layer over the data-parallel mesh, resharded after every forward. Each layer is its
    own FSDP root (no FSDP module above it), and FSDP2 by default keeps a root's gathered weights from its
    forward to its backward: with several micro-batches in flight a stage would hold its layers whole. Resharded,
    a layer is all-gathered in every micro-batch's forward and again in its backward, and its gradient
    reduce-scattered there -- what ``planner/strategy.py`` prices (weights / D, two gathered layers at a time).
    A frozen layer (requires_grad off) is only all-gathered, in its forward.

    ``reduce_scatters``: one list shared by a rank's sharded layers, as their reduce-scatter inputs in flight. FSDP2
    keeps each reduce-scatter's input (the layer's whole gradient) until the next one is issued, but per root, and
    a root lets its last one go only when the backward call ends: as separate roots a stage's backward would hold
    every layer's whole gradient by its end (measured: ``docs/strategies.md``), which the stage model does not
    price. Sharing the list is what one FSDP context over the layers would do (the next layer's reduce-scatter
    releases the one before), without a root above them, whose hooks would keep its layers gathered from forward to
    backward. An FSDP2 that keeps no such list (one input per context, in an attribute of its own) is left as it
    is."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
    if reduce_scatters is None:
        return
    ctx = layer._get_fsdp_state()._comm_ctx  # type: ignore[operator]
    made = ctx.lazy_init  # the root's first forward makes the context's state, the list among it: share it after

    def lazy_init(device: torch.device) -> None:
        made(device)
        if isinstance(getattr(ctx, "reduce_scatter_states", None), list):
            ctx.reduce_scatter_states = reduce_scatters

    ctx.lazy_init = lazy_init


def tp_plan(layer: nn.Module, tp: int, sp: bool = False) -> dict[str, object] | None:
    """The Megatron split of one layer for ``parallelize_module`` (module path -> ColwiseParallel or
    RowwiseParallel), or None when the layer has none (embeddings, norms, heads: it runs replicated). Every
    attention and MLP half or block of every family in ``tp_families`` has one (GPT-2's Conv1D paths are
    split once ``families.registry.tp_twin`` made them ``nn.Linear``s). PtplanError when ``tp`` does not divide its heads,
    key/value heads or intermediate width (``ptplan run`` checks the plan before: ``validate.check_strategies``).

    With sequence parallelism (``sp``, Korthikanti et al. 2022; torchtitan's llama plan): the layer's norms run on
    the rank's sequence shard with replicated weights and all-gather their output (``_gathered_norm``: Megatron's
    g), the column-parallel linears read that whole sequence, and the row-parallel ones reduce-scatter their
    output to sequence shards (``output_layouts=Shard(1)``) instead of all-reducing it -- the same bytes moved.
    PtplanError for a layer without norms to split (a family with ``FamilyFacts.sequence_parallel`` off)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ptplan.planner.errors import PtplanError

    split = split_of(layer)
    if split is None:
        return None
    widths = split_widths(layer)
    bad = [f"{n} {what}" for what, n in widths.items() if n % tp]
    if bad:
        raise PtplanError(f"tensor parallelism tp={tp} cannot split a {type(layer).__name__}: it does not divide its "
                          f"{' and '.join(bad)} ({', '.join(f'{w} {n}' for w, n in widths.items())}); use a tp that "
                          f"divides them all, or plan with `ptplan plan --strategies off`")
    if sp and not split.norms:
        raise PtplanError(f"sequence parallelism cannot run a {type(layer).__name__}: its family has no pre-LN norms "
                          f"to split by sequence (it supports {', '.join(SP_FAMILIES)}); plan tp without sp "
                          f"(`ptplan plan --strategies auto` never chooses sp for it)")
    plan: dict[str, object] = {n: _gathered_norm() for n in (split.norms if sp else ())}
    plan.update({n: ColwiseParallel() for n in (*split.qkv, *split.up)})
    row = (lambda: RowwiseParallel(output_layouts=Shard(1), use_local_output=False)) if sp else RowwiseParallel
    plan.update({n: row() for n in (split.out, split.down) if n is not None})
    return plan


def _gathered_norm() -> object:
    """torch's ``SequenceParallel`` style for one norm (its weights replicated DTensors, its input the sequence
    shard, ``Shard(1)``) whose output is all-gathered over the tp ranks (a replicated DTensor): the column-parallel
    linears after it then read one gathered copy (Llama's q, k and v projections share it) rather than each
    gathering their own; its gradient comes back as a partial sum that the gather's backward reduce-scatters."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import SequenceParallel

    class GatheredSequenceParallel(SequenceParallel):
        @staticmethod
        def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):  # type: ignore[override]
            return outputs.redistribute(device_mesh, [Replicate()])

    return GatheredSequenceParallel()


def _parallelize(layer: nn.Module, mesh, sp: bool = False) -> None:
    """Split ``layer`` (a copy) over the tp mesh and give its attention the rank's own head counts."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    plan = tp_plan(layer, tp, sp)
    assert plan is not None
    parallelize_module(layer, mesh, plan)
    split = split_of(layer)
    assert split is not None
    if split.attention is not None:  # each rank holds heads/tp heads (and key/value heads/tp)
        att = layer.get_submodule(split.attention)
        for name in _LOCAL_COUNTS:
            n = getattr(att, name, None)
            if isinstance(n, int) and not isinstance(n, bool):
                assert n % tp == 0, (name, n, tp)
                setattr(att, name, n // tp)


def _replicated_grads_reduced(layer: nn.Module) -> None:
    """Under sequence parallelism a replicated parameter (a norm's weights, a row-parallel bias) sees only its
    rank's tokens, so DTensor hands back its gradient as a partial sum over the tp ranks: all-reduce it as it
    arrives (each micro-batch; a few KiB per norm), so the accumulated gradient is whole and equal on every tp rank,
    as the runtime's data-parallel all-reduce, clipping and optimizer expect."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def whole(g: Tensor) -> Tensor:
        if isinstance(g, DTensor) and any(isinstance(p, Partial) for p in g.placements):
            return g.redistribute(g.device_mesh, [Replicate()] * g.device_mesh.ndim)
        return g

    for p in layer.parameters():
        if p.requires_grad and isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements):
            p.register_hook(whole)


def _sequence_bounds(copies: dict[int, nn.Module], split_layers: list[int], mesh) -> None:
    """Where a run of consecutive split layers begins, the whole hidden state ``[B, S, H]`` (every tp rank holds
    the same: from a replicated layer or a stage boundary) becomes this rank's sequence shard, a ``Shard(1)``
    DTensor (its gradient all-gathered in the backward); inside the run the layers pass that DTensor on (its
    ``shape`` is the whole sequence's, so masks and positions are unchanged); after the run's last layer it is
    all-gathered back to a plain tensor (its gradient, equal on every tp rank, just sliced): before a replicated
    layer (final norm, head), a stage boundary, or another chunk of this rank. A rank's chunks never touch
    (``plan.py`` refuses sp with one position and several chunks), so consecutive indices share a chunk."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ptplan.planner.errors import PtplanError

    tp = mesh.size()

    def scatter(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if isinstance(x, DTensor):
            return args
        if x.dim() < 2 or x.shape[1] % tp:
            raise PtplanError(f"sequence parallelism over tp={tp} ranks cannot split a hidden state of shape "
                              f"{tuple(x.shape)}: its sequence length must be a multiple of {tp}; profile and plan "
                              f"with such a --seq-len, or plan without sp")
        shard = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
        return (shard, *args[1:])

    def gather(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        return out.redistribute(mesh, [Replicate()]).to_local() if isinstance(out, DTensor) else out

    ids = set(split_layers)
    for i in split_layers:
        copies[i].register_forward_pre_hook(scatter)
        if i + 1 not in ids:
            copies[i].register_forward_hook(gather)


def _same(t: Tensor) -> Tensor:
    return t


def tp_split(g: Tensor) -> bool:
    """Whether a (gradient) tensor is split over the tensor-parallel mesh dimension (each tp rank a part)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(g, DTensor):
        return False
    names = g.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(g.placements[names.index("tp")], Shard)


def local(t: Tensor) -> Tensor:
    """This rank's part of a tensor (a DTensor's local shard; a plain tensor itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
