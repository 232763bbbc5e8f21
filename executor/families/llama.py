"""Llama (``LlamaForCausalLM``) and its variants Mistral and Qwen2 (``MistralForCausalLM``, ``Qwen2ForCausalLM``:
the same structure, run through the same layers; a sliding window becomes a banded mask).

``embeddings`` (``embed_tokens`` only) -> blocks (pre-RMSNorm halves, grouped-query attention with RoPE for
positions 0..S-1, recomputed in each attention half from the shared ``rotary_emb``, which has no parameters,
and the same explicit causal + padding mask as GPT-2) -> ``norm`` -> ``head`` (``lm_head``). Loss as
GPT-2's. A checkpoint with tied embeddings is untied (the head becomes a copy of ``embed_tokens``).
Tensor parallelism splits q/k/v (each rank G/tp key/value heads and the H/tp query heads that read them),
o_proj, gate/up and down; rotary embeddings act per head and the sliding window is in the mask, both
unchanged by the split. Token slices: ``Llama.slice_forward`` (RoPE at the slice's positions, the window
in the slice's mask).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ptplan.executor.families.base import LayerSpec, NormLayer, causal_additive_mask
from ptplan.executor.families.family import KV, Entry, Family, Split, attend, halves, slice_mask

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




_QKV = ("q_proj", "k_proj", "v_proj")
_SPLITS: dict[type[nn.Module], Split] = {  # q_proj, k_proj, v_proj, o_proj; gate_proj, up_proj, down_proj
    LlamaAttentionHalf: Split(**Split.attention_of("self_attn.", _QKV, "self_attn.o_proj"), norms=("input_layernorm",)),
    LlamaMLPHalf: Split(None, up=("mlp.gate_proj", "mlp.up_proj"), down="mlp.down_proj",
                        norms=("post_attention_layernorm",)),
    LlamaBlockLayer: Split(**Split.attention_of("attn.self_attn.", _QKV, "attn.self_attn.o_proj"),
                           up=("mlp.mlp.gate_proj", "mlp.mlp.up_proj"), down="mlp.mlp.down_proj",
                           norms=("attn.input_layernorm", "mlp.post_attention_layernorm")),
}


def _attention(layer: LlamaAttentionHalf, x: Tensor, offset: int, past: KV | None,
               attention_mask: Tensor | None) -> tuple[Tensor, KV]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    att = layer.self_attn
    B, s, _ = x.shape
    h = layer.input_layernorm(x)
    shape = (B, s, -1, att.head_dim)
    q = att.q_proj(h).view(shape).transpose(1, 2)
    k = att.k_proj(h).view(shape).transpose(1, 2)
    v = att.v_proj(h).view(shape).transpose(1, 2)
    pos = torch.arange(offset, offset + s, device=x.device)[None]
    cos, sin = layer._rotary.to(x.device)(x, position_ids=pos)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = attend(q, k, v, past, att.scaling, slice_mask(s, offset, x, attention_mask, layer.window))
    return x + att.o_proj(o.reshape(B, s, -1)), (k, v)


_TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1024, max_position_embeddings=512)
_LLAMA3_ROPE = dict(rope_type="llama3", high_freq_factor=4.0, low_freq_factor=1.0,
                    original_max_position_embeddings=8192)


class Llama(Family):
    """Llama: pre-RMSNorm decoder, grouped-query attention with RoPE, its own (or untied) LM head."""

    name = "llama"
    config_class, model_class = "LlamaConfig", "LlamaForCausalLM"
    presets = {
        "llama-tiny": dict(_TINY),
        "llama-2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                           intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
                           rms_norm_eps=1e-5),
        "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
                             rms_norm_eps=1e-5, tie_word_embeddings=True,
                             rope_parameters=dict(_LLAMA3_ROPE, rope_theta=500000.0, factor=32.0)),
        "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                             rms_norm_eps=1e-5, rope_parameters=dict(_LLAMA3_ROPE, rope_theta=500000.0, factor=8.0)),
        # the Llama 3.1 70B and 405B configs (projection sizes: ``ptplan profile llama-3.1-405b --project h100``)
        "llama-3.1-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                              intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072,
                              rms_norm_eps=1e-5, rope_parameters=dict(_LLAMA3_ROPE, rope_theta=500000.0, factor=8.0)),
        "llama-3.1-405b": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                               num_key_value_heads=8, intermediate_size=53248, vocab_size=128256,
                               max_position_embeddings=131072, rms_norm_eps=1e-5,
                               rope_parameters=dict(_LLAMA3_ROPE, rope_theta=500000.0, factor=8.0)),
    }
    dropout_fields = ("attention_dropout",)
    head_keys = frozenset({"lm_head.weight"})
    layer_classes: ClassVar[tuple[type[nn.Module], ...]] = (LlamaEmbeddingLayer, LlamaAttentionHalf, LlamaMLPHalf, LlamaBlockLayer, LinearHead)
    tp_splits = _SPLITS
    attention_layers = (LlamaAttentionHalf, LlamaBlockLayer)

    def backbone(self, base: nn.Module, half: bool) -> list[Entry]:
        return halves(LlamaEmbeddingLayer(base.embed_tokens), base.layers, half,
                      lambda b: LlamaAttentionHalf(b, base.rotary_emb), LlamaMLPHalf,
                      lambda b: LlamaBlockLayer(b, base.rotary_emb), norm=(NormLayer(base.norm), "norm"))

    def head(self, hf: nn.Module) -> list[Entry]:
        if hf.lm_head.weight is hf.model.embed_tokens.weight:  # tied: a pipeline cannot share it, untie
            hf.lm_head.weight = nn.Parameter(hf.model.embed_tokens.weight.detach().clone())
            hf.config.tie_word_embeddings = False
        return [(LinearHead(hf.lm_head), LayerSpec("head", "head", None))]

    def copied_head(self, hf: nn.Module) -> tuple[str, str] | None:
        if not getattr(hf.config, "tie_word_embeddings", False):
            return None
        hf.config.tie_word_embeddings = False  # a pipeline cannot share it: the head becomes a copy
        return ("lm_head.weight", "embed_tokens.weight")

    def slice_forward(self, layer: nn.Module, x: Tensor, offset: int, past: KV | None,
                      attention_mask: Tensor | None) -> tuple[Tensor, KV | None]:
        if isinstance(layer, LlamaAttentionHalf):
            return _attention(layer, x, offset, past, attention_mask)
        if isinstance(layer, LlamaBlockLayer):
            y, kv = _attention(layer.attn, x, offset, past, attention_mask)
            return layer.mlp(y), kv
        if isinstance(layer, (LlamaEmbeddingLayer, LlamaMLPHalf, LinearHead)):
            return layer(x), None  # token-wise: a slice is the same as the whole sequence's rows
        return super().slice_forward(layer, x, offset, past, attention_mask)


class Mistral(Llama):
    """Mistral: Llama's layers with a sliding window (a banded mask)."""

    name = "mistral"
    config_class, model_class = "MistralConfig", "MistralForCausalLM"
    presets = {
        "mistral-tiny": dict(_TINY, sliding_window=None),
        "mistral-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                           intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
                           rms_norm_eps=1e-5, sliding_window=4096, rope_theta=10000.0),
    }
    aliases = {"mistral-7b-v0.1": "mistral-7b"}
    layer_classes = ()  # Llama's


class Qwen2(Llama):
    """Qwen2: Llama's layers (q/k/v with biases; sliding layers optional)."""

    name = "qwen2"
    config_class, model_class = "Qwen2Config", "Qwen2ForCausalLM"
    presets = {
        "qwen2-tiny": dict(_TINY, tie_word_embeddings=True),
        "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                             rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0),
        "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                           intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                           rms_norm_eps=1e-6, rope_theta=1000000.0),
    }
    aliases = {"qwen2-0.5b": "qwen2.5-0.5b", "qwen2-7b": "qwen2.5-7b"}
    layer_classes = ()  # Llama's


FAMILIES = (Llama(), Mistral(), Qwen2())
