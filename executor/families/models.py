"""Model adapters: Hugging Face BERT, RoBERTa, DistilBERT, ViT, GPT-2, Llama, Mistral and Qwen2 as a flat
list of layers plus a loss; or your own layers and loss (``custom_model``).

Every adapter has the same shape, whatever the family (L = number of Transformer blocks)::

    embedding, (block0.attn, block0.mlp, ..., block{L-1}.mlp) | (block0, ..., block{L-1}), norm, head

so a "half" model has 2L + 3 layers and a "block" model L + 3. Every layer is an ``nn.Module`` with
``forward(x, attention_mask=None) -> Tensor``: one tensor in, one tensor out, plus the raw ``[B, S]``
0/1 padding mask (long) that a pipeline passes to every stage; layers that need it build their own
4-D additive mask, layers that don't ignore it. The layers wrap the Hugging Face submodules
themselves (the task model built from a transformers config, its weights initialised as transformers
does or read from a local folder's weight files), so they compute exactly what the Hugging Face model
computes. ``build_model(..., layers=...)`` gives weights to some layers only (a pipeline stage: the
other parameters stay on the meta device) with the values the whole model has there.

Per family (a model's family is its Hugging Face config's ``model_type``, which picks the adapter):

- **bert** (like ``BertForSequenceClassification``): ``embeddings`` (word + position + token type,
  LayerNorm) -> blocks; a block's attention half is ``BertAttention`` (self-attention, dense,
  residual, post-LN) and its MLP half is ``BertIntermediate`` + ``BertOutput`` (dense, GELU, dense,
  residual, post-LN) -> ``pooler`` (dense + tanh on token 0; BERT is post-LN and has no final norm,
  so the pooler takes the ``norm`` slot and kind; its output is ``[B, H]``) -> ``head`` (dropout +
  linear classifier, ``[B, num_labels]``). Loss: cross-entropy on the labels ``[B]``.
- **roberta** (like ``RobertaForSequenceClassification``): BERT's embedding and block layers (RoBERTa's
  positions start after the padding id, from the ids themselves) -> ``pooler`` (the first half of
  ``RobertaClassificationHead``: token 0, dropout, dense, tanh) -> ``head`` (dropout, ``out_proj``).
- **distilbert** (like ``DistilBertForSequenceClassification``): ``embeddings`` (word + position,
  LayerNorm) -> blocks (post-LN halves ``sa_layer_norm(x + attention(x))``,
  ``output_layer_norm(x + ffn(x))``) -> ``pre_classifier`` (token 0, dense, ReLU; the ``norm`` slot)
  -> ``head`` (dropout, classifier).
- **deberta-v2** is refused (``REFUSED_FAMILIES`` says why: one relative-position table shared by
  every block, which a pipeline cannot share between stages).
- **vit** (like ``ViTForImageClassification``): ``embeddings`` (patches + CLS + positions) ->
  blocks (pre-LN halves: ``x + attn(LN(x))``, ``x + mlp(LN(x))``) -> ``layernorm`` -> ``head``
  (classifier on token 0). Inputs are pixels ``[B, 3, H, W]``; there is no attention mask.
  ``seq_len`` = patches + 1.
- **gpt2** (like ``GPT2LMHeadModel``): ``embeddings`` (wte + wpe) -> blocks (pre-LN halves) with an
  **explicit causal mask** combined with the padding mask (blocks called one by one are not causal
  otherwise with eager attention) -> ``ln_f`` -> ``head`` (LM head). Loss: next-token
  cross-entropy (logits at t predict labels at t+1; label -100 is ignored).
  **The LM head is untied**: Hugging Face ties it to ``wte``, but a pipeline cannot share one
  parameter between its first and last stage, so the head is a separate Parameter initialised as a
  copy of ``wte``. The two then train independently (the head's parameters are counted separately).
- **llama**, **mistral**, **qwen2** (like ``LlamaForCausalLM``, ``MistralForCausalLM``,
  ``Qwen2ForCausalLM``: the same structure, run through the same layers; a sliding window becomes a
  banded mask): ``embeddings`` (``embed_tokens`` only) -> blocks (pre-RMSNorm halves, grouped-query
  attention with RoPE for positions 0..S-1, recomputed in each attention half from the shared
  ``rotary_emb``, which has no parameters, and the same explicit causal + padding mask as GPT-2) ->
  ``norm`` -> ``head`` (``lm_head``). Loss as GPT-2's. A checkpoint with tied embeddings is untied
  the same way (the head becomes a copy of ``embed_tokens``).

Names: ``*-tiny`` are small configs for tests (4 blocks, hidden 64); ``*-small`` (4 blocks, hidden
256; ViT 64x64 pixels in 8x8 patches) are big enough for compute to outweigh framework overheads on
a CPU (the calibration benchmark, ``bench/calibrate.py``); the others have the published sizes
(Hugging Face's names: ``roberta-base``, ``gpt2-xl``, ``vit-huge-patch14-224``, ``mistral-7b``, ...).
A local Hugging Face folder is a model too: its config.json sets the architecture and picks the
adapter; its weights are loaded when it has weight files, else every weight is initialised from
``seed`` (enough for profiling). With ``weights=DIR`` under a name, the architecture comes from
``DIR/config.json`` (as ``from_pretrained`` does) and must have the named model's layer structure.
A folder model is named by its Hugging Face name (config.json's ``_name_or_path`` when that is a hub
name) or else its folder's name: profiles record it, and the family apart. Missing head weights (a
base-model checkpoint) are initialised from ``seed``; any other missing or mismatched weight is an
error. Initialisation is per Hugging Face submodule, each from its own seed (``module_seed``), so the
same ``seed`` gives the same weights whichever layers are built, at either granularity -- but not the
weights ``model_cls(config)`` gives after ``torch.manual_seed(seed)``.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

FAMILIES = ("bert", "vit", "gpt2", "llama", "roberta", "distilbert", "mistral", "qwen2")
"""The Hugging Face ``model_type``s ptplan has an adapter for; a model's family is its config's model_type."""
CAUSAL_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
"""Families whose head is a language-model head: next-token loss, labels = token ids."""
CLASSIFIER_FAMILIES = ("bert", "roberta", "distilbert", "vit")
"""Families whose head is a classifier (``num_labels`` classes, cross-entropy on ``[B]`` labels)."""
ADAPTERS = {"bert": "bert", "roberta": "bert", "distilbert": "distilbert", "vit": "vit", "gpt2": "gpt2",
            "llama": "llama", "mistral": "llama", "qwen2": "llama"}
"""model_type -> the layer structure that runs it (RoBERTa's blocks are BERT's; Mistral's and Qwen2's Llama's)."""
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
GRANULARITIES = ("block", "half")

_TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256)
_SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
_BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
_BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
_ROBERTA = dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                pad_token_id=1, bos_token_id=0, eos_token_id=2)
_LLAMA_TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=1024, max_position_embeddings=512)
_LLAMA3_ROPE = dict(rope_type="llama3", high_freq_factor=4.0, low_freq_factor=1.0,
                    original_max_position_embeddings=8192)
