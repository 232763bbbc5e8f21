"""The one registry of model families: the rest of the executor asks it (by model_type or by layer) instead of
keeping its own per-family tables or isinstance chains.

Families are found from the planner's table (``planner/families.py`` ``FAMILY_FACTS``): each row names the
module under ``executor/families/`` whose ``FAMILIES`` tuple holds its ``Family``; the modules are imported on
first use (so ``base.py`` and ``weights.py`` can be imported by the family files without a cycle).
"""
from __future__ import annotations

import importlib

from torch import Tensor, nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.families import FAMILY_FACTS

from ptplan.executor.families.family import KV, Family, Split, TensorMaps

REFUSED_FAMILIES = {
    "deberta-v2": (
        "DeBERTa-v2/v3 cannot be cut into a pipeline's layer list: every block's disentangled attention reads "
        "the encoder's one relative-position table (encoder.rel_embeddings, with its LayerNorm), a parameter "
        "shared by all blocks, and a pipeline cannot share one parameter between stages (copying it per block "
        "would train L different tables, unlike the model; configs with conv_kernel_size > 0 also add the "
        "embedding output back after block 0, a second tensor a stage boundary cannot carry)"),
    "deberta": ("DeBERTa (v1) cannot be cut into a pipeline's layer list: its blocks share one relative-position "
                "table (encoder.rel_embeddings), a parameter a pipeline cannot share between stages"),
}
"""model_type -> why it has no adapter (``build_model`` refuses it with this reason)."""

_families: dict[str, Family] = {}
_by_layer: dict[type[nn.Module], Family] = {}


def _load() -> dict[str, Family]:
    if _families:
        return _families
    found: dict[str, Family] = {}
    for name, facts in FAMILY_FACTS.items():
        module = importlib.import_module(f"ptplan.executor.families.{facts.module}")
        fam = {f.name: f for f in module.FAMILIES}.get(name)
        assert fam is not None, f"executor/families/{facts.module}.py defines no Family named {name!r}"
        found[name] = fam
    for fam in found.values():
        for cls in fam.layer_classes:
            assert cls not in _by_layer, f"{cls.__name__} is registered by two families"
            _by_layer[cls] = fam
        for cls, split in fam.tp_splits.items():  # the planner offers sp exactly where the runtime can split norms
            assert bool(split.norms) == fam.facts.sequence_parallel, \
                f"{fam.name}: {cls.__name__}'s Split.norms disagree with FamilyFacts.sequence_parallel"
    _families.update(found)
    return _families


def families() -> dict[str, Family]:
    """Every family by model_type, in the planner table's order."""
    return dict(_load())


def get(model_type: str) -> Family:
    """The family of a Hugging Face model_type; PtplanError for a refused or unknown one."""
    fams = _load()
    if model_type in REFUSED_FAMILIES:
        raise PtplanError(REFUSED_FAMILIES[model_type])
    if model_type not in fams:
        raise PtplanError(f"no adapter for the model type {model_type!r}; ptplan has adapters for "
                          f"{', '.join(fams)}")
    return fams[model_type]


def of_layer(layer: nn.Module) -> Family | None:
    """The family whose file defines ``layer``'s class (None for a shared layer: norm, classifier head, or a
    custom model's own)."""
    _load()
    return _by_layer.get(type(layer))


def tp_split(layer: nn.Module) -> Split | None:
    """``layer``'s Megatron split (its family's ``tp_splits``), None when it runs replicated."""
    fam = of_layer(layer)
    return None if fam is None else fam.tp_splits.get(type(layer))


def tp_twin(layer: nn.Module, tp: int) -> TensorMaps:
    """Prepare a copy of ``layer`` for ``parallelize_module`` (its family's ``tp_twin``); the parameter maps."""
    fam = of_layer(layer)
    return {} if fam is None else fam.tp_twin(layer, tp)


def tp_families() -> tuple[str, ...]:
    """The families whose attention and MLP layers tensor parallelism splits."""
    return tuple(n for n, f in _load().items() if f.tp_splits)


def is_attention(layer: nn.Module) -> bool:
    """Whether the layer attends over earlier tokens (so a token slice needs their keys and values)."""
    fam = of_layer(layer)
    return fam is not None and isinstance(layer, fam.attention_layers)


def slice_forward(layer: nn.Module, x: Tensor, offset: int, past: KV | None,
                  attention_mask: Tensor | None = None) -> tuple[Tensor, KV | None]:
    """One layer on one token slice (tokens offset .. offset+s-1 of each sequence): its output and, for an
    attention layer, this slice's keys and values (``past``: the earlier slices' keys and values). A final
    norm is token-wise; every other layer is its family's (``Family.slice_forward``)."""
    from ptplan.executor.families.base import NormLayer

    if type(layer) is NormLayer:
        return layer(x), None  # token-wise: a slice is the same as the whole sequence's rows
    fam = of_layer(layer)
    if fam is None:
        raise PtplanError(f"token slicing cannot run a {type(layer).__name__} layer; it supports the causal LM "
                          f"families' layers ({', '.join(n for n, f in _load().items() if f.facts.token_slices)})")
    return fam.slice_forward(layer, x, offset, past, attention_mask)
