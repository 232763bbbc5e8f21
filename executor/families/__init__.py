"""Model families: one adapter file per Hugging Face family, one registry, and the generic parts around them.

Files: ``base.py`` (``LayeredModel``, ``LayerSpec``, masks, layers several families share), ``family.py`` (the
``Family`` contract, the Megatron ``Split`` record, the token-sliced attention helpers), ``registry.py`` (the
one lookup the executor uses: by model_type ``get``, by layer ``of_layer``/``tp_split``/``tp_twin``/
``slice_forward``/``is_attention``, ``tp_families``), ``source.py`` (presets, aliases, model folders),
``weights.py`` (meta-device builds, per-submodule initialisation, weight-file loading, streaming),
``build.py`` (``build_model``, ``backbone_layers``, the export's ``hf_model``), ``custom.py``
(``custom_model``); the families: ``bert.py`` (BERT, RoBERTa), ``distilbert.py``, ``vit.py``, ``gpt2.py``,
``llama.py`` (Llama, Mistral, Qwen2), ``electra.py`` (ELECTRA: the example of a family added in one file, on
BERT's blocks). ``models.py`` only re-exports the names the single module used to hold.

Adding a family is one file here, its row in ``planner/families.py`` (the torch-free facts the planner
reads: config keys of heads / key-value heads / MLP width, causal or classifier, token slices) and its row
in ``tests/test_family_registry.py``. The file defines ``FAMILIES``, a tuple of ``Family`` instances; each
``Family`` subclass sets

- ``name`` (the Hugging Face ``model_type``), ``config_class`` and ``model_class`` (transformers names),
- ``presets`` (name -> config keyword arguments) and ``aliases``,
- ``dropout_fields`` (what ``build_model(dropout=...)`` sets) and ``head_keys`` (weights a base-model
  checkpoint may lack: the task head, initialised from the seed),
- ``layer_classes`` (its layer wrappers: each ``forward(x, attention_mask=None)``, wrapping the Hugging Face
  submodules themselves), ``tp_splits`` (layer class -> ``Split``: q/k/v and MLP-up column-wise, attention
  output and MLP-down row-wise) and ``attention_layers`` (those a token slice needs the keys and values of),

and implements ``backbone(base, half)`` (embedding, blocks as halves or whole, pre-LN final norm) and
``head(hf)`` (pooler/norm slot and head). It overrides where it differs: ``copied_head`` (a head that
starts as a copy of the embedding: GPT-2, tied Llama), ``seq_len``/``position_limit``, ``slice_forward``
(token slices, for causal LMs), ``tp_twin`` (GPT-2's Conv1D -> Linear before the split) and ``to_hf`` (the
export mapping). A variant that runs through another family's layers (RoBERTa, Mistral, Qwen2) subclasses
that family and leaves ``layer_classes`` empty.
"""
from ptplan.planner.families import CAUSAL_FAMILIES, CLASSIFIER_FAMILIES

from ptplan.executor.families.base import GRANULARITIES, LayeredModel, LayerSpec
from ptplan.executor.families.build import backbone_layers, build_model, config_summary, hf_model, preset_config
from ptplan.executor.families.custom import custom_model
from ptplan.executor.families.family import Family, Split
from ptplan.executor.families.registry import REFUSED_FAMILIES, get, of_layer
from ptplan.executor.families.source import (FAMILIES, MODEL_NAMES, ModelSource, family_of, folder_label,
                                             is_model_folder, model_source, read_folder_config)
from ptplan.executor.families.weights import module_seed, streamed

__all__ = ["CAUSAL_FAMILIES", "CLASSIFIER_FAMILIES", "FAMILIES", "GRANULARITIES", "MODEL_NAMES", "REFUSED_FAMILIES",
           "Family", "LayerSpec", "LayeredModel", "ModelSource", "Split", "backbone_layers", "build_model",
           "config_summary", "custom_model", "family_of", "folder_label", "get", "hf_model", "is_model_folder",
           "model_source", "module_seed", "of_layer", "preset_config", "read_folder_config", "streamed"]