# name -> (family, config keyword arguments). Real sizes from the published checkpoints' config.json
# (written here, no network); tests/test_models.py checks their parameter counts against the published ones.
_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert-tiny": ("bert", dict(_TINY, vocab_size=1024)),
    "bert-small": ("bert", dict(_SMALL, vocab_size=1024)),
    "bert-base": ("bert", dict(_BERT_BASE)),
    "bert-large": ("bert", dict(_BERT_LARGE)),
    "vit-tiny": ("vit", dict(_TINY, image_size=32, patch_size=8)),
    "vit-small": ("vit", dict(_SMALL, image_size=64, patch_size=8)),
    "vit-base": ("vit", dict(_BERT_BASE, image_size=224, patch_size=16)),
    "vit-large": ("vit", dict(_BERT_LARGE, image_size=224, patch_size=16)),
    "gpt2-tiny": ("gpt2", dict(n_embd=64, n_layer=4, n_head=4, vocab_size=1024, bos_token_id=1023,
                                eos_token_id=1023)),
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12)),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16)),
    # Llama family (RoPE, RMSNorm, grouped-query attention); Mistral and Qwen2 share the block structure.
    "llama-tiny": ("llama", dict(_LLAMA_TINY)),
    # the other families' test sizes
    "roberta-tiny": ("roberta", dict(_TINY, vocab_size=1024, max_position_embeddings=514, type_vocab_size=1,
                                     layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)),
    "distilbert-tiny": ("distilbert", dict(dim=64, n_layers=4, n_heads=4, hidden_dim=256, vocab_size=1024)),
    "mistral-tiny": ("mistral", dict(_LLAMA_TINY, sliding_window=None)),
    "qwen2-tiny": ("qwen2", dict(_LLAMA_TINY, tie_word_embeddings=True)),
    # Hugging Face names (the published configs' sizes)
    "bert-base-uncased": ("bert", dict(_BERT_BASE)),
    "bert-large-uncased": ("bert", dict(_BERT_LARGE)),
    "bert-base-cased": ("bert", dict(_BERT_BASE, vocab_size=28996)),
    "roberta-base": ("roberta", dict(_BERT_BASE, **_ROBERTA)),
    "roberta-large": ("roberta", dict(_BERT_LARGE, **_ROBERTA)),
    "distilroberta-base": ("roberta", dict(_BERT_BASE, num_hidden_layers=6, **_ROBERTA)),
    "distilbert-base-uncased": ("distilbert", dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072,
                                                   vocab_size=30522)),
    "gpt2-large": ("gpt2", dict(n_embd=1280, n_layer=36, n_head=20)),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25)),
    "vit-base-patch16-224": ("vit", dict(_BERT_BASE, image_size=224, patch_size=16)),
    "vit-large-patch16-224": ("vit", dict(_BERT_LARGE, image_size=224, patch_size=16)),
    "vit-huge-patch14-224": ("vit", dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16,
                                         intermediate_size=5120, image_size=224, patch_size=14)),
    "llama-2-7b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                                 max_position_embeddings=4096, rms_norm_eps=1e-5)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_parameters=dict(_LLAMA3_ROPE, rope_theta=500000.0, factor=32.0))),
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5,
                                   rope_parameters=dict(_LLAMA3_ROPE, rope_theta=500000.0, factor=8.0))),
    "mistral-7b": ("mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                                   max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=4096,
                                   rope_theta=10000.0)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                   max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                   rope_theta=1000000.0)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                 max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0)),
}
_ALIASES = {"vit-huge": "vit-huge-patch14-224", "distilbert-base": "distilbert-base-uncased",
            "mistral-7b-v0.1": "mistral-7b", "qwen2-0.5b": "qwen2.5-0.5b", "qwen2-7b": "qwen2.5-7b"}
"""Other spellings of preset names."""
_FIRST = ("bert-tiny", "bert-base", "bert-large", "vit-tiny", "vit-base", "vit-large", "gpt2-tiny", "gpt2",
          "gpt2-medium", "bert-small", "vit-small", "llama-tiny")
MODEL_NAMES: tuple[str, ...] = _FIRST + tuple(n for n in _PRESETS if n not in _FIRST)
"""Every preset name (``_ALIASES`` spell some of them otherwise; a local folder is a model too)."""
_DEFAULT_SEQ_LEN = {f: 128 for f in FAMILIES if f != "vit"}
_DROPOUT_FIELDS = {
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"),
    "roberta": ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"),
    "distilbert": ("dropout", "attention_dropout", "seq_classif_dropout"),
    "vit": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "llama": ("attention_dropout",),
    "mistral": ("attention_dropout",),
    "qwen2": ("attention_dropout",),
}
# Keys a base-model checkpoint may lack: the task head, initialised from the seed instead.
_HEAD_KEYS = {"bert": {"classifier.weight", "classifier.bias"},
              "roberta": {"classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
                          "classifier.out_proj.bias"},
              "distilbert": {"pre_classifier.weight", "pre_classifier.bias", "classifier.weight", "classifier.bias"},
              "vit": {"classifier.weight", "classifier.bias"},
              "gpt2": {"lm_head.weight"},
              "llama": {"lm_head.weight"},
              "mistral": {"lm_head.weight"},
              "qwen2": {"lm_head.weight"}}


@dataclass(frozen=True)
class LayerSpec:
    """What one entry of the flat layer list is."""

    name: str
    """e.g. ``embeddings``, ``block3.attn``, ``block3.mlp``, ``block3``, ``pooler``, ``head``."""
    kind: str
    """``embedding`` | ``block`` | ``attention`` | ``mlp`` | ``norm`` | ``head``."""
    block: int | None
    """Transformer block index for block/attention/mlp layers, None otherwise."""


# ---- masks -------------------------------------------------------------------------------------

