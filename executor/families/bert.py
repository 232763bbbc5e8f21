"""BERT (``BertForSequenceClassification``) and its variant RoBERTa (``RobertaForSequenceClassification``).

BERT: ``embeddings`` (word + position + token type, LayerNorm) -> blocks; a block's attention half is
``BertAttention`` (self-attention, dense, residual, post-LN) and its MLP half is ``BertIntermediate`` +
``BertOutput`` (dense, GELU, dense, residual, post-LN) -> ``pooler`` (dense + tanh on token 0; BERT is
post-LN and has no final norm, so the pooler takes the ``norm`` slot and kind; its output is ``[B, H]``) ->
``head`` (dropout + linear classifier, ``[B, num_labels]``). Loss: cross-entropy on the labels ``[B]``.

RoBERTa: BERT's embedding and block layers (its positions start after the padding id, from the ids
themselves) -> ``pooler`` (the first half of ``RobertaClassificationHead``: token 0, dropout, dense, tanh)
-> ``head`` (dropout, ``out_proj``).
"""
from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from ptplan.executor.families.base import ClassifierHead, LayerSpec, TokenZeroDense, bert_additive_mask
from ptplan.executor.families.family import BASE, LARGE, SMALL, TINY, Entry, Family, Split, halves

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



_QKV = ("query", "key", "value")
_SPLITS: dict[type[nn.Module], Split] = {  # BertAttention: self.query/key/value, output.dense; Intermediate/Output .dense
    BertAttentionHalf: Split(**Split.attention_of("attention.self.", _QKV, "attention.output.dense")),
    BertMLPHalf: Split(None, up=("intermediate.dense",), down="output.dense"),
    BertBlock: Split(**Split.attention_of("layer.attention.self.", _QKV, "layer.attention.output.dense"),
                     up=("layer.intermediate.dense",), down="layer.output.dense"),
}


class Bert(Family):
    """BERT: post-LN encoder, pooler in the norm slot, classifier head."""

    name = "bert"
    config_class, model_class = "BertConfig", "BertForSequenceClassification"
    presets = {
        "bert-tiny": dict(TINY, vocab_size=1024),
        "bert-small": dict(SMALL, vocab_size=1024),
        "bert-base": dict(BASE),
        "bert-large": dict(LARGE),
        "bert-base-uncased": dict(BASE),
        "bert-large-uncased": dict(LARGE),
        "bert-base-cased": dict(BASE, vocab_size=28996),
    }
    dropout_fields = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")
    head_keys = frozenset({"classifier.weight", "classifier.bias"})
    layer_classes: ClassVar[tuple[type[nn.Module], ...]] = (BertEmbeddingLayer, BertAttentionHalf, BertMLPHalf, BertBlock, BertPoolerLayer)
    tp_splits = _SPLITS

    def backbone(self, base: nn.Module, half: bool) -> list[Entry]:
        return halves(BertEmbeddingLayer(base.embeddings), base.encoder.layer, half,
                      lambda b: BertAttentionHalf(b.attention), lambda b: BertMLPHalf(b.intermediate, b.output),
                      BertBlock)

    def head(self, hf: nn.Module) -> list[Entry]:
        return [(BertPoolerLayer(hf.bert.pooler), LayerSpec("pooler", "norm", None)),
                (ClassifierHead(hf.classifier, hf.dropout), LayerSpec("head", "head", None))]


_ROBERTA = dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                pad_token_id=1, bos_token_id=0, eos_token_id=2)


class Roberta(Bert):
    """RoBERTa: BERT's layers; ``RobertaClassificationHead`` cut into a pooler (token 0, dropout, dense, tanh)
    and a head (dropout, out_proj)."""

    name = "roberta"
    config_class, model_class = "RobertaConfig", "RobertaForSequenceClassification"
    presets = {
        "roberta-tiny": dict(TINY, vocab_size=1024, max_position_embeddings=514, type_vocab_size=1,
                             layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2),
        "roberta-base": dict(BASE, **_ROBERTA),
        "roberta-large": dict(LARGE, **_ROBERTA),
        "distilroberta-base": dict(BASE, num_hidden_layers=6, **_ROBERTA),
    }
    head_keys = frozenset({"classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
                           "classifier.out_proj.bias"})
    layer_classes = ()  # BERT's

    def head(self, hf: nn.Module) -> list[Entry]:
        c = hf.classifier
        return [(TokenZeroDense(c.dense, "tanh", c.dropout), LayerSpec("pooler", "norm", None)),
                (ClassifierHead(c.out_proj, c.dropout), LayerSpec("head", "head", None))]

    def position_limit(self, config: Any) -> int:
        return int(config.max_position_embeddings) - (config.pad_token_id + 1)  # 514 = 512 + 2


FAMILIES = (Bert(), Roberta())
