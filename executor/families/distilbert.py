"""DistilBERT (``DistilBertForSequenceClassification``): ``embeddings`` (word + position, LayerNorm) -> blocks
(post-LN halves ``sa_layer_norm(x + attention(x))``, ``output_layer_norm(x + ffn(x))``) -> ``pre_classifier``
(token 0, dense, ReLU; the ``norm`` slot) -> ``head`` (dropout, classifier)."""
from __future__ import annotations

from torch import Tensor, nn

from ptplan.executor.families.base import ClassifierHead, LayerSpec, TokenZeroDense, bert_additive_mask
from ptplan.executor.families.family import Entry, Family, Split, halves

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




_QKV = ("q_lin", "k_lin", "v_lin")
_SPLITS: dict[type[nn.Module], Split] = {  # DistilBertSelfAttention: q_lin, k_lin, v_lin, out_lin; FFN: lin1, lin2
    DistilBertAttentionHalf: Split(**Split.attention_of("attention.", _QKV, "attention.out_lin")),
    DistilBertMLPHalf: Split(None, up=("ffn.lin1",), down="ffn.lin2"),
    DistilBertBlock: Split(**Split.attention_of("block.attention.", _QKV, "block.attention.out_lin"),
                           up=("block.ffn.lin1",), down="block.ffn.lin2"),
}


class DistilBert(Family):
    """DistilBERT: post-LN encoder without token types; pre_classifier in the norm slot."""

    name = "distilbert"
    config_class, model_class = "DistilBertConfig", "DistilBertForSequenceClassification"
    presets = {
        "distilbert-tiny": dict(dim=64, n_layers=4, n_heads=4, hidden_dim=256, vocab_size=1024),
        "distilbert-base-uncased": dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072, vocab_size=30522),
    }
    aliases = {"distilbert-base": "distilbert-base-uncased"}
    dropout_fields = ("dropout", "attention_dropout", "seq_classif_dropout")
    head_keys = frozenset({"pre_classifier.weight", "pre_classifier.bias", "classifier.weight", "classifier.bias"})
    layer_classes = (DistilBertEmbeddingLayer, DistilBertAttentionHalf, DistilBertMLPHalf, DistilBertBlock)
    tp_splits = _SPLITS

    def backbone(self, base: nn.Module, half: bool) -> list[Entry]:
        return halves(DistilBertEmbeddingLayer(base.embeddings), base.transformer.layer, half,
                      DistilBertAttentionHalf, DistilBertMLPHalf, DistilBertBlock)

    def head(self, hf: nn.Module) -> list[Entry]:  # token 0, pre_classifier, ReLU | dropout, classifier
        return [(TokenZeroDense(hf.pre_classifier, "relu"), LayerSpec("pre_classifier", "norm", None)),
                (ClassifierHead(hf.classifier, hf.dropout), LayerSpec("head", "head", None))]


FAMILIES = (DistilBert(),)
