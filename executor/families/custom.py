"""Your own model: layers, head and loss as the ``LayeredModel`` that the profiler, the planner (through its
profile) and the elastic runtime take."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

from ptplan.executor.families.base import LayeredModel, LayerSpec
from ptplan.executor.families.registry import families


def custom_model(layers: Sequence[nn.Module], specs: Sequence[LayerSpec], loss: Callable[[Tensor, Tensor], Tensor],
                 *, name: str, config: Any, seq_len: int, num_labels: int = 2, family: str | None = None,
                 granularity: str = "half", image_size: int | None = None,
                 make_batch: Callable[..., tuple[Tensor, Tensor, Tensor | None]] | None = None) -> LayeredModel:
    """Your own model as the ``LayeredModel`` that the profiler, ``ptplan``'s planner (through its
    profile) and the elastic runtime (``training.run_training``) take.

    ``layers``: the model in execution order, each an ``nn.Module`` with ``forward(x, attention_mask=None)``
    (one tensor in, one out; the ``[B, S]`` 0/1 padding mask reaches every layer), e.g.
    ``backbone_layers(hf_model)`` plus your head. ``specs``: one ``LayerSpec`` per layer; layers of
    Transformer block i have ``block=i`` (blocks numbered 0..L-1 in order, each block's layers
    contiguous): freezing counts blocks, and a block's layers freeze together with everything before
    them. ``loss(output_of_last_layer, labels) -> scalar`` (the mean over the micro-batch: the runtime
    averages micro-batches). ``config``: the backbone's Hugging Face config (``hidden_size`` and
    ``vocab_size`` are read). ``family``: the backbone's model_type (default ``config.model_type``):
    it says what the inputs are (token ids, or pixels for ``vit``). ``make_batch(batch_size,
    generator) -> (inputs, labels, attention_mask or None)``: synthetic data of your shapes (the
    profiler and the data checks use it); default: the family's (ids ``[B, seq_len]`` with class
    labels ``[B]`` in ``0..num_labels-1``).

    Your layers are used as given, whole: every rank that runs them starts with all their weights and
    frees the layers it does not hold at the first phase switch (``build_model``'s models are built
    per stage instead). Parameters you leave on the meta device count as not built on that rank.
    """
    layers, specs = list(layers), list(specs)
    if not layers or len(layers) != len(specs):
        raise PtplanError(f"custom_model needs one LayerSpec per layer; got {len(layers)} layers and {len(specs)} specs")
    for i, (m, sp) in enumerate(zip(layers, specs)):
        if not isinstance(m, nn.Module):
            raise PtplanError(f"layer {i} is a {type(m).__name__}, not an nn.Module")
        if not isinstance(sp, LayerSpec):
            raise PtplanError(f"spec {i} is a {type(sp).__name__}, not a LayerSpec")
        params = inspect.signature(m.forward).parameters
        if "attention_mask" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            raise PtplanError(f"layer {i} ({sp.name}, {type(m).__name__}) must take forward(x, attention_mask=None)")
    blocks = [sp.block for sp in specs if sp.block is not None]
    if not blocks:
        raise PtplanError("custom_model needs at least one layer with a block index (LayerSpec.block)")
    runs = [b for j, b in enumerate(blocks) if j == 0 or b != blocks[j - 1]]
    if runs != list(range(len(runs))):
        raise PtplanError(f"block indices must run 0, 1, ..., L-1 in order with each block's layers contiguous; "
                          f"got {blocks}")
    if len({sp.name for sp in specs}) != len(specs):
        raise PtplanError("layer names (LayerSpec.name) must be unique")
    fam = family or getattr(config, "model_type", None)
    if fam not in families():
        raise PtplanError(f"family {fam!r}: give the backbone's model_type, one of {', '.join(families())}")
    if not callable(loss):
        raise PtplanError("loss must be callable as loss(output, labels) -> scalar tensor")
    if num_labels < 1 or seq_len < 1:
        raise PtplanError(f"num_labels and seq_len must be >= 1, got {num_labels} and {seq_len}")
    return LayeredModel(name=name, family=str(fam), granularity=granularity, config=config, seq_len=seq_len,
                        num_blocks=len(runs), layers=layers, specs=specs, num_labels=num_labels,
                        image_size=image_size, loss_fn=loss, batch_fn=make_batch)
