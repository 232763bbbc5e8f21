"""The contract of a model family's adapter (``Family``), the Megatron split record (``Split``) and the helpers
every family's token-sliced attention shares (``slice_mask``, ``attend``).

Legend: a token slice is ``s`` tokens at offset ``c`` of each sequence (the ``c`` earlier tokens are its
context, whose keys and values ``past`` holds); tp is the tensor-parallel width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.families import FamilyFacts, family_facts

from ptplan.executor.families.base import LayerSpec

KV = tuple[Tensor, Tensor]
"""One attention layer's keys and values, ``[B, heads, tokens, head_dim]`` each."""
Entry = tuple[nn.Module, LayerSpec]
"""One layer of the flat list and what it is."""
TensorMaps = dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]]
"""Per parameter name: (canonical -> tensor-parallel twin, twin -> canonical), for full tensors."""

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256)
"""Test sizes (4 blocks, hidden 64) shared by the BERT-like presets."""
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
"""Big enough for compute to outweigh framework overheads on a CPU (``bench/calibrate.py``)."""
BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)


@dataclass(frozen=True)
class Split:
    """Where the Megatron split of one adapter layer applies (module paths inside the layer)."""

    attention: str | None
    """The Hugging Face attention module (it holds the head size; its head counts become the rank's own);
    None: the layer has no attention."""
    qkv: tuple[str, ...] = ()
    """Query, key, value projections (GPT-2: the fused q|k|v one), split column-wise: each rank its heads."""
    out: str | None = None
    """The attention's output projection, split row-wise."""
    up: tuple[str, ...] = ()
    """The MLP's first linear(s) (Llama's gate and up projections), split column-wise."""
    down: str | None = None
    """The MLP's second linear, split row-wise."""
    norms: tuple[str, ...] = ()
    """The layer's pre-LN norms (LayerNorm/RMSNorm), which sequence parallelism runs on the rank's sequence shard
    (``executor/runtime/hybrid.py``); empty: the family has no sequence parallelism (``FamilyFacts.sequence_parallel``
    off: a post-LN layer normalises after the residual, outside the split region)."""

    @staticmethod
    def attention_of(path: str, qkv: tuple[str, ...], out: str) -> dict[str, Any]:
        """Keyword arguments of an attention split: ``qkv`` under ``path`` (``"attention.self."``), ``out`` whole."""
        return dict(attention=path.rstrip("."), qkv=tuple(path + n for n in qkv), out=out)


def halves(embedding: nn.Module, blocks: Any, half: bool, attn: Callable[[nn.Module], nn.Module],
           mlp: Callable[[nn.Module], nn.Module], whole: Callable[[nn.Module], nn.Module],
           norm: tuple[nn.Module, str] | None = None) -> list[Entry]:
    """The backbone every family has: ``embedding``, each block as its attention and MLP halves (``half``) or
    whole, then the final norm when given (``(module, name)``)."""
    out: list[Entry] = [(embedding, LayerSpec("embeddings", "embedding", None))]
    for i, blk in enumerate(blocks):
        if half:
            out.append((attn(blk), LayerSpec(f"block{i}.attn", "attention", i)))
            out.append((mlp(blk), LayerSpec(f"block{i}.mlp", "mlp", i)))
        else:
            out.append((whole(blk), LayerSpec(f"block{i}", "block", i)))
    if norm is not None:
        out.append((norm[0], LayerSpec(norm[1], "norm", None)))
    return out


