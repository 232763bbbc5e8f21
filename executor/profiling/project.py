"""Projected profiles: every layer's operations counted exactly on the meta device, timed by a device model.

``ptplan profile MODEL --project h100 --dtype bfloat16`` writes a ``ptplan.profile/1`` file for a GPU
nobody here has. Nothing runs on real data: the model is moved to the ``meta`` device (tensors with
shapes, no storage; ``swapped`` puts meta copies in for the duration), and each layer's forward (grad enabled), backward (input and weight gradients; and the input gradient alone,
so that the weight-gradient part zero-bubble schedules run apart is their difference)
and no-grad forward run under a dispatch mode that records every aten operation with

- its FLOPs, from ``torch.utils.flop_counter``'s formulas (matrix multiplies, convolutions,
  attention kernels; elementwise operations count 0: they are bound by memory, below);
- its bytes moved: the sizes of its tensor inputs and outputs (views move nothing and are skipped).

Each operation then takes ``launch + max(FLOPs / (peak x eff(FLOPs)), bytes / (bandwidth x eff_mem))``
(a roofline with the device model's efficiency assumptions, ``planner/devices.py``), and a layer's
time is the sum of its operations'. The optimizer step (AdamW, per layer) reads the weights, the
gradients and both moments and writes the weights and both moments back: 7 weight-sized streams.

Memory fields are exact, not projected: parameter, gradient and optimizer bytes from the tensors' shapes,
output and saved-for-backward bytes per sample from the measuring profiler's own memory pass run on *fake
CPU tensors* (``torch._subclasses.fake_tensor``: CPU device, shapes, no storage; one forward of the largest
micro-batch up to ``MEMORY_BATCH`` samples, saved tensors counted through ``saved_tensors_hooks``), so
torch's dispatcher picks the same kernels as on a real CPU and a projected profile's memory equals a
measured one's. (The timing pass runs on the meta device, where torch would take the unfused attention path,
which saves more than the CPU's or CUDA's fused kernels; ``FusedAttention`` runs attention there as the fused
kernel a GPU picks, so its time is one kernel's, not softmax's and dropout's over b·heads·s².) No weight is ever allocated: build the model
with ``build_model(name, layers=[])`` (every parameter on meta) and a 175 B model projects in seconds in a
few hundred MiB; a model with real weights works too and is left as it was found. The whole-model step is
the sum of the layers (a projection has no second measurement to check it against), and the provenance
says ``projected`` with the device model, so every plan made from it warns.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ptplan.planner.costs import optimizer_state_bytes
from ptplan.planner.devices import DeviceModel
from ptplan.planner.errors import PtplanError
from ptplan.planner.profile import DeviceInfo, LayerRecord, ModelInfo, Profile, Provenance, WholeModel

from ptplan.executor.families import LayeredModel, config_summary
from ptplan.executor.profiling.live_bytes import LayerBytes, memory_pass

# aten operations that only change a tensor's view of its storage: no kernel moves data
_VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze", "unsqueeze",
          "slice", "select", "as_strided", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind",
          "narrow", "_reshape_alias", "view_as", "expand_as", "unfold", "diagonal", "lift_fresh", "empty",
          "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_to_copy_meta", "is_same_size",
          "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense"}
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "convolution_backward",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention_backward",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
           "_flash_attention_forward", "_efficient_attention_forward", "_flash_attention_backward",
           "_efficient_attention_backward"}


MEMORY_BATCH = 8
"""The memory pass runs at the largest projected micro-batch size up to this. Bytes per sample hardly
depend on the size: bert-tiny's blocks save the same at 4 and 8 samples; only the embedding's
sample-independent part (5,408 vs 4,880 bytes per sample) is spread over more samples."""


@dataclass(frozen=True)
class Op:
    """One recorded aten operation."""

    name: str
    flops: float
    bytes: float


class _Recorder(TorchDispatchMode):
    """Records (name, FLOPs, bytes moved) of every aten operation run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _VIEWS:
            return out
        moved = sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                    if isinstance(t, Tensor))
        flops = 0.0
        count = flop_registry.get(func.overloadpacket)
        if count is not None:
            flops = float(count(*args, **kwargs, out_val=out))
        self.ops.append(Op(name=name, flops=flops, bytes=float(moved)))
        return out


