"""GPT-2 (``GPT2LMHeadModel``): ``embeddings`` (wte + wpe) -> blocks (pre-LN halves) with an **explicit causal
mask** combined with the padding mask (blocks called one by one are not causal otherwise with eager
attention) -> ``ln_f`` -> ``head`` (LM head). Loss: next-token cross-entropy (logits at t predict labels at
t+1; label -100 is ignored).

**The LM head is untied**: Hugging Face ties it to ``wte``, but a pipeline cannot share one parameter
between its first and last stage, so the head is a separate Parameter initialised as a copy of ``wte``. The
two then train independently (the head's parameters are counted separately); the export writes both
(``tie_word_embeddings: false``).

Tensor parallelism: GPT-2's ``Conv1D``s first become ``nn.Linear``s holding the transposed weights, the fused
q|k|v rows reordered per rank (``conv1d_twin``). Token slices: ``GPT2.slice_forward``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

from ptplan.executor.families.base import LayerSpec, NormLayer, causal_additive_mask
from ptplan.executor.families.family import KV, Entry, Family, Split, TensorMaps, attend, halves, slice_mask

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




_SPLITS: dict[type[nn.Module], Split] = {  # GPT2Attention: fused c_attn, c_proj; GPT2MLP: c_fc, c_proj
    GPT2AttentionHalf: Split(**Split.attention_of("attn.", ("c_attn",), "attn.c_proj"), norms=("ln_1",)),
    GPT2MLPHalf: Split(None, up=("mlp.c_fc",), down="mlp.c_proj", norms=("ln_2",)),
    GPT2BlockLayer: Split(**Split.attention_of("block.attn.", ("c_attn",), "block.attn.c_proj"),
                          up=("block.mlp.c_fc",), down="block.mlp.c_proj", norms=("block.ln_1", "block.ln_2")),
}
"""The paths are split once ``conv1d_twin`` made the Conv1Ds ``nn.Linear``s."""


def _attention(ln: nn.Module, attn: nn.Module, x: Tensor, offset: int, past: KV | None,
               attention_mask: Tensor | None) -> tuple[Tensor, KV]:
    if getattr(attn, "scale_attn_by_inverse_layer_idx", False) or getattr(attn, "reorder_and_upcast_attn", False):
        raise PtplanError("token slicing supports GPT-2 attention without scale_attn_by_inverse_layer_idx and "
                          "reorder_and_upcast_attn (the presets' settings)")
    B, s, _ = x.shape
    q, k, v = attn.c_attn(ln(x)).split(attn.split_size, dim=2)
    shape = (B, s, -1, attn.head_dim)
    q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
    scaling = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
    o = attend(q, k, v, past, scaling, slice_mask(s, offset, x, attention_mask), attn.attn_dropout)
    h = attn.resid_dropout(attn.c_proj(o.reshape(B, s, -1)))
    return x + h, (k, v)


def conv1d_twin(layer: nn.Module, tp: int) -> TensorMaps:
    """Make a GPT-2 layer's copy splittable by ``parallelize_module``: each ``Conv1D`` (y = x W + b, W of
    shape (in, out)) becomes an ``nn.Linear`` holding W transposed; the fused q|k|v projection's output
    rows are reordered so that a column split gives rank j the rows [q_j | k_j | v_j] of its heads.
    Returns, per parameter name, (canonical -> twin, twin -> canonical) for full tensors (weights and the
    optimizer's elementwise state alike). Other layers: unchanged, {}."""
    from transformers.pytorch_utils import Conv1D

    if not isinstance(layer, (GPT2AttentionHalf, GPT2MLPHalf, GPT2BlockLayer)):
        return {}
    maps: TensorMaps = {}
    for path, conv in list(layer.named_modules()):
        if not isinstance(conv, Conv1D):
            continue
        n_in, n_out = conv.weight.shape
        idx = torch.arange(n_out)
        if path.endswith("c_attn"):  # [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
            H = n_out // 3
            c = H // tp
            idx = torch.cat([torch.arange(3)[:, None] * H + j * c + torch.arange(c)[None, :] for j in range(tp)]
                            ).reshape(-1)
        inv = torch.empty_like(idx)
        inv[idx] = torch.arange(n_out)

        def w_to(w: Tensor, idx: Tensor = idx) -> Tensor:
            return w.t()[idx.to(w.device)].contiguous()

        def w_back(w: Tensor, inv: Tensor = inv) -> Tensor:
            return w[inv.to(w.device)].t().contiguous()

        def b_to(b: Tensor, idx: Tensor = idx) -> Tensor:
            return b[idx.to(b.device)].contiguous()

        def b_back(b: Tensor, inv: Tensor = inv) -> Tensor:
            return b[inv.to(b.device)].contiguous()

        lin = nn.Linear(n_in, n_out, device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(w_to(conv.weight))
            lin.bias.copy_(b_to(conv.bias))
        lin.weight.requires_grad_(conv.weight.requires_grad)
        lin.bias.requires_grad_(conv.bias.requires_grad)
        parent, _, leaf = path.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, leaf, lin)
        maps[f"{path}.weight"] = (w_to, w_back)
        maps[f"{path}.bias"] = (b_to, b_back)
    return maps


class GPT2(Family):
    """GPT-2: pre-LN decoder with an explicit causal mask and an untied LM head."""

    name = "gpt2"
    config_class, model_class = "GPT2Config", "GPT2LMHeadModel"
    presets = {
        "gpt2-tiny": dict(n_embd=64, n_layer=4, n_head=4, vocab_size=1024, bos_token_id=1023, eos_token_id=1023),
        "gpt2": dict(n_embd=768, n_layer=12, n_head=12),
        "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16),
        "gpt2-large": dict(n_embd=1280, n_layer=36, n_head=20),
        "gpt2-xl": dict(n_embd=1600, n_layer=48, n_head=25),
        # GPT-3 (Brown et al. 2020, Table 2.1) as a dense GPT-2 architecture, 2,048 positions (projection sizes)
        "gpt3-175b": dict(n_embd=12288, n_layer=96, n_head=96, n_positions=2048),
    }
    dropout_fields = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
    head_keys = frozenset({"lm_head.weight"})
    layer_classes = (GPT2EmbeddingLayer, GPT2AttentionHalf, GPT2MLPHalf, GPT2BlockLayer, LMHead)
    tp_splits = _SPLITS
    attention_layers = (GPT2AttentionHalf, GPT2BlockLayer)

    def backbone(self, base: nn.Module, half: bool) -> list[Entry]:
        return halves(GPT2EmbeddingLayer(base.wte, base.wpe, base.drop), base.h, half, GPT2AttentionHalf,
                      GPT2MLPHalf, GPT2BlockLayer, norm=(NormLayer(base.ln_f), "ln_f"))

    def head(self, hf: nn.Module) -> list[Entry]:
        return [(LMHead(hf.transformer.wte.weight), LayerSpec("head", "head", None))]  # untied: see above

    def copied_head(self, hf: nn.Module) -> tuple[str, str] | None:
        return ("weight", "wte.weight")

    def slice_forward(self, layer: nn.Module, x: Tensor, offset: int, past: KV | None,
                      attention_mask: Tensor | None) -> tuple[Tensor, KV | None]:
        if isinstance(layer, GPT2EmbeddingLayer):
            pos = torch.arange(offset, offset + x.shape[1], device=x.device)[None]
            return layer.drop(layer.wte(x) + layer.wpe(pos)), None
        if isinstance(layer, GPT2AttentionHalf):
            return _attention(layer.ln_1, layer.attn, x, offset, past, attention_mask)
        if isinstance(layer, GPT2BlockLayer):
            blk = layer.block
            y, kv = _attention(blk.ln_1, blk.attn, x, offset, past, attention_mask)
            return y + blk.mlp(blk.ln_2(y)), kv
        if isinstance(layer, (GPT2MLPHalf, LMHead)):
            return layer(x), None  # token-wise: a slice is the same as the whole sequence's rows
        return super().slice_forward(layer, x, offset, past, attention_mask)

    def tp_twin(self, layer: nn.Module, tp: int) -> TensorMaps:
        return conv1d_twin(layer, tp)

    def to_hf(self, hf: nn.Module, head: nn.Module) -> None:
        hf.config.tie_word_embeddings = False
        hf.lm_head.weight = nn.Parameter(head.weight.detach().clone())


FAMILIES = (GPT2(),)