class Family:
    """One model family's adapter: what a file under ``executor/families/`` defines (see the package's
    docstring). Subclass it, set the class attributes, implement ``backbone`` and ``head``; override the rest
    where the family differs (token slices, tensor-parallel preparation, export, sequence length)."""

    name: ClassVar[str]
    """The Hugging Face ``model_type``; its row in ``planner.families.FAMILY_FACTS`` must exist."""
    config_class: ClassVar[str]
    """The transformers config class (``BertConfig``)."""
    model_class: ClassVar[str]
    """The transformers task model the adapter cuts (``BertForSequenceClassification``)."""
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    """Preset name -> config keyword arguments (published sizes from the checkpoints' config.json; tiny
    sizes for tests)."""
    aliases: ClassVar[Mapping[str, str]] = {}
    """Other spellings of preset names -> the preset name."""
    dropout_fields: ClassVar[tuple[str, ...]] = ()
    """Config fields ``build_model(dropout=...)`` sets."""
    head_keys: ClassVar[frozenset[str]] = frozenset()
    """Weight names a base-model checkpoint may lack: the task head, initialised from the seed instead."""
    layer_classes: ClassVar[tuple[type[nn.Module], ...]] = ()
    """The layer wrappers this family makes (the registry finds a layer's family by its class)."""
    tp_splits: ClassVar[Mapping[type[nn.Module], Split]] = {}
    """Layer class -> its Megatron split (``executor/runtime/hybrid.py``); layers without one run replicated."""
    attention_layers: ClassVar[tuple[type[nn.Module], ...]] = ()
    """Layers that attend over earlier tokens (a token slice needs the earlier slices' keys and values)."""

    @property
    def facts(self) -> FamilyFacts:
        """The planner's row for this family."""
        f = family_facts(self.name)
        assert f is not None, f"{self.name}: no row in planner/families.py FAMILY_FACTS"
        return f

    def classes(self) -> tuple[Any, Any]:
        """(config class, task model class) from transformers."""
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)

    def backbone(self, base: nn.Module, half: bool) -> list[Entry]:
        """The base model's embedding, blocks (halves when ``half``) and, pre-LN, its final norm, as layers that
        wrap its own submodules."""
        raise NotImplementedError

    def head(self, hf: nn.Module) -> list[Entry]:
        """The task model's layers after the backbone (pooler/norm slot, head), wrapping its own submodules."""
        raise NotImplementedError

    def copied_head(self, hf: nn.Module) -> tuple[str, str] | None:
        """A head that starts as a copy of the token embedding (a pipeline cannot tie them): (its parameter's
        name in the head layer, the embedding's parameter name in layer 0); None when the head is its own."""
        return None

    def seq_len(self, config: Any, seq_len: int | None) -> int:
        """Tokens per sample (default 128), checked against the position embeddings."""
        s = 128 if seq_len is None else seq_len
        limit = self.position_limit(config)
        if not 1 <= s <= limit:
            raise PtplanError(f"sequence length {s} is outside 1..{limit} (the position embeddings of this model)")
        return s

    def position_limit(self, config: Any) -> int:
        """The longest sequence the position embeddings cover."""
        return int(config.max_position_embeddings)

    def slice_forward(self, layer: nn.Module, x: Tensor, offset: int, past: KV | None,
                      attention_mask: Tensor | None) -> tuple[Tensor, KV | None]:
        """One of this family's layers on one token slice: its output and, for an attention layer, the slice's
        keys and values. Families without token slices refuse."""
        raise PtplanError(f"token slicing cannot run a {type(layer).__name__} layer ({self.name}); it supports the "
                          f"causal LMs' layers (planner/families.py TOKEN_SLICE_FAMILIES)")

    def tp_twin(self, layer: nn.Module, tp: int) -> TensorMaps:
        """Make a copy of one of this family's layers splittable by ``parallelize_module`` (GPT-2: its Conv1Ds
        become nn.Linears); the maps between its parameters and the copy's. Most families: nothing, {}."""
        return {}

    def to_hf(self, hf: nn.Module, head: nn.Module) -> None:
        """Export mapping: after the adapter's layers (laid over ``hf``) received the trained weights, finish
        ``hf`` (``head``: the last layer). Default: nothing (the layers hold hf's own parameters)."""


# ---- token-sliced attention, shared by the causal families ------------------------------------------

def slice_mask(q_len: int, offset: int, x: Tensor, attention_mask: Tensor | None,
               window: int | None = None) -> Tensor:
    """Additive mask [B|1, 1, s, c+s]: query offset+i sees keys 0..offset+i (within ``window`` earlier tokens
    when given, as a sliding window does) and no padded key."""
    k_len = offset + q_len
    q = torch.arange(offset, k_len, device=x.device)[:, None]
    k = torch.arange(k_len, device=x.device)[None, :]
    keep = k <= q
    if window is not None:
        keep = keep & (k > q - window)
    keep = keep[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask[:, None, None, :k_len].to(torch.bool)
    return torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, torch.finfo(x.dtype).min)


def attend(q: Tensor, k: Tensor, v: Tensor, past: KV | None, scaling: float, mask: Tensor,
           dropout: nn.Module | None = None) -> Tensor:
    """Eager attention of q over [past; this slice] keys/values (GQA: key heads repeated)."""
    if past is not None:
        k = torch.cat([past[0], k], dim=2)
        v = torch.cat([past[1], v], dim=2)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    w = torch.matmul(q, k.transpose(-1, -2)) * scaling + mask
    w = F.softmax(w, dim=-1).type(v.dtype)
    if dropout is not None:
        w = dropout(w)
    return torch.matmul(w, v).transpose(1, 2)
