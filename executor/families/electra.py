"""ELECTRA (``ElectraForSequenceClassification``): the family added in one file, on BERT's blocks.

``embeddings`` (word + position + token type at ``embedding_size``, LayerNorm, dropout, then
``embeddings_project`` to the hidden size when the two differ) -> BERT's blocks (``ElectraLayer`` has
``BertLayer``'s modules, so ``bert.py``'s halves, tensor-parallel split and weight names apply) -> ``pooler``
(the first half of ``ElectraClassificationHead``: token 0, dropout, dense, GELU, dropout) -> ``head``
(``out_proj``). Loss: cross-entropy on the labels ``[B]``. A discriminator checkpoint
(``ElectraForPreTraining``) has no classifier: the head is initialised from the seed.
"""
from __future__ import annotations

from torch import Tensor, nn

from ptplan.executor.families.base import ClassifierHead, LayerSpec
from ptplan.executor.families.bert import Bert, BertAttentionHalf, BertBlock, BertMLPHalf
from ptplan.executor.families.family import Entry, halves


class ElectraEmbeddingLayer(nn.Module):
    """Token ids ``[B, S]`` -> embeddings ``[B, S, E]`` -> projected to ``[B, S, H]`` (when E != H)."""

    def __init__(self, embeddings: nn.Module, project: nn.Module | None) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.embeddings_project = project if project is not None else nn.Identity()

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.embeddings_project(self.embeddings(input_ids=x))


class ElectraPooler(nn.Module):
    """Token 0 of ``[B, S, H]`` -> dropout, dense, activation, dropout: ``[B, H]`` (the ``norm`` slot)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.dropout, self.dense, self.activation = head.dropout, head.dense, head.activation

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.dropout(self.activation(self.dense(self.dropout(x[:, 0, :]))))


class Electra(Bert):
    """ELECTRA: BERT's blocks between its own (projected) embedding and classification head."""

    name = "electra"
    config_class, model_class = "ElectraConfig", "ElectraForSequenceClassification"
    presets = {  # the published discriminators' config.json
        "electra-tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                             embedding_size=32, vocab_size=1024),
        "electra-small-discriminator": dict(hidden_size=256, num_hidden_layers=12, num_attention_heads=4,
                                            intermediate_size=1024, embedding_size=128),
        "electra-base-discriminator": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                           intermediate_size=3072, embedding_size=768),
    }
    head_keys = frozenset({"classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight",
                           "classifier.out_proj.bias"})
    layer_classes = (ElectraEmbeddingLayer, ElectraPooler)  # its blocks are BERT's

    def backbone(self, base: nn.Module, half: bool) -> list[Entry]:
        embedding = ElectraEmbeddingLayer(base.embeddings, getattr(base, "embeddings_project", None))
        return halves(embedding, base.encoder.layer, half, lambda b: BertAttentionHalf(b.attention),
                      lambda b: BertMLPHalf(b.intermediate, b.output), BertBlock)

    def head(self, hf: nn.Module) -> list[Entry]:
        c = hf.classifier
        return [(ElectraPooler(c), LayerSpec("pooler", "norm", None)),
                (ClassifierHead(c.out_proj, c.dropout), LayerSpec("head", "head", None))]


FAMILIES = (Electra(),)
