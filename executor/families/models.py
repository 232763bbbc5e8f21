"""Compatibility names: what ``executor/families/models.py`` held before each family got its own file.

New code imports from ``ptplan.executor.families`` (or the module named below); this module only re-exports,
so older tests and scripts that import ``ptplan.executor.families.models`` keep working.
"""
from ptplan.planner.errors import PtplanError
from ptplan.planner.families import CAUSAL_FAMILIES, CLASSIFIER_FAMILIES

from ptplan.executor.families.base import (GRANULARITIES, ClassifierHead, LayeredModel, LayerSpec, NormLayer,
                                           TokenZeroDense, bert_additive_mask, causal_additive_mask)
from ptplan.executor.families.bert import BertAttentionHalf, BertBlock, BertEmbeddingLayer, BertMLPHalf, BertPoolerLayer
from ptplan.executor.families.build import (_apply_overrides, _base_model, _classes, _flatten, _quiet_transformers,
                                            backbone_layers, build_model, config_summary, preset_config)
from ptplan.executor.families.custom import custom_model
from ptplan.executor.families.distilbert import (DistilBertAttentionHalf, DistilBertBlock, DistilBertEmbeddingLayer,
                                                 DistilBertMLPHalf)
from ptplan.executor.families.gpt2 import GPT2AttentionHalf, GPT2BlockLayer, GPT2EmbeddingLayer, GPT2MLPHalf, LMHead
from ptplan.executor.families.llama import (LinearHead, LlamaAttentionHalf, LlamaBlockLayer, LlamaEmbeddingLayer,
                                            LlamaMLPHalf, sliding_window)
from ptplan.executor.families.registry import REFUSED_FAMILIES
from ptplan.executor.families.source import (_ALIASES, _PRESETS, FAMILIES, MODEL_NAMES, ModelSource, family_of,
                                             folder_label, is_model_folder, model_source, read_folder_config)
from ptplan.executor.families.vit import ViTAttentionHalf, ViTBlock, ViTEmbeddingLayer, ViTMLPHalf
from ptplan.executor.families.weights import _WeightFiles, module_seed, streamed

__all__ = [n for n in dir() if not n.startswith("__")]
