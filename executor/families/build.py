"""Building a family's adapter: a preset or folder (``source``) -> the Hugging Face task model with its
parameters on the meta device -> the family's flat layer list (``Family.backbone`` + ``Family.head``) ->
weights for the layers asked for (``weights``). Also the reverse, for the export: a Hugging Face model
holding a ``LayeredModel``'s trained weights (``hf_model``)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable

import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

from ptplan.executor.families.base import GRANULARITIES, LayeredModel, LayerSpec
from ptplan.executor.families.registry import REFUSED_FAMILIES, families, get
from ptplan.executor.families.source import FAMILIES, _preset, _unknown, model_source
from ptplan.executor.families.weights import _build_layers, _params_on_meta


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



def _classes(family: str) -> tuple[Any, Any]:
    """(config class, task model class) of a family (a Hugging Face model_type)."""
    return get(family).classes()


def _apply_overrides(config: Any, family: str, *, num_labels: int, dropout: float | None,
                     image_size: int | None) -> None:
    fam = get(family)
    if not fam.facts.causal:
        config.num_labels = num_labels
    if dropout is not None:
        for f in fam.dropout_fields:
            setattr(config, f, dropout)
    if image_size is not None:
        config.image_size = image_size


def preset_config(name: str) -> Any:
    """The Hugging Face config of a preset (or alias), as ``build_model`` builds it (before overrides)."""
    preset = _preset(name)
    if preset is None:
        raise _unknown(name)
    family, kw = preset
    with _quiet_transformers():
        return _classes(family)[0](**kw)


def _flatten(family: str, hf: nn.Module, granularity: str) -> tuple[list[nn.Module], list[LayerSpec]]:
    """The task model ``hf`` of ``family`` as the flat layer list (the layers hold hf's own submodules)."""
    fam = get(family)
    layers, specs = backbone_layers(hf, granularity)
    for m, spec in fam.head(hf):
        layers.append(m)
        specs.append(spec)
    return layers, specs


def _base_model(hf: nn.Module) -> tuple[str, nn.Module]:
    """(family, base model) of a Hugging Face model: the base model itself (``BertModel``) or a task model's
    (``BertForSequenceClassification.bert``)."""
    config = getattr(hf, "config", None)
    family = getattr(config, "model_type", None)
    if family in REFUSED_FAMILIES:
        raise PtplanError(REFUSED_FAMILIES[family])
    if family not in families():
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
    entries = get(family).backbone(base, granularity == "half")
    return [m for m, _ in entries], [s for _, s in entries]


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
    if image_size is not None and not get(family).facts.pixels:
        raise PtplanError(f"--image-size applies to ViT models only, not {src.label} (a {family} model)")
    if image_size is not None and image_size < 1:
        raise PtplanError(f"image size must be >= 1, got {image_size}")
    if seq_len is not None and seq_len < 1:
        raise PtplanError(f"sequence length must be >= 1, got {seq_len}")
    fam = get(family)
    config_cls, model_cls = fam.classes()
    with _quiet_transformers():
        if src.folder is not None:
            try:
                config = config_cls.from_pretrained(src.folder, local_files_only=True)
            except (OSError, ValueError, TypeError, KeyError) as e:
                raise PtplanError(f"cannot read the {family} config in {src.folder}: {e}") from None
        else:
            config = config_cls(**(src.preset or {}))
    _apply_overrides(config, family, num_labels=num_labels, dropout=dropout, image_size=image_size)
    fam.seq_len(config, seq_len)  # validate before paying for the weights
    with _quiet_transformers(), _params_on_meta():
        hf = model_cls(config)
    n = fam.seq_len(config, seq_len)
    hf.eval()
    flat, specs = _flatten(family, hf, granularity)
    model = LayeredModel(name=src.label, family=family, granularity=granularity, config=config, seq_len=n,
                         num_blocks=config.num_hidden_layers, layers=flat, specs=specs,
                         num_labels=num_labels, image_size=config.image_size if fam.facts.pixels else None)
    want = sorted(set(range(len(flat)) if layers is None else layers))
    if want and not 0 <= want[0] <= want[-1] < len(flat):
        raise PtplanError(f"layers {want} are outside the model's {len(flat)} layers [0, {len(flat)})")
    _build_layers(family, hf, model, want, seed, src.folder if src.load_weights else None)
    model.to(dtype=dtype)
    model.eval()
    return model


def hf_model(model: LayeredModel, weights: dict[str, Tensor]) -> nn.Module:
    """A Hugging Face model of ``model``'s family and config holding ``weights`` (the LayeredModel's
    parameter names, e.g. from ``gather``): the family's layers are laid over a fresh task model, so every
    weight lands in its Hugging Face parameter, then the family finishes it (``Family.to_hf``: GPT-2's
    untied head)."""
    family = model.family
    fam = get(family)
    config = model.config.__class__.from_dict(model.config.to_dict())
    _, cls = fam.classes()
    with torch.random.fork_rng(devices=[]), _quiet_transformers():
        hf = cls(config)
    hf.to(dtype=next(iter(weights.values())).dtype)
    layers, specs = _flatten(family, hf, model.granularity)
    shell = LayeredModel(name=model.name, family=family, granularity=model.granularity, config=config,
                         seq_len=model.seq_len, num_blocks=model.num_blocks, layers=layers, specs=specs,
                         num_labels=model.num_labels, image_size=model.image_size)
    names = {n for n, _ in shell.named_parameters()}
    if names != set(weights):
        missing, extra = sorted(names - set(weights)), sorted(set(weights) - names)
        raise PtplanError(f"cannot export: the gathered weights do not match the {family} model "
                          f"(missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for n, p in shell.named_parameters():
            p.copy_(weights[n])
    fam.to_hf(hf, layers[-1])
    hf.eval()
    return hf


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