def bert_additive_mask(attention_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``[B, S]`` 0/1 -> ``[B, 1, 1, S]`` additive mask (0 keep, dtype-min drop), as BERT expects."""
    if attention_mask is None:
        return None
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def causal_additive_mask(x: Tensor, attention_mask: Tensor | None, window: int | None = None) -> Tensor:
    """``[B|1, 1, S, S]`` additive mask: causal (within ``window`` earlier tokens when given), and also
    dropping padded keys when a mask is given."""
    S = x.shape[1]
    keep = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    if window is not None:
        keep = keep.triu(-(window - 1))
    keep = keep[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask[:, None, None, :].to(torch.bool)
    zeros = torch.zeros(keep.shape, dtype=x.dtype, device=x.device)
    return zeros.masked_fill(~keep, torch.finfo(x.dtype).min)


# ---- BERT layers -------------------------------------------------------------------------------

class BertEmbeddingLayer(nn.Module):
    """Token ids ``[B, S]`` -> hidden ``[B, S, H]`` (word + position + token-type, LayerNorm, dropout)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.embeddings(input_ids=x)


class BertAttentionHalf(nn.Module):
    """Self-attention, output dense, dropout, residual and post-LayerNorm (``BertAttention``)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.attention(x, bert_additive_mask(attention_mask, x.dtype))[0]


class BertMLPHalf(nn.Module):
    """Intermediate dense + activation, output dense, dropout, residual and post-LayerNorm."""

    def __init__(self, intermediate: nn.Module, output: nn.Module) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.output = output

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.output(self.intermediate(x), x)


class BertBlock(nn.Module):
    """One whole ``BertLayer``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.layer(x, attention_mask=bert_additive_mask(attention_mask, x.dtype))


class BertPoolerLayer(nn.Module):
    """Dense + tanh on token 0: ``[B, S, H]`` -> ``[B, H]``."""

    def __init__(self, pooler: nn.Module) -> None:
        super().__init__()
        self.pooler = pooler

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.pooler(x)


class ClassifierHead(nn.Module):
    """Dropout + linear classifier on ``[B, H]`` (or on token 0 of ``[B, S, H]`` with ``first_token``)."""

    def __init__(self, classifier: nn.Module, dropout: nn.Module | None = None, first_token: bool = False) -> None:
        super().__init__()
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.classifier = classifier
        self.first_token = first_token

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if self.first_token:
            x = x[:, 0, :]
        return self.classifier(self.dropout(x))


# ---- RoBERTa and DistilBERT layers (RoBERTa's embeddings and blocks run through the BERT layers) ----------

class TokenZeroDense(nn.Module):
    """Token 0 of ``[B, S, H]`` -> dropout (when given) -> dense -> activation: ``[B, H]``.

    The first part of RoBERTa's ``RobertaClassificationHead`` (dropout, dense, tanh) and of DistilBERT's
    classifier (``pre_classifier``, ReLU); it takes the ``norm`` slot, as BERT's pooler does.
    """

    def __init__(self, dense: nn.Module, activation: str, dropout: nn.Module | None = None) -> None:
        super().__init__()
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.dense = dense
        self.activation = activation

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        h = self.dense(self.dropout(x[:, 0, :]))
        return torch.tanh(h) if self.activation == "tanh" else F.relu(h)


class DistilBertEmbeddingLayer(nn.Module):
    """Token ids ``[B, S]`` -> word + position embeddings, LayerNorm, dropout (no token types)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.embeddings(x)


class DistilBertAttentionHalf(nn.Module):
    """``sa_layer_norm(x + attention(x))`` (post-LN), with the padding mask."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.attention = block.attention
        self.sa_layer_norm = block.sa_layer_norm

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        h, _ = self.attention(x, attention_mask=bert_additive_mask(attention_mask, x.dtype))
        return self.sa_layer_norm(h + x)


class DistilBertMLPHalf(nn.Module):
    """``output_layer_norm(x + ffn(x))`` (post-LN)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.ffn = block.ffn
        self.output_layer_norm = block.output_layer_norm

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.output_layer_norm(self.ffn(x) + x)


class DistilBertBlock(nn.Module):
    """One whole DistilBERT ``TransformerBlock``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.block(x, attention_mask=bert_additive_mask(attention_mask, x.dtype))


# ---- ViT layers --------------------------------------------------------------------------------

class ViTEmbeddingLayer(nn.Module):
    """Pixels ``[B, C, H, W]`` -> ``[B, patches + 1, hidden]`` (patch projection, CLS, positions)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        w = self.embeddings.patch_embeddings.projection.weight
        if x.dtype != w.dtype:
            x = x.to(w.dtype)
        return self.embeddings(x)


class ViTAttentionHalf(nn.Module):
    """``x + dropout(attention(layernorm_before(x)))``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layernorm_before = layer.layernorm_before
        self.attention = layer.attention
        self.dropout = layer.dropout

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        h, _ = self.attention(self.layernorm_before(x), None)
        return self.dropout(h) + x


class ViTMLPHalf(nn.Module):
    """``x + dropout(mlp(layernorm_after(x)))``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layernorm_after = layer.layernorm_after
        self.mlp = layer.mlp
        self.dropout = layer.dropout

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.dropout(self.mlp(self.layernorm_after(x))) + x


class ViTBlock(nn.Module):
    """One whole ``ViTLayer``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.layer(x, None)


class NormLayer(nn.Module):
    """A final LayerNorm (ViT ``layernorm``, GPT-2 ``ln_f``)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.norm(x)


# ---- GPT-2 layers ------------------------------------------------------------------------------

class GPT2EmbeddingLayer(nn.Module):
    """Token ids ``[B, S]`` -> ``wte(ids) + wpe(positions)``, dropout."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        pos = torch.arange(x.shape[1], device=x.device)[None]
        return self.drop(self.wte(x) + self.wpe(pos))


class GPT2AttentionHalf(nn.Module):
    """``x + attn(ln_1(x))`` with an explicit causal (and padding) mask."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.ln_1 = block.ln_1
        self.attn = block.attn

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        h, _ = self.attn(self.ln_1(x), attention_mask=causal_additive_mask(x, attention_mask))
        return h + x


class GPT2MLPHalf(nn.Module):
    """``x + mlp(ln_2(x))``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.ln_2 = block.ln_2
        self.mlp = block.mlp

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.mlp(self.ln_2(x)) + x


class GPT2BlockLayer(nn.Module):
    """One whole ``GPT2Block`` with an explicit causal (and padding) mask."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.block(x, attention_mask=causal_additive_mask(x, attention_mask))


class LMHead(nn.Module):
    """Untied LM head: ``x @ weight.T`` with its own weight (initialised as a copy of ``wte``)."""

    def __init__(self, wte_weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(wte_weight.detach().clone())

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return F.linear(x, self.weight)


# ---- Llama-family layers (Llama, Mistral, Qwen2) ----------------------------------------------

class LlamaEmbeddingLayer(nn.Module):
    """Token ids ``[B, S]`` -> ``embed_tokens(ids)`` (positions enter each attention as RoPE)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.embed_tokens(x)


def sliding_window(self_attn: nn.Module) -> int | None:
    """The attention's sliding window (Mistral: the config's ``sliding_window``; Qwen2: its layer's, set
    only for ``sliding_attention`` layers), None when it attends to every earlier token."""
    w = getattr(self_attn, "sliding_window", None)
    if w is None and type(self_attn).__name__.startswith("Mistral"):
        w = getattr(self_attn.config, "sliding_window", None)
    return int(w) if w else None


class LlamaAttentionHalf(nn.Module):
    """``x + self_attn(input_layernorm(x))`` with RoPE for positions 0..S-1 and a causal (and padding) mask.

    The rotary tables are recomputed per layer from the shared ``rotary_emb`` (no parameters), so a
    stage needs nothing but the hidden states. With a sliding window (Mistral, Qwen2's sliding layers)
    the mask is banded as Hugging Face's: token i sees tokens j with i - window < j <= i.
    """

    def __init__(self, block: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = block.input_layernorm
        self.self_attn = block.self_attn
        self.window = sliding_window(block.self_attn)
        object.__setattr__(self, "_rotary", rotary_emb)  # buffers only; not a submodule of every layer

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        pos = torch.arange(x.shape[1], device=x.device)[None]
        rotary = self._rotary.to(x.device)
        pe = rotary(x, position_ids=pos)
        mask = causal_additive_mask(x, attention_mask, window=self.window)
        h, _ = self.self_attn(self.input_layernorm(x), position_embeddings=pe, attention_mask=mask)
        return x + h


class LlamaMLPHalf(nn.Module):
    """``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.post_attention_layernorm = block.post_attention_layernorm
        self.mlp = block.mlp

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBlockLayer(nn.Module):
    """One whole decoder layer: the attention half then the MLP half."""

    def __init__(self, block: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.attn = LlamaAttentionHalf(block, rotary_emb)
        self.mlp = LlamaMLPHalf(block)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.mlp(self.attn(x, attention_mask), attention_mask)


class LinearHead(nn.Module):
    """A bias-free linear head used as is (Llama's ``lm_head``, untied in the presets)."""

    def __init__(self, lm_head: nn.Module) -> None:
        super().__init__()
        self.lm_head = lm_head

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.lm_head(x)


# ---- the adapter -------------------------------------------------------------------------------

@contextlib.contextmanager
def streamed(module: nn.Module, device: torch.device, *, what: str = "module") -> Iterator[None]:
    """Run ``module`` on ``device`` for the duration of the block, one module's weights at a time.

    Parameters and buffers stored elsewhere (host memory, while ``device`` is a GPU) get a copy on
    ``device`` for the block and their own storage back after it, so the copy is freed as soon as
    the block ends: how the AutoCache's fill streams a frozen prefix kept in host memory through a
    GPU one layer at a time. Nothing to do (the common case, and always on a CPU) when every
    tensor is on ``device`` already. Only under ``torch.no_grad()``: autograd would keep the copies
    and send gradients to them. A parameter without storage (a layer another rank holds; see
    ``executor/runtime/elastic.py``) is an error that names the layer.
    """
    tensors = [*module.parameters(), *module.buffers()]
    if any(p.numel() == 0 for p in module.parameters()):
        raise RuntimeError(f"{what} has no weights on this process (another rank's stage holds it)")
    away = [t for t in tensors if t.device != device]
    if not away:
        yield
        return
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} lives on {away[0].device}, not {device}; streaming it is only for no-grad "
                           f"forwards (the frozen prefix)")
    kept = [t.data for t in away]
    try:
        for t, home in zip(away, kept):
            t.data = home.to(device, non_blocking=True)
        yield
    finally:
        for t, home in zip(away, kept):
            t.data = home


class LayeredModel(nn.Module):
    """A Transformer as a flat, execution-ordered ``layers`` list with a loss and synthetic batches."""

    def __init__(self, *, name: str, family: str, granularity: str, config: Any, seq_len: int,
                 num_blocks: int, layers: list[nn.Module], specs: list[LayerSpec], num_labels: int,
                 image_size: int | None = None, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
                 batch_fn: Callable[..., tuple[Tensor, Tensor, Tensor | None]] | None = None) -> None:
        super().__init__()
        assert len(layers) == len(specs)
        self.name, self.family, self.granularity = name, family, granularity
        self.config = config
        self.seq_len, self.num_blocks = seq_len, num_blocks
        self.num_labels = num_labels
        self.image_size = image_size
        self.layers = nn.ModuleList(layers)
        self.specs = tuple(specs)
        # plain attributes, not submodules (a loss module has no weights to train or move)
        object.__setattr__(self, "loss_fn", loss_fn)
        object.__setattr__(self, "batch_fn", batch_fn)

    @property
    def custom(self) -> bool:
        """Made by ``custom_model`` (the user's layers or loss), not by ``build_model``."""
        return self.loss_fn is not None or self.batch_fn is not None

    def forward(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Run every layer in order: raw inputs -> logits."""
        return self.run_layers(inputs, 0, len(self.layers), attention_mask)

    def run_layers(self, x: Tensor, lo: int, hi: int, attention_mask: Tensor | None = None) -> Tensor:
        """Run ``layers[lo:hi]`` on x (raw inputs when lo == 0, else the output of layer lo-1).

        A layer whose tensors live on another device than x (a frozen prefix kept in host memory
        while x is on a GPU) is streamed: see ``streamed``.
        """
        if not 0 <= lo <= hi <= len(self.layers):
            raise ValueError(f"layer range [{lo}, {hi}) is outside [0, {len(self.layers)}]")
        for i in range(lo, hi):
            with streamed(self.layers[i], x.device, what=f"layer {i}"):
                x = self.layers[i](x, attention_mask=attention_mask)
        return x

    def loss(self, output: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy (causal LMs: next-token, ignoring label -100), computed in float32; or the
        ``loss_fn`` given to ``custom_model``."""
        if self.loss_fn is not None:
            return self.loss_fn(output, labels)
        if self.family in CAUSAL_FAMILIES:
            logits = output[:, :-1, :].float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return F.cross_entropy(output.float(), labels)

    def make_batch(self, batch_size: int, generator: torch.Generator | None = None
                   ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Synthetic (inputs, labels, attention_mask-or-None) of the right shapes and dtypes.

        BERT: ids ``[B, S]``, class labels ``[B]``, all-ones mask ``[B, S]``. GPT-2: ids, labels =
        the ids, all-ones mask. ViT: pixels ``[B, 3, H, W]`` in the model dtype, class labels, None.
        Tensors are created on the CPU with ``generator`` and moved to the model's device.
        """
        if batch_size < 1:
            raise PtplanError(f"batch size must be >= 1, got {batch_size}")
        p = next(self.parameters())
        if p.device.type == "meta":  # a stage build whose first layer another rank builds: the CPU
            p = torch.empty(0, dtype=p.dtype)
        if self.batch_fn is not None:
            bx, by, bm = self.batch_fn(batch_size, generator)
            bx = bx.to(p.device, p.dtype) if bx.is_floating_point() else bx.to(p.device)
            return bx, by.to(p.device), None if bm is None else bm.to(p.device)
        B, S = batch_size, self.seq_len
        if self.family == "vit":
            c = self.config
            x = torch.randn(B, c.num_channels, self.image_size, self.image_size, generator=generator)
            y = torch.randint(0, self.num_labels, (B,), generator=generator)
            return x.to(p.device, p.dtype), y.to(p.device), None
        ids = torch.randint(1, self.config.vocab_size, (B, S), generator=generator)
        mask = torch.ones(B, S, dtype=torch.long)
        y = ids.clone() if self.family in CAUSAL_FAMILIES else torch.randint(0, self.num_labels, (B,), generator=generator)
        return ids.to(p.device), y.to(p.device), mask.to(p.device)


# ---- building --------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' load report and progress bars for the duration."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _classes(family: str):
    """(config class, task model class) of a family (a Hugging Face model_type)."""
    import transformers as tf

    return {"bert": (tf.BertConfig, tf.BertForSequenceClassification),
            "roberta": (tf.RobertaConfig, tf.RobertaForSequenceClassification),
            "distilbert": (tf.DistilBertConfig, tf.DistilBertForSequenceClassification),
            "vit": (tf.ViTConfig, tf.ViTForImageClassification),
            "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[family]


def _apply_overrides(config: Any, family: str, *, num_labels: int, dropout: float | None,
                     image_size: int | None) -> None:
    if family in CLASSIFIER_FAMILIES:
        config.num_labels = num_labels
    if dropout is not None:
        for f in _DROPOUT_FIELDS[family]:
            setattr(config, f, dropout)
    if image_size is not None:
        config.image_size = image_size


# ---- which model: a preset name or a local folder ----------------------------------------------

@dataclass(frozen=True)
class ModelSource:
    """Where a model's architecture and weights come from, and what profiles call it."""

    label: str
    """The model's name in profiles, plans and logs: the preset name, or for a folder its Hugging Face
    name (config.json's ``_name_or_path`` when that is a hub name) or else the folder's name."""
    family: str
    """The Hugging Face ``model_type`` (picks the adapter: ``ADAPTERS``)."""
    preset: dict[str, Any] | None
    """Config keyword arguments of a preset (None for a folder)."""
    folder: Path | None
    """A Hugging Face model folder (config.json; None for a preset)."""
    load_weights: bool
    """Load the folder's weight files (else every weight is initialised from the seed)."""


def is_model_folder(name: str | os.PathLike) -> bool:
    """Whether ``name`` names a local folder (a Hugging Face model folder, or meant as one)."""
    return Path(name).is_dir()


def _weight_files(d: Path) -> list[Path]:
    return sorted([*d.glob("*.safetensors"), *d.glob("pytorch_model*.bin")])


def _check_family(model_type: Any, where: str) -> str:
    if model_type in REFUSED_FAMILIES:
        raise PtplanError(f"{where} is a {model_type!r} model, which ptplan refuses: {REFUSED_FAMILIES[model_type]}. "
                          f"Supported: {', '.join(FAMILIES)}")
    if model_type not in FAMILIES:
        raise PtplanError(f"{where} is a {model_type!r} model; ptplan has adapters for the model types "
                          f"{', '.join(FAMILIES)}")
    return str(model_type)


def read_folder_config(folder: str | os.PathLike) -> dict[str, Any]:
    """config.json of a Hugging Face model folder as a dict, its model_type checked (PtplanError otherwise)."""
    d = Path(folder)
    if not d.is_dir():
        raise PtplanError(f"model folder not found: {d}")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise PtplanError(f"{d} has no config.json; expected a Hugging Face model folder (save_pretrained output)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PtplanError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(raw, dict):
        raise PtplanError(f"{cfg_path} is not a JSON object")
    _check_family(raw.get("model_type"), f"{cfg_path}")
    return raw


def folder_label(folder: str | os.PathLike, raw: dict[str, Any]) -> str:
    """A folder model's name: config.json's ``_name_or_path`` when it is a hub name (``org/name`` or
    ``name``, not a local path), else the folder's own name."""
    d = Path(folder).absolute()
    hub = raw.get("_name_or_path")
    if (isinstance(hub, str) and hub.strip() and hub == hub.strip() and hub.count("/") <= 1
            and not hub.startswith(("/", ".", "~")) and "\\" not in hub and not Path(hub).exists()):
        return hub
    return d.name or str(d)


def _preset(name: str) -> tuple[str, dict[str, Any]] | None:
    key = _ALIASES.get(name, name)
    return _PRESETS.get(key)


def _unknown(name: str) -> PtplanError:
    hint = (f"; {name} looks like a path but is not a folder" if any(c in name for c in "/\\") or name.startswith(".")
            else "")
    return PtplanError(f"unknown model {name!r}{hint}; choose one of {', '.join(MODEL_NAMES)}, or give a local "
                       f"Hugging Face model folder (its config.json is enough; weights are loaded when present)")


def model_source(name: str | os.PathLike, weights: str | os.PathLike | None = None) -> ModelSource:
    """Resolve ``name`` (a preset, an alias, or a local model folder) and ``weights`` (a folder of weights
    whose config.json sets the architecture) into a ModelSource; PtplanError when neither works.

    The adapter follows the folder's config.json ``model_type``; a preset name given with ``weights`` of
    another layer structure (e.g. ``gpt2`` with a BERT folder) is refused, one of the same structure
    (``llama-tiny`` with a Mistral folder) is run with the folder's own model type.
    """
    name = str(name)
    preset = _preset(name)
    if preset is None and not is_model_folder(name):
        raise _unknown(name)
    if weights is None:
        if preset is not None:
            return ModelSource(label=_ALIASES.get(name, name), family=preset[0], preset=dict(preset[1]),
                               folder=None, load_weights=False)
        raw = read_folder_config(name)
        d = Path(name)
        return ModelSource(label=folder_label(d, raw), family=raw["model_type"], preset=None, folder=d,
                           load_weights=bool(_weight_files(d)))
    d = Path(weights)
    if not d.is_dir():
        raise PtplanError(f"weights folder not found: {d}")
    raw = read_folder_config(d)
    family = raw["model_type"]
    named = preset[0] if preset is not None else read_folder_config(name)["model_type"]
    if ADAPTERS[named] != ADAPTERS[family]:
        raise PtplanError(f"weights in {d} are a {family!r} model but {name} is a {named!r} model; give the folder "
                          f"itself as the model (ptplan profile {d} / ptplan run --model {d}) or pick a {family} "
                          f"model name")
    if not _weight_files(d):
        raise PtplanError(f"weights folder {d} has no *.safetensors or pytorch_model*.bin weight files; to build "
                          f"the model from its config.json alone (random init), give the folder as the model "
                          f"(ptplan profile {d})")
    return ModelSource(label=folder_label(d, raw), family=family, preset=None, folder=d, load_weights=True)


def family_of(name: str | os.PathLike) -> str | None:
    """The family (model_type) of a preset name or model folder; None when ``name`` is neither (or the
    folder's config cannot be read)."""
    preset = _preset(str(name))
    if preset is not None:
        return preset[0]
    if not is_model_folder(name):
        return None
    try:
        return str(read_folder_config(name)["model_type"])
    except PtplanError:
        return None


def preset_config(name: str) -> Any:
    """The Hugging Face config of a preset (or alias), as ``build_model`` builds it (before overrides)."""
    preset = _preset(name)
    if preset is None:
        raise _unknown(name)
    family, kw = preset
    with _quiet_transformers():
        return _classes(family)[0](**kw)


def _seq_len_for(family: str, config: Any, seq_len: int | None) -> int:
    if family == "vit":
        if config.image_size % config.patch_size:
            raise PtplanError(f"image size {config.image_size} is not a multiple of the patch size "
                              f"{config.patch_size}")
        n = (config.image_size // config.patch_size) ** 2 + 1
        if seq_len is not None and seq_len != n:
            raise PtplanError(f"ViT's sequence length is set by the image size: {config.image_size}px with "
                              f"patch {config.patch_size} gives {n} tokens, not {seq_len}; use --image-size")
        return n
    s = _DEFAULT_SEQ_LEN[family] if seq_len is None else seq_len
    limit = config.max_position_embeddings
    if family == "roberta":  # positions start after the padding index (RoBERTa's 514 = 512 + 2)
        limit -= config.pad_token_id + 1
    if not 1 <= s <= limit:
        raise PtplanError(f"sequence length {s} is outside 1..{limit} (the position embeddings of this model)")
    return s


def _flatten(family: str, hf: nn.Module, granularity: str) -> tuple[list[nn.Module], list[LayerSpec]]:
    """The task model ``hf`` of ``family`` as the flat layer list (the layers hold hf's own submodules)."""
    if family in REFUSED_FAMILIES:
        raise PtplanError(REFUSED_FAMILIES[family])
    layers: list[nn.Module] = []
    specs: list[LayerSpec] = []

    def add(m: nn.Module, name: str, kind: str, block: int | None = None) -> None:
        layers.append(m)
        specs.append(LayerSpec(name, kind, block))

    def add_backbone() -> None:
        blayers, bspecs = backbone_layers(hf, granularity)
        layers.extend(blayers)
        specs.extend(bspecs)

    adapter = ADAPTERS[family]
    add_backbone()
    if family == "bert":
        add(BertPoolerLayer(hf.bert.pooler), "pooler", "norm")
        add(ClassifierHead(hf.classifier, hf.dropout), "head", "head")
    elif family == "roberta":  # RobertaClassificationHead: token 0, dropout, dense, tanh | dropout, out_proj
        c = hf.classifier
        add(TokenZeroDense(c.dense, "tanh", c.dropout), "pooler", "norm")
        add(ClassifierHead(c.out_proj, c.dropout), "head", "head")
    elif family == "distilbert":  # token 0, pre_classifier, ReLU | dropout, classifier
        add(TokenZeroDense(hf.pre_classifier, "relu"), "pre_classifier", "norm")
        add(ClassifierHead(hf.classifier, hf.dropout), "head", "head")
    elif adapter == "llama":
        if hf.lm_head.weight is hf.model.embed_tokens.weight:  # tied: a pipeline cannot share it, untie
            hf.lm_head.weight = nn.Parameter(hf.model.embed_tokens.weight.detach().clone())
            hf.config.tie_word_embeddings = False
        add(LinearHead(hf.lm_head), "head", "head")
    elif family == "vit":
        add(ClassifierHead(hf.classifier, first_token=True), "head", "head")
    else:
        add(LMHead(hf.transformer.wte.weight), "head", "head")  # untied: see the module docstring
    return layers, specs


def _base_model(hf: nn.Module) -> tuple[str, nn.Module]:
    """(family, base model) of a Hugging Face model: the base model itself (``BertModel``) or a task model's
    (``BertForSequenceClassification.bert``)."""
    config = getattr(hf, "config", None)
    family = getattr(config, "model_type", None)
    if family in REFUSED_FAMILIES:
        raise PtplanError(REFUSED_FAMILIES[family])
    if family not in FAMILIES:
        raise PtplanError(f"{type(hf).__name__} is a {family!r} model; ptplan can cut {', '.join(FAMILIES)} models "
                          f"into layers (or give custom_model your own layer list)")
    base = getattr(hf, "base_model", hf)
    return str(family), base


def backbone_layers(hf: nn.Module, granularity: str = "half") -> tuple[list[nn.Module], list[LayerSpec]]:
    """A Hugging Face model's embedding, blocks and (pre-LN families) final norm as ptplan layers.

    ``hf``: a base model (``BertModel``, ``RobertaModel``, ``DistilBertModel``, ``ViTModel``,
    ``GPT2Model``, ``LlamaModel``, ``MistralModel``, ``Qwen2Model``) or a task model holding one. The
    layers wrap hf's own submodules (training them trains hf). Post-LN encoders (BERT, RoBERTa,
    DistilBERT) end with their last block; ViT, GPT-2 and the Llama family with their final norm.
    Add a head and a loss and hand them to ``custom_model``.
    """
    if granularity not in GRANULARITIES:
        raise PtplanError(f"unknown granularity {granularity!r}; choose one of {', '.join(GRANULARITIES)}")
    family, base = _base_model(hf)
    adapter = ADAPTERS[family]
    half = granularity == "half"
    layers: list[nn.Module] = []
    specs: list[LayerSpec] = []

    def add(m: nn.Module, name: str, kind: str, block: int | None = None) -> None:
        layers.append(m)
        specs.append(LayerSpec(name, kind, block))

    if adapter == "bert":
        add(BertEmbeddingLayer(base.embeddings), "embeddings", "embedding")
        for i, blk in enumerate(base.encoder.layer):
            if half:
                add(BertAttentionHalf(blk.attention), f"block{i}.attn", "attention", i)
                add(BertMLPHalf(blk.intermediate, blk.output), f"block{i}.mlp", "mlp", i)
            else:
                add(BertBlock(blk), f"block{i}", "block", i)
    elif adapter == "distilbert":
        add(DistilBertEmbeddingLayer(base.embeddings), "embeddings", "embedding")
        for i, blk in enumerate(base.transformer.layer):
            if half:
                add(DistilBertAttentionHalf(blk), f"block{i}.attn", "attention", i)
                add(DistilBertMLPHalf(blk), f"block{i}.mlp", "mlp", i)
            else:
                add(DistilBertBlock(blk), f"block{i}", "block", i)
    elif adapter == "vit":
        add(ViTEmbeddingLayer(base.embeddings), "embeddings", "embedding")
        for i, blk in enumerate(base.layers):
            if half:
                add(ViTAttentionHalf(blk), f"block{i}.attn", "attention", i)
                add(ViTMLPHalf(blk), f"block{i}.mlp", "mlp", i)
            else:
                add(ViTBlock(blk), f"block{i}", "block", i)
        add(NormLayer(base.layernorm), "layernorm", "norm")
    elif adapter == "llama":
        add(LlamaEmbeddingLayer(base.embed_tokens), "embeddings", "embedding")
        for i, blk in enumerate(base.layers):
            if half:
                add(LlamaAttentionHalf(blk, base.rotary_emb), f"block{i}.attn", "attention", i)
                add(LlamaMLPHalf(blk), f"block{i}.mlp", "mlp", i)
            else:
                add(LlamaBlockLayer(blk, base.rotary_emb), f"block{i}", "block", i)
        add(NormLayer(base.norm), "norm", "norm")
    else:
        add(GPT2EmbeddingLayer(base.wte, base.wpe, base.drop), "embeddings", "embedding")
        for i, blk in enumerate(base.h):
            if half:
                add(GPT2AttentionHalf(blk), f"block{i}.attn", "attention", i)
                add(GPT2MLPHalf(blk), f"block{i}.mlp", "mlp", i)
            else:
                add(GPT2BlockLayer(blk), f"block{i}", "block", i)
        add(NormLayer(base.ln_f), "ln_f", "norm")
    return layers, specs


def build_model(name: str | os.PathLike, *, granularity: str = "half", seq_len: int | None = None,
                image_size: int | None = None, num_labels: int = 2, dtype: torch.dtype = torch.float32,
                dropout: float | None = None, weights: str | os.PathLike | None = None, seed: int = 0,
                layers: Iterable[int] | None = None) -> LayeredModel:
    """Build the adapter for ``name`` on the CPU, in ``dtype``.

    ``name``: a preset (``MODEL_NAMES``, or an alias such as ``vit-huge``) or a local Hugging Face model
    folder: its config.json sets the architecture and picks the adapter (by ``model_type``), and its
    weights are loaded when the folder has weight files (else every weight is initialised from
    ``seed``: enough for profiling). ``seq_len``: tokens per sample (text models; default 128).
    ``image_size``: ViT pixels per side (default the config's: 224, tiny 32). ``dropout``: None keeps
    the config's, a number sets every dropout of the model. ``weights``: a local folder whose weights
    to load (its config.json sets the sizes, as ``from_pretrained`` does). ``seed``: initialises every
    weight not loaded. The model's ``name`` is the preset name, or the folder's model name
    (``folder_label``); its ``family`` is the Hugging Face model_type.

    ``layers``: the indices of the layers to give weights (a pipeline stage's, issue 10); None: all.
    The module tree is always whole (every layer, every buffer, every ``nn.Parameter`` with its shape
    and dtype), but the parameters of the other layers stay on the meta device: no storage, no
    initialisation, nothing read from the weight files (``_build_layers``). A layer's weights are the
    same whichever layers are built with it (and at either granularity): each Hugging Face submodule is
    initialised from its own seed (``module_seed(seed, its name)``) by the model's own ``_init_weights``,
    or each tensor is loaded on its own from the weight files, so a rank that builds its stage holds
    exactly the values the whole model holds there.
    """
    if granularity not in GRANULARITIES:
        raise PtplanError(f"unknown granularity {granularity!r}; choose one of {', '.join(GRANULARITIES)}")
    if num_labels < 1:
        raise PtplanError(f"num_labels must be >= 1, got {num_labels}")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise PtplanError(f"dropout must be in [0, 1), got {dropout}")
    src = model_source(name, weights)
    family = src.family
    if image_size is not None and family != "vit":
        raise PtplanError(f"--image-size applies to ViT models only, not {src.label} (a {family} model)")
    if image_size is not None and image_size < 1:
        raise PtplanError(f"image size must be >= 1, got {image_size}")
    if seq_len is not None and seq_len < 1:
        raise PtplanError(f"sequence length must be >= 1, got {seq_len}")
    overrides = dict(num_labels=num_labels, dropout=dropout, image_size=image_size)
    config_cls, model_cls = _classes(family)
    with _quiet_transformers():
        if src.folder is not None:
            try:
                config = config_cls.from_pretrained(src.folder, local_files_only=True)
            except (OSError, ValueError, TypeError, KeyError) as e:
                raise PtplanError(f"cannot read the {family} config in {src.folder}: {e}") from None
        else:
            config = config_cls(**(src.preset or {}))
    _apply_overrides(config, family, **overrides)
    _seq_len_for(family, config, seq_len)  # validate before paying for the weights
    with _quiet_transformers(), _params_on_meta():
        hf = model_cls(config)
    n = _seq_len_for(family, config, seq_len)
    hf.eval()
    flat, specs = _flatten(family, hf, granularity)
    model = LayeredModel(name=src.label, family=family, granularity=granularity, config=config, seq_len=n,
                         num_blocks=config.num_hidden_layers, layers=flat, specs=specs,
                         num_labels=num_labels, image_size=config.image_size if family == "vit" else None)
    want = sorted(set(range(len(flat)) if layers is None else layers))
    if want and not 0 <= want[0] <= want[-1] < len(flat):
        raise PtplanError(f"layers {want} are outside the model's {len(flat)} layers [0, {len(flat)})")
    _build_layers(family, hf, model, want, seed, src.folder if src.load_weights else None)
    model.to(dtype=dtype)
    model.eval()
    return model


def module_seed(seed: int, name: str) -> int:
    """The seed that initialises the Hugging Face submodule ``name`` (e.g. ``bert.encoder.layer.3.output.dense``)
    of a model built with ``seed`` (``build_model``): the same whichever layers, granularity or process build it."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=7).digest(), "little")


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Build Hugging Face modules with every parameter on the meta device and every buffer real (what
    accelerate's ``init_empty_weights(include_buffers=False)`` does): each registered parameter is moved
    to meta as it is registered, torch's and transformers' initialisation are switched off
    (``no_init_weights``: the CPU tensors a module creates are never written, so never paged in), and so
    is transformers' weight tying (it runs in ``init_weights``). Buffers (BERT's position_ids and
    token_type_ids, the rotary ``inv_freq``) are computed by the modules' own ``__init__``, as always."""
    from transformers.initialization import no_init_weights

    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            p = self._parameters[name]
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _give_storage(p: nn.Parameter, value: Tensor) -> None:
    """Give meta parameter ``p`` the storage ``value`` (same Python object: ``swap_tensors``)."""
    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))


def _post_order(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module``'s submodules (path, module), children first, as transformers' ``initialize_weights``
    visits them."""
    out: list[tuple[str, nn.Module]] = []

    def visit(path: str, m: nn.Module) -> None:
        for name, c in m.named_children():
            visit(f"{path}.{name}" if path else name, c)
        out.append((path, m))

    visit("", module)
    return out


def _init_layer(hf: nn.Module, layer: nn.Module, seed: int, names: dict[int, str], what: str,
                later: frozenset[str] = frozenset()) -> None:
    """Give every meta parameter of ``layer`` storage and initialise it as transformers does -- the model's
    ``_init_weights`` on each submodule, children first -- each submodule from its own seed
    (``module_seed(seed, its name in hf)``; ``names``: id -> that name). ``later``: the names of parameters
    the caller sets itself (a copied head)."""
    from transformers import initialization as hf_init

    fresh = [p for p in layer.parameters() if p.device.type == "meta"]
    for p in fresh:
        _give_storage(p, torch.full(p.shape, float("nan"), dtype=p.dtype))
    with torch.random.fork_rng(devices=[]), torch.no_grad(), hf_init.guard_torch_init_functions():
        for path, m in _post_order(layer):
            torch.manual_seed(module_seed(seed, names.get(id(m), f"{what}/{path}")))
            hf._init_weights(m)
    left = [n for n, p in layer.named_parameters()
            if n not in later and p.is_floating_point() and bool(torch.isnan(p).any())]
    assert not left, f"{what}: {type(hf).__name__}._init_weights leaves {left} uninitialised"


def _copied_heads(family: str, hf: nn.Module, model: LayeredModel) -> dict[int, tuple[str, str]]:
    """Heads that start as a copy of the token embedding (GPT-2's untied LM head; a tied Llama-family head,
    untied here): {head layer index: (its parameter's name in the head, the embedding's name in layer 0)}."""
    last = len(model.layers) - 1
    if family == "gpt2":
        return {last: ("weight", "wte.weight")}
    if ADAPTERS[family] == "llama" and getattr(hf.config, "tie_word_embeddings", False):
        hf.config.tie_word_embeddings = False  # a pipeline cannot share it: the head becomes a copy
        return {last: ("lm_head.weight", "embed_tokens.weight")}
    return {}


def _build_layers(family: str, hf: nn.Module, model: LayeredModel, want: list[int], seed: int,
                  folder: Path | None) -> None:
    """Give layers ``want`` of ``model`` (built by ``_params_on_meta``) their weights: from the weight files
    in ``folder`` (only those layers' tensors are read; missing head weights initialised), else
    initialised, each submodule from ``module_seed(seed, its name)``; a copied head as the embedding."""
    copied = _copied_heads(family, hf, model)
    names = {id(m): n for n, m in hf.named_modules(remove_duplicate=False)}
    if folder is not None:
        _load_layers(family, folder, hf, model, want, seed, names, copied)
        return
    for i in want:
        later = frozenset({copied[i][0]}) if i in copied else frozenset()
        _init_layer(hf, model.layers[i], seed, names, f"layer {i} ({model.specs[i].name})", later)
        if i in copied:
            head, emb = copied[i]
            with torch.no_grad():
                dict(model.layers[i].named_parameters())[head].copy_(_embedding_init(hf, model, seed, names, emb))


def _embedding_init(hf: nn.Module, model: LayeredModel, seed: int, names: dict[int, str], name: str) -> Tensor:
    """The initial value of parameter ``name`` of layer 0 (the embedding), whether or not it is built here."""
    import copy

    emb = model.layers[0]
    p = dict(emb.named_parameters())[name]
    if p.device.type != "meta":
        return p.detach()
    shadow = copy.deepcopy(emb)  # meta parameters: nothing is copied but the module tree
    twin = {id(s): names[id(m)] for (_, m), (_, s) in zip(emb.named_modules(remove_duplicate=False),
                                                            shadow.named_modules(remove_duplicate=False))
            if id(m) in names}
    _init_layer(hf, shadow, seed, twin, f"layer 0 ({model.specs[0].name})")
    return dict(shadow.named_parameters())[name].detach()


class _WeightFiles:
    """The tensors of a folder's weight files by name, read one at a time (safetensors ``safe_open``, or
    a ``pytorch_model*.bin`` mapped with ``torch.load(mmap=True)``); safetensors preferred when both exist."""

    def __init__(self, folder: Path) -> None:
        files = _weight_files(folder)
        safe = [f for f in files if f.suffix == ".safetensors"]
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        try:
            if safe:
                from safetensors import safe_open

                for f in safe:
                    h = self._stack.enter_context(safe_open(str(f), framework="pt"))
                    self._where.update(dict.fromkeys(h.keys(), h))
            else:
                for f in files:
                    try:
                        sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                    except RuntimeError:  # a legacy (pre-zip) file cannot be mapped: read whole
                        sd = torch.load(f, map_location="cpu", weights_only=True)
                    self._where.update({k: sd for k in sd})
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> "_WeightFiles":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        h = self._where[key]
        return tuple(h[key].shape) if isinstance(h, dict) else tuple(h.get_slice(key).get_shape())

    def get(self, key: str) -> Tensor:
        h = self._where[key]
        return h[key].clone() if isinstance(h, dict) else h.get_tensor(key)  # never a view of the mapped file


def _file_key(name: str, prefix: str, keys: set[str]) -> str | None:
    """The weight-file key of the task model's parameter ``name``: as is, without or with the base model's
    prefix (a base-model checkpoint: ``encoder...`` for ``bert.encoder...``), or with the legacy
    LayerNorm names (``gamma``/``beta``)."""
    cands = [name]
    if name.startswith(prefix + "."):
        cands.append(name[len(prefix) + 1:])
    else:
        cands.append(f"{prefix}.{name}")
    for c in list(cands):
        if c.endswith(".weight"):
            cands.append(c[:-len("weight")] + "gamma")
        elif c.endswith(".bias"):
            cands.append(c[:-len("bias")] + "beta")
    return next((c for c in cands if c in keys), None)


def _load_layers(family: str, d: Path, hf: nn.Module, model: LayeredModel, want: list[int], seed: int,
                 names: dict[int, str], copied: dict[int, tuple[str, str]]) -> None:
    """Layers ``want`` from the weight files in folder ``d``, each tensor read on its own (see ``_build_layers``).

    Every parameter of the whole model is checked against the files first (names and shapes only), so a
    stage build refuses the same checkpoints as a whole build: a missing weight other than the task head's
    (``_HEAD_KEYS``: initialised from the seed), or a weight of another shape outside it, is a PtplanError.
    """
    hf_name = {id(p): n for n, p in hf.named_parameters(remove_duplicate=False)}
    prefix = getattr(hf, "base_model_prefix", "")
    emb_name = {i: f"{prefix}.{emb}" for i, (_, emb) in copied.items()}
    try:
        files = _WeightFiles(d)
    except Exception as e:  # safetensors / torch errors for a damaged file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PtplanError(f"cannot load the {family} weights in {d}: {first}") from None
    with files:
        keys = files.keys()
        source: dict[int, str | None] = {}
        missing, mismatched = [], []
        for i, layer in enumerate(model.layers):
            for pname, p in layer.named_parameters():
                name = hf_name.get(id(p))
                if i in copied and pname == copied[i][0]:
                    name = emb_name[i]  # the embedding's weights, as the tied model has them
                assert name is not None, (i, pname)
                key = _file_key(name, prefix, keys)
                head = name in _HEAD_KEYS[family]
                if key is None:
                    if not head:
                        missing.append(name)
                elif files.shape(key) != tuple(p.shape):
                    if not head:  # e.g. a classifier for another number of labels: re-initialised
                        mismatched.append(f"{name} (checkpoint {files.shape(key)}, config {tuple(p.shape)})")
                    key = None
                source[id(p)] = key
        if missing or mismatched:
            bad = sorted(mismatched) or sorted(missing)
            raise PtplanError(f"weights in {d} do not match the {family} architecture in its config.json: "
                              f"{len(missing)} missing and {len(mismatched)} mismatched weights, "
                              f"e.g. {', '.join(bad[:2])}")
        for i in want:
            layer = model.layers[i]
            params = list(layer.parameters())
            if any(source[id(p)] is None for p in params):  # a head without weights: initialised from the seed
                _init_layer(hf, layer, seed, names, f"layer {i} ({model.specs[i].name})")
            with torch.no_grad():
                for p in params:
                    key = source[id(p)]
                    if key is None:
                        continue
                    t = files.get(key).to(p.dtype).contiguous()
                    if p.device.type == "meta":
                        _give_storage(p, t)
                    else:
                        p.copy_(t)


# ---- your own model: layers, head and loss --------------------------------------------------------

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
    if fam not in FAMILIES:
        raise PtplanError(f"family {fam!r}: give the backbone's model_type, one of {', '.join(FAMILIES)}")
    if not callable(loss):
        raise PtplanError("loss must be callable as loss(output, labels) -> scalar tensor")
    if num_labels < 1 or seq_len < 1:
        raise PtplanError(f"num_labels and seq_len must be >= 1, got {num_labels} and {seq_len}")
    return LayeredModel(name=name, family=str(fam), granularity=granularity, config=config, seq_len=seq_len,
                        num_blocks=len(runs), layers=layers, specs=specs, num_labels=num_labels,
                        image_size=image_size, loss_fn=loss, batch_fn=make_batch)


def config_summary(model: LayeredModel) -> dict[str, Any]:
    """The scalar Hugging Face config fields (JSON-safe) that define the model, for a profile record."""
    out: dict[str, Any] = {}
    skip = {"transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype"}
    for k, v in sorted(model.config.to_dict().items()):
        if k.startswith("_") or k in skip:
            continue
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
    out["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    return out
