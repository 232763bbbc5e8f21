"""Model adapters: Hugging Face BERT, ViT and GPT-2 as a flat list of layers plus a loss.

Every adapter has the same shape, whatever the family (L = number of Transformer blocks)::

    embedding, (block0.attn, block0.mlp, ..., block{L-1}.mlp) | (block0, ..., block{L-1}), norm, head

so a "half" model has 2L + 3 layers and a "block" model L + 3. Every layer is an ``nn.Module`` with
``forward(x, attention_mask=None) -> Tensor``: one tensor in, one tensor out, plus the raw ``[B, S]``
0/1 padding mask (long) that a pipeline passes to every stage; layers that need it build their own
4-D additive mask, layers that don't ignore it. The layers wrap the Hugging Face submodules
themselves (built from a transformers config, or loaded with ``from_pretrained`` from a local folder),
so they compute exactly what the Hugging Face model computes.

Per family:

- **bert** (like ``BertForSequenceClassification``): ``embeddings`` (word + position + token type,
  LayerNorm) -> blocks; a block's attention half is ``BertAttention`` (self-attention, dense,
  residual, post-LN) and its MLP half is ``BertIntermediate`` + ``BertOutput`` (dense, GELU, dense,
  residual, post-LN) -> ``pooler`` (dense + tanh on token 0; BERT is post-LN and has no final norm,
  so the pooler takes the ``norm`` slot and kind; its output is ``[B, H]``) -> ``head`` (dropout +
  linear classifier, ``[B, num_labels]``). Loss: cross-entropy on the labels ``[B]``.
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
- **llama** (like ``LlamaForCausalLM``; Mistral and Qwen2 have the same structure and run through the
  same layers): ``embeddings`` (``embed_tokens`` only) -> blocks (pre-RMSNorm halves, grouped-query
  attention with RoPE for positions 0..S-1, recomputed in each attention half from the shared
  ``rotary_emb``, which has no parameters, and the same explicit causal + padding mask as GPT-2) ->
  ``norm`` -> ``head`` (``lm_head``). Loss as GPT-2's. A checkpoint with tied embeddings is untied
  the same way (the head becomes a copy of ``embed_tokens``).

Names: ``*-tiny`` are small configs for tests (4 blocks, hidden 64); ``*-small`` (4 blocks, hidden
256; ViT 64x64 pixels in 8x8 patches) are big enough for compute to outweigh framework overheads on
a CPU (the calibration benchmark, ``bench/calibrate.py``); the others have the published sizes.
With ``weights=DIR`` the architecture comes from ``DIR/config.json`` (as ``from_pretrained`` does),
which must be of the named family; the name then only picks the family and the adapter's
label. Missing head weights (a base-model checkpoint) are initialised from ``seed``; any other
missing or mismatched weight is an error.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

MODEL_NAMES: tuple[str, ...] = ("bert-tiny", "bert-base", "bert-large", "vit-tiny", "vit-base", "vit-large",
                                "gpt2-tiny", "gpt2", "gpt2-medium", "bert-small", "vit-small", "llama-tiny")
FAMILIES = ("bert", "vit", "gpt2", "llama")
CAUSAL_FAMILIES = ("gpt2", "llama")
"""Families whose head is a language-model head: next-token loss, labels = token ids."""
GRANULARITIES = ("block", "half")

_TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256)
_SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
# name -> (family, config keyword arguments). Real sizes from the published checkpoints.
_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert-tiny": ("bert", dict(_TINY, vocab_size=1024)),
    "bert-small": ("bert", dict(_SMALL, vocab_size=1024)),
    "bert-base": ("bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=3072)),
    "bert-large": ("bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096)),
    "vit-tiny": ("vit", dict(_TINY, image_size=32, patch_size=8)),
    "vit-small": ("vit", dict(_SMALL, image_size=64, patch_size=8)),
    "vit-base": ("vit", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                             intermediate_size=3072, image_size=224, patch_size=16)),
    "vit-large": ("vit", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                              intermediate_size=4096, image_size=224, patch_size=16)),
    "gpt2-tiny": ("gpt2", dict(n_embd=64, n_layer=4, n_head=4, vocab_size=1024, bos_token_id=1023,
                                eos_token_id=1023)),
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12)),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16)),
    # Llama family (RoPE, RMSNorm, grouped-query attention); Mistral and Qwen2 share the block structure.
    "llama-tiny": ("llama", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=1024, max_position_embeddings=512)),
}
_DEFAULT_SEQ_LEN = {"bert": 128, "gpt2": 128, "llama": 128}
_DROPOUT_FIELDS = {
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"),
    "vit": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "llama": ("attention_dropout",),
}
# Keys a base-model checkpoint may lack: the task head, initialised from the seed instead.
_HEAD_KEYS = {"bert": {"classifier.weight", "classifier.bias"},
              "vit": {"classifier.weight", "classifier.bias"},
              "gpt2": {"lm_head.weight"},
              "llama": {"lm_head.weight"}}


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


def causal_additive_mask(x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """``[B|1, 1, S, S]`` additive mask: causal, and also dropping padded keys when a mask is given."""
    S = x.shape[1]
    keep = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()[None, None]
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


class LlamaAttentionHalf(nn.Module):
    """``x + self_attn(input_layernorm(x))`` with RoPE for positions 0..S-1 and a causal (and padding) mask.

    The rotary tables are recomputed per layer from the shared ``rotary_emb`` (no parameters), so a
    stage needs nothing but the hidden states.
    """

    def __init__(self, block: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = block.input_layernorm
        self.self_attn = block.self_attn
        object.__setattr__(self, "_rotary", rotary_emb)  # buffers only; not a submodule of every layer

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        pos = torch.arange(x.shape[1], device=x.device)[None]
        rotary = self._rotary.to(x.device)
        pe = rotary(x, position_ids=pos)
        h, _ = self.self_attn(self.input_layernorm(x), position_embeddings=pe,
                              attention_mask=causal_additive_mask(x, attention_mask))
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
    ``executor/runtime.py``) is an error that names the layer.
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
                 image_size: int | None = None) -> None:
        super().__init__()
        assert len(layers) == len(specs)
        self.name, self.family, self.granularity = name, family, granularity
        self.config = config
        self.seq_len, self.num_blocks = seq_len, num_blocks
        self.num_labels = num_labels
        self.image_size = image_size
        self.layers = nn.ModuleList(layers)
        self.specs = tuple(specs)

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
        """Mean cross-entropy (GPT-2: next-token, ignoring label -100), computed in float32."""
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
    import transformers as tf

    return {"bert": (tf.BertConfig, tf.BertForSequenceClassification),
            "vit": (tf.ViTConfig, tf.ViTForImageClassification),
            "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[family]


def _apply_overrides(config: Any, family: str, *, num_labels: int, dropout: float | None,
                     image_size: int | None) -> None:
    if family in ("bert", "vit"):
        config.num_labels = num_labels
    if dropout is not None:
        for f in _DROPOUT_FIELDS[family]:
            setattr(config, f, dropout)
    if image_size is not None:
        config.image_size = image_size


def _load_pretrained(family: str, weights: str | os.PathLike, overrides: dict[str, Any]) -> nn.Module:
    d = Path(weights)
    if not d.is_dir():
        raise PtplanError(f"weights folder not found: {d}")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise PtplanError(f"weights folder {d} has no config.json; expected a Hugging Face model folder")
    try:
        model_type = json.loads(cfg_path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise PtplanError(f"cannot read {cfg_path}: {e}") from None
    if model_type != family:
        raise PtplanError(f"weights in {d} are a {model_type!r} model but the adapter is a {family!r} model; "
                          f"pick a {model_type} model name or another folder")
    if not any(d.glob("*.safetensors")) and not any(d.glob("*.bin")):
        raise PtplanError(f"weights folder {d} has no *.safetensors or *.bin weight files")
    config_cls, model_cls = _classes(family)
    try:
        with _quiet_transformers():
            config = config_cls.from_pretrained(d, local_files_only=True)
            _apply_overrides(config, family, **overrides)
            hf, info = model_cls.from_pretrained(d, config=config, local_files_only=True,
                                                 output_loading_info=True, ignore_mismatched_sizes=True)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PtplanError(f"cannot load the {family} weights in {d}: {first}") from None
    missing = sorted(set(info.get("missing_keys", ())) - _HEAD_KEYS[family])
    mismatched = []
    for m in sorted(info.get("mismatched_keys", ()), key=str):
        if isinstance(m, tuple) and len(m) == 3:
            if m[0] in _HEAD_KEYS[family]:  # e.g. a classifier for another number of labels: re-initialised
                continue
            m = f"{m[0]} (checkpoint {tuple(m[1])}, config {tuple(m[2])})"
        mismatched.append(str(m))
    if missing or mismatched:
        bad = mismatched or missing
        raise PtplanError(f"weights in {d} do not match the {family} architecture in its config.json: "
                          f"{len(missing)} missing and {len(mismatched)} mismatched weights, "
                          f"e.g. {', '.join(bad[:2])}")
    return hf


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
    if not 1 <= s <= limit:
        raise PtplanError(f"sequence length {s} is outside 1..{limit} (max_position_embeddings of this model)")
    return s


def _flatten(family: str, hf: nn.Module, granularity: str) -> tuple[list[nn.Module], list[LayerSpec]]:
    layers: list[nn.Module] = []
    specs: list[LayerSpec] = []

    def add(m: nn.Module, name: str, kind: str, block: int | None = None) -> None:
        layers.append(m)
        specs.append(LayerSpec(name, kind, block))

    half = granularity == "half"
    if family == "bert":
        base = hf.bert
        add(BertEmbeddingLayer(base.embeddings), "embeddings", "embedding")
        for i, blk in enumerate(base.encoder.layer):
            if half:
                add(BertAttentionHalf(blk.attention), f"block{i}.attn", "attention", i)
                add(BertMLPHalf(blk.intermediate, blk.output), f"block{i}.mlp", "mlp", i)
            else:
                add(BertBlock(blk), f"block{i}", "block", i)
        add(BertPoolerLayer(base.pooler), "pooler", "norm")
        add(ClassifierHead(hf.classifier, hf.dropout), "head", "head")
    elif family == "vit":
        base = hf.vit
        add(ViTEmbeddingLayer(base.embeddings), "embeddings", "embedding")
        for i, blk in enumerate(base.layers):
            if half:
                add(ViTAttentionHalf(blk), f"block{i}.attn", "attention", i)
                add(ViTMLPHalf(blk), f"block{i}.mlp", "mlp", i)
            else:
                add(ViTBlock(blk), f"block{i}", "block", i)
        add(NormLayer(base.layernorm), "layernorm", "norm")
        add(ClassifierHead(hf.classifier, first_token=True), "head", "head")
    elif family == "llama":
        base = hf.model
        add(LlamaEmbeddingLayer(base.embed_tokens), "embeddings", "embedding")
        for i, blk in enumerate(base.layers):
            if half:
                add(LlamaAttentionHalf(blk, base.rotary_emb), f"block{i}.attn", "attention", i)
                add(LlamaMLPHalf(blk), f"block{i}.mlp", "mlp", i)
            else:
                add(LlamaBlockLayer(blk, base.rotary_emb), f"block{i}", "block", i)
        add(NormLayer(base.norm), "norm", "norm")
        if hf.lm_head.weight is base.embed_tokens.weight:  # tied: a pipeline cannot share it, untie
            hf.lm_head.weight = nn.Parameter(base.embed_tokens.weight.detach().clone())
            hf.config.tie_word_embeddings = False
        add(LinearHead(hf.lm_head), "head", "head")
    else:
        base = hf.transformer
        add(GPT2EmbeddingLayer(base.wte, base.wpe, base.drop), "embeddings", "embedding")
        for i, blk in enumerate(base.h):
            if half:
                add(GPT2AttentionHalf(blk), f"block{i}.attn", "attention", i)
                add(GPT2MLPHalf(blk), f"block{i}.mlp", "mlp", i)
            else:
                add(GPT2BlockLayer(blk), f"block{i}", "block", i)
        add(NormLayer(base.ln_f), "ln_f", "norm")
        add(LMHead(base.wte.weight), "head", "head")  # untied: see the module docstring
    return layers, specs


def build_model(name: str, *, granularity: str = "half", seq_len: int | None = None, image_size: int | None = None,
                num_labels: int = 2, dtype: torch.dtype = torch.float32, dropout: float | None = None,
                weights: str | os.PathLike | None = None, seed: int = 0) -> LayeredModel:
    """Build the adapter for ``name`` (one of MODEL_NAMES), on the CPU, in ``dtype``.

    ``seq_len``: tokens per sample (BERT/GPT-2; default 128). ``image_size``: ViT pixels per side
    (default the config's: 224, tiny 32). ``dropout``: None keeps the config's, a number sets every
    dropout of the model. ``weights``: a local Hugging Face model folder to load (its config.json
    sets the sizes). ``seed``: initialises every weight not loaded from ``weights``.
    """
    if name not in _PRESETS:
        raise PtplanError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if granularity not in GRANULARITIES:
        raise PtplanError(f"unknown granularity {granularity!r}; choose one of {', '.join(GRANULARITIES)}")
    if num_labels < 1:
        raise PtplanError(f"num_labels must be >= 1, got {num_labels}")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise PtplanError(f"dropout must be in [0, 1), got {dropout}")
    family, preset = _PRESETS[name]
    if image_size is not None and family != "vit":
        raise PtplanError(f"--image-size applies to ViT models only, not {name}")
    if image_size is not None and image_size < 1:
        raise PtplanError(f"image size must be >= 1, got {image_size}")
    if seq_len is not None and seq_len < 1:
        raise PtplanError(f"sequence length must be >= 1, got {seq_len}")
    overrides = dict(num_labels=num_labels, dropout=dropout, image_size=image_size)
    config_cls, model_cls = _classes(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if weights is not None:
            hf = _load_pretrained(family, weights, overrides)
            config = hf.config
        else:
            config = config_cls(**preset)
            _apply_overrides(config, family, **overrides)
            _seq_len_for(family, config, seq_len)  # validate before paying for the weights
            with _quiet_transformers():
                hf = model_cls(config)
    n = _seq_len_for(family, config, seq_len)
    hf.eval()
    layers, specs = _flatten(family, hf, granularity)
    model = LayeredModel(name=name, family=family, granularity=granularity, config=config, seq_len=n,
                         num_blocks=config.num_hidden_layers, layers=layers, specs=specs,
                         num_labels=num_labels, image_size=config.image_size if family == "vit" else None)
    model.to(dtype=dtype)
    model.eval()
    return model


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
