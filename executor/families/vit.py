"""ViT (``ViTForImageClassification``): ``embeddings`` (patches + CLS + positions) -> blocks (pre-LN halves:
``x + attn(LN(x))``, ``x + mlp(LN(x))``) -> ``layernorm`` -> ``head`` (classifier on token 0). Inputs are
pixels ``[B, 3, H, W]``; there is no attention mask. ``seq_len`` = patches + 1."""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

from ptplan.executor.families.base import ClassifierHead, LayerSpec, NormLayer
from ptplan.executor.families.family import BASE, LARGE, SMALL, TINY, Entry, Family, Split, halves

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



_QKV = ("q_proj", "k_proj", "v_proj")
_SPLITS: dict[type[nn.Module], Split] = {  # ViTAttention: q_proj, k_proj, v_proj, o_proj; ViTMLP: fc1, fc2
    ViTAttentionHalf: Split(**Split.attention_of("attention.", _QKV, "attention.o_proj")),
    ViTMLPHalf: Split(None, up=("mlp.fc1",), down="mlp.fc2"),
    ViTBlock: Split(**Split.attention_of("layer.attention.", _QKV, "layer.attention.o_proj"),
                    up=("layer.mlp.fc1",), down="layer.mlp.fc2"),
}


class ViT(Family):
    """ViT: pre-LN encoder over image patches, classifier on the CLS token."""

    name = "vit"
    config_class, model_class = "ViTConfig", "ViTForImageClassification"
    presets = {
        "vit-tiny": dict(TINY, image_size=32, patch_size=8),
        "vit-small": dict(SMALL, image_size=64, patch_size=8),
        "vit-base": dict(BASE, image_size=224, patch_size=16),
        "vit-large": dict(LARGE, image_size=224, patch_size=16),
        "vit-base-patch16-224": dict(BASE, image_size=224, patch_size=16),
        "vit-large-patch16-224": dict(LARGE, image_size=224, patch_size=16),
        "vit-huge-patch14-224": dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16,
                                     intermediate_size=5120, image_size=224, patch_size=14),
    }
    aliases = {"vit-huge": "vit-huge-patch14-224"}
    dropout_fields = ("hidden_dropout_prob", "attention_probs_dropout_prob")
    head_keys = frozenset({"classifier.weight", "classifier.bias"})
    layer_classes = (ViTEmbeddingLayer, ViTAttentionHalf, ViTMLPHalf, ViTBlock)
    tp_splits = _SPLITS

    def backbone(self, base: nn.Module, half: bool) -> list[Entry]:
        return halves(ViTEmbeddingLayer(base.embeddings), base.layers, half, ViTAttentionHalf, ViTMLPHalf, ViTBlock,
                      norm=(NormLayer(base.layernorm), "layernorm"))

    def head(self, hf: nn.Module) -> list[Entry]:
        return [(ClassifierHead(hf.classifier, first_token=True), LayerSpec("head", "head", None))]

    def seq_len(self, config: Any, seq_len: int | None) -> int:
        """Set by the image: patches + 1 (the CLS token)."""
        if config.image_size % config.patch_size:
            raise PtplanError(f"image size {config.image_size} is not a multiple of the patch size "
                              f"{config.patch_size}")
        n = (config.image_size // config.patch_size) ** 2 + 1
        if seq_len is not None and seq_len != n:
            raise PtplanError(f"ViT's sequence length is set by the image size: {config.image_size}px with "
                              f"patch {config.patch_size} gives {n} tokens, not {seq_len}; use --image-size")
        return n


FAMILIES = (ViT(),)