class FusedAttention(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` as the fused kernel a GPU runs it with (``aten._scaled_dot_product_
    efficient_attention``: one kernel forward, one backward, nothing of size s² in memory) instead of the unfused
    math path the meta device falls back to (softmax, dropout and masking over b·heads·s² elements, each a memory-
    bound kernel of its own). CUDA's dispatcher picks flash or memory-efficient attention for fp16/bf16 and an
    additive mask; both count the same FLOPs. Grouped key/value heads are repeated first (a copy a GPU's GQA kernel
    would not make; small)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        extra = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]))
        extra.update(kwargs)
        mask, causal = extra.get("attn_mask"), bool(extra.get("is_causal", False))
        if k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        bias = None
        if mask is not None:
            bias = (torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
                    if mask.dtype == torch.bool else mask.to(q.dtype))
            bias = bias.expand(*q.shape[:-1], k.shape[-2])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, q.requires_grad or k.requires_grad or v.requires_grad,
            float(extra.get("dropout_p", 0.0) or 0.0), causal, scale=extra.get("scale"))
        return out[0]


def op_seconds(op: Op, device: DeviceModel, dtype: str) -> float:
    """One operation's projected seconds (see the module docstring): the device's roofline with its efficiency
    curve (``planner.devices.DeviceModel.op_seconds``)."""
    return device.op_seconds(op.flops, op.bytes, dtype, matmul=op.name in _MATMUL)


@contextlib.contextmanager
def swapped(model: nn.Module, convert: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Every parameter and buffer of ``model`` replaced by ``convert`` of it for the duration (a tensor that several
    modules share stays shared), the originals put back afterwards: the model is left as it was found."""
    memo: dict[int, Tensor] = {}
    undo: list[tuple[dict[str, Any], str, Tensor]] = []
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if t is None:
                    continue
                new = memo.get(id(t))
                if new is None:
                    new = convert(t.detach())
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    memo[id(t)] = new
                undo.append((table, key, t))
                table[key] = new
    try:
        yield
    finally:
        for table, key, t in reversed(undo):
            table[key] = t


def fake_memory_pass(model: LayeredModel, b: int) -> LayerBytes:
    """Per layer output, saved-for-backward and backward-working bytes per sample of one forward and backward of b
    samples, as the measuring profiler's memory pass (``live_bytes.memory_pass``) counts them on a real CPU, but on
    fake CPU tensors: the same kernels are chosen, no storage is allocated (the model may be on meta; it is left as
    found)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = torch.device("cpu")

    def fake(t: Tensor) -> Tensor:
        return FakeTensor(mode, t.to("meta"), cpu)

    x, labels, mask = model.make_batch(b, meta=True)
    with swapped(model, fake), torch.random.fork_rng(devices=[]), mode:
        return memory_pass(model, fake(x), fake(labels), None if mask is None else fake(mask), b)


@dataclass(frozen=True)
class LayerOps:
    """A layer's recorded operations for one micro-batch size (its memory comes from ``fake_memory_pass``)."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    """The whole backward (input and weight gradients)."""
    input_grad: tuple[Op, ...]
    """The input gradient alone (empty for the first layer, whose input is data)."""
    nograd: tuple[Op, ...]


def record_layers(model: LayeredModel, b: int) -> list[LayerOps]:
    """Every layer of ``model`` (already on the meta device) run on a meta micro-batch of b samples."""
    return _record(model, b)


def _same_as(layer: nn.Module, kind: str, i: int, n: int, h: Tensor) -> tuple[Any, ...] | None:
    """What makes two layers' recorded operations equal: class, kind, the module tree (``repr``: widths, eps,
    dropout), every parameter's and buffer's shape and dtype, and the input's; None for the first and last layer
    (the data and the loss)."""
    if i == 0 or i == n - 1:
        return None
    tensors = tuple((k, tuple(t.shape), t.dtype) for k, t in (*layer.named_parameters(), *layer.named_buffers()))
    return type(layer).__qualname__, kind, repr(layer), tensors, tuple(h.shape), h.dtype


def _record(model: LayeredModel, b: int) -> list[LayerOps]:
    """Every layer of ``model`` (already on the meta device) run on a meta micro-batch of b samples. A layer equal
    to two recorded before (``_same_as``: a Transformer's repeated blocks) takes the second one's record (the first
    may include a shared module's first-call work, e.g. a rotary cache), so a 126-block model records a few layers,
    not all, and the records equal recording every layer."""
    x, labels, mask = model.make_batch(b, meta=True)
    out: list[LayerOps] = []
    seen: dict[tuple[Any, ...], tuple[LayerOps, torch.Size, torch.dtype]] = {}
    once: set[tuple[Any, ...]] = set()  # the first of equal layers may differ (shared modules' first-call work)
    h = x
    n = len(model.layers)
    for i, layer in enumerate(model.layers):
        key = _same_as(layer, model.specs[i].kind, i, n, h)
        if key is not None and key in seen:
            ops, shape, dtype = seen[key]
            out.append(ops)
            h = torch.empty(shape, dtype=dtype, device="meta")
            continue
        ops, h = _record_layer(model, i, h, mask, labels)
        out.append(ops)
        if key is not None and key in once:
            seen[key] = (ops, h.shape, h.dtype)
        elif key is not None:
            once.add(key)
    model.train()
    return out


def _record_layer(model: LayeredModel, i: int, h: Tensor, mask: Tensor | None, labels: Tensor
                  ) -> tuple[LayerOps, Tensor]:
    """Layer i's forward, backward (whole and input gradient alone) and no-grad forward on input h, recorded; and
    its output (detached), the next layer's input."""
    layer, n = model.layers[i], len(model.layers)
    layer.train()
    xin = h if i == 0 else h.detach().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    fwd = _Recorder()
    with FusedAttention(), fwd:
        y = layer(xin, attention_mask=mask)
        loss = model.loss(y, labels) if i == n - 1 else None
    # the whole backward, and the input gradient alone (B); the weight gradient (W, which zero-bubble
    # schedules run apart) is the difference: a separate weight-only pass would redo the gradients
    # of intermediate activations
    root, seed = (loss, None) if loss is not None else (y, torch.ones_like(y))
    bwd, inp = _Recorder(), _Recorder()
    if i > 0:
        with inp:
            torch.autograd.grad(root, [xin], grad_outputs=seed, retain_graph=True, allow_unused=True)
    with bwd:
        torch.autograd.grad(root, ([xin] if i > 0 else []) + params, grad_outputs=seed, allow_unused=True)
    layer.eval()
    nog = _Recorder()
    with torch.no_grad(), FusedAttention(), nog:
        yn = layer(h.detach(), attention_mask=mask)
        if i == n - 1:
            model.loss(yn, labels)
    ops = LayerOps(forward=tuple(fwd.ops), backward=tuple(bwd.ops), input_grad=tuple(inp.ops), nograd=tuple(nog.ops))
    return ops, y.detach()


@dataclass(frozen=True)
class Counted:
    """Everything a projection needs from the model, counted once (``count_model``): re-timing it on another device
    model (``time_counted``) costs milliseconds, so efficiency constants can be fitted without counting again."""

    info: ModelInfo
    specs: tuple[Any, ...]
    """The layers' ``LayerSpec`` (name, kind, block)."""
    sizes: tuple[tuple[int, int], ...]
    """Per layer (parameters, parameter bytes)."""
    out_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    working_bytes: tuple[int, ...]
    """Per layer, the backward's working set per sample (``live_bytes``)."""
    accumulate_bytes: tuple[int, ...]
    """Per layer, what its backward makes more when adding into existing ``.grad``."""
    stash_bytes: tuple[int, ...]
    """Per layer, what its split backward's B leaves for its W, per sample (``live_bytes.stash_step``)."""
    batch_sizes: tuple[int, ...]
    ops: tuple[tuple[LayerOps, ...], ...]
    """Per batch size, per layer, the recorded operations."""
    memory_batch: int


def count_model(model: LayeredModel, batch_sizes: Sequence[int]) -> Counted:
    """Count ``model``'s operations (meta device) and memory (fake CPU tensors) at each batch size. The model's
    parameters may be on the meta device (``build_model(name, layers=[])``: nothing is allocated) or real; it is
    left as found."""
    params = list(model.parameters())
    if not params:
        raise PtplanError(f"model {model.name} has no parameters")
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(params[0].dtype)
    if dtype is None:
        raise PtplanError(f"cannot project a {params[0].dtype} model; use float32, bfloat16 or float16")
    bs = sorted(set(int(b) for b in batch_sizes))
    if not bs or bs[0] < 1:
        raise PtplanError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
    sizes = tuple((sum(p.numel() for p in layer.parameters()),
                   sum(p.numel() * p.element_size() for p in layer.parameters())) for layer in model.layers)
    mb = max(b for b in bs if b <= MEMORY_BATCH) if bs[0] <= MEMORY_BATCH else bs[0]
    mem = fake_memory_pass(model, mb)  # the measuring profiler's memory pass, on fake tensors
    modes = [(m, m.training) for m in model.modules()]
    with swapped(model, lambda t: t.to("meta")):
        per_b = tuple(tuple(record_layers(model, b)) for b in bs)
    for m, training in modes:
        m.training = training
    info = ModelInfo(name=model.name, family=model.family, num_blocks=model.num_blocks, seq_len=model.seq_len,
                     dtype=dtype, granularity=model.granularity, config=config_summary(model))
    return Counted(info=info, specs=tuple(model.specs), sizes=sizes, out_bytes=tuple(mem.output),
                   saved_bytes=tuple(mem.saved), working_bytes=tuple(mem.working),
                   accumulate_bytes=tuple(mem.accumulate), stash_bytes=tuple(mem.stash), batch_sizes=tuple(bs), ops=per_b,
                   memory_batch=mb)


def project_profile(model: LayeredModel, device: DeviceModel, *, batch_sizes: Sequence[int],
                    command: str = "", date: str = "") -> Profile:
    """A ``projected`` profile of ``model`` on ``device`` (``count_model`` then ``time_counted``). The model's
    parameters may be on the meta device (``build_model(name, layers=[])``: nothing is allocated, any size
    projects) or real; it is left as found."""
    params = list(model.parameters())
    if params:  # refuse a dtype the device cannot run before any work
        device.matmul_peak({torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(params[0].dtype, "float32"))
    return time_counted(count_model(model, batch_sizes), device, command=command, date=date)


def time_counted(counted: Counted, device: DeviceModel, *, command: str = "", date: str = "") -> Profile:
    """The ``projected`` profile of counted operations on ``device``: each operation on its roofline
    (``op_seconds``), the AdamW step as 7 weight-sized streams; memory fields as counted."""
    c = counted
    dtype, bs, per_b = c.info.dtype, c.batch_sizes, c.ops
    device.matmul_peak(dtype)
    e = device.efficiency

    def secs(ops: Sequence[Op]) -> float:
        return sum(op_seconds(op, device, dtype) for op in ops)

    records = []
    for i, spec in enumerate(c.specs):
        count, nbytes = c.sizes[i]
        opt = 0.0 if count == 0 else 2 * e.launch_s + 7 * nbytes / (device.memory_bandwidth * e.memory)
        records.append(LayerRecord(
            index=i, name=spec.name, kind=spec.kind, block=spec.block, params=count, param_bytes=nbytes,
            grad_bytes=nbytes, optimizer_bytes=int(optimizer_state_bytes(count, dtype)),
            output_bytes_per_sample=c.out_bytes[i],
            saved_bytes_per_sample=c.saved_bytes[i], backward_working_bytes_per_sample=c.working_bytes[i],
            accumulate_bytes=c.accumulate_bytes[i], backward_stash_bytes_per_sample=c.stash_bytes[i],
            forward_s=tuple(secs(p[i].forward) for p in per_b), backward_s=tuple(secs(p[i].backward) for p in per_b),
            backward_weight_s=tuple(max(0.0, secs(p[i].backward) - secs(p[i].input_grad)) for p in per_b),
            nograd_forward_s=tuple(secs(p[i].nograd) for p in per_b), optimizer_s=opt))
    fwd = tuple(sum(r.forward_s[j] for r in records) for j in range(len(bs)))
    fb = tuple(sum(r.forward_s[j] + r.backward_s[j] for r in records) for j in range(len(bs)))
    flops = [sum(op.flops for op in p[i].forward + p[i].backward) for p in per_b[-1:] for i in range(len(records))]
    return Profile(
        model=c.info,
        device=DeviceInfo(kind="cuda", name=device.name, memory_bytes=device.memory_bytes,
                          torch_version=torch.__version__, date=date),
        batch_sizes=tuple(bs), layers=tuple(records), whole_model=WholeModel(forward_s=fwd, forward_backward_s=fb),
        measurement={"method": "projected: aten operations counted on the meta device, timed by a roofline",
                     "memory_batch_size": c.memory_batch,
                     "device_source": device.source, "efficiency": vars(e),
                     "flops_at_largest_batch": math.fsum(flops), "whole_model": "sum of the layers (projected)"},
        provenance=Provenance(source="projected", command=command, device_model=device.key))
