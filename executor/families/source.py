"""Which model: a preset name (each family file's ``presets``), an alias, or a local Hugging Face model folder
(its config.json's ``model_type`` picks the family), and the weights folder that goes with it.

Names: ``*-tiny`` are small configs for tests (4 blocks, hidden 64); ``*-small`` (4 blocks, hidden 256; ViT
64x64 pixels in 8x8 patches) are big enough for compute to outweigh framework overheads on a CPU (the
calibration benchmark, ``bench/calibrate.py``); the others have the published sizes (Hugging Face's names:
``roberta-base``, ``gpt2-xl``, ``vit-huge-patch14-224``, ``mistral-7b``, ...). A folder model is named by its
Hugging Face name (config.json's ``_name_or_path`` when that is a hub name) or else its folder's name:
profiles record it, and the family apart. With ``weights=DIR`` under a name, the architecture comes from
``DIR/config.json`` (as ``from_pretrained`` does) and must have the named model's layer structure.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptplan.planner.errors import PtplanError
from ptplan.planner.families import family_facts

from ptplan.executor.families.registry import REFUSED_FAMILIES, families
from ptplan.executor.families.weights import weight_files

FAMILIES: tuple[str, ...] = tuple(families())
"""The Hugging Face ``model_type``s ptplan has an adapter for; a model's family is its config's model_type."""
_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    name: (fam.name, dict(kw)) for fam in families().values() for name, kw in fam.presets.items()}
"""name -> (family, config keyword arguments), from every family file (tests/test_models.py checks the published
sizes' parameter counts)."""
_ALIASES: dict[str, str] = {a: n for fam in families().values() for a, n in fam.aliases.items()}
"""Other spellings of preset names."""
_FIRST = ("bert-tiny", "bert-base", "bert-large", "vit-tiny", "vit-base", "vit-large", "gpt2-tiny", "gpt2",
          "gpt2-medium", "bert-small", "vit-small", "llama-tiny")
MODEL_NAMES: tuple[str, ...] = _FIRST + tuple(n for n in _PRESETS if n not in _FIRST)
"""Every preset name (``_ALIASES`` spell some of them otherwise; a local folder is a model too)."""


def _structure(family: str) -> str:
    """The layer structure (adapter module) a family runs through: RoBERTa's is BERT's, Mistral's Llama's."""
    facts = family_facts(family)
    return facts.module if facts is not None else family


@dataclass(frozen=True)
class ModelSource:
    """Where a model's architecture and weights come from, and what profiles call it."""

    label: str
    """The model's name in profiles, plans and logs: the preset name, or for a folder its Hugging Face
    name (config.json's ``_name_or_path`` when that is a hub name) or else the folder's name."""
    family: str
    """The Hugging Face ``model_type`` (picks the adapter: ``registry.get``)."""
    preset: dict[str, Any] | None
    """Config keyword arguments of a preset (None for a folder)."""
    folder: Path | None
    """A Hugging Face model folder (config.json; None for a preset)."""
    load_weights: bool
    """Load the folder's weight files (else every weight is initialised from the seed)."""


def is_model_folder(name: str | os.PathLike) -> bool:
    """Whether ``name`` names a local folder (a Hugging Face model folder, or meant as one)."""
    return Path(name).is_dir()


def _check_family(model_type: Any, where: str) -> str:
    if model_type in REFUSED_FAMILIES:
        raise PtplanError(f"{where} is a {model_type!r} model, which ptplan refuses: {REFUSED_FAMILIES[model_type]}. "
                          f"Supported: {', '.join(FAMILIES)}")
    if model_type not in FAMILIES:
        raise PtplanError(f"{where} is a {model_type!r} model; ptplan has adapters for the model types "
                          f"{', '.join(FAMILIES)}")
    return str(model_type)


def read_folder_config(folder: str | os.PathLike) -> dict[str, Any]:
    """config.json of a Hugging Face model folder as a dict, its model_type checked (PtplanError otherwise)."""
    d = Path(folder)
    if not d.is_dir():
        raise PtplanError(f"model folder not found: {d}")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise PtplanError(f"{d} has no config.json; expected a Hugging Face model folder (save_pretrained output)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PtplanError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(raw, dict):
        raise PtplanError(f"{cfg_path} is not a JSON object")
    _check_family(raw.get("model_type"), f"{cfg_path}")
    return raw


def folder_label(folder: str | os.PathLike, raw: dict[str, Any]) -> str:
    """A folder model's name: config.json's ``_name_or_path`` when it is a hub name (``org/name`` or
    ``name``, not a local path), else the folder's own name."""
    d = Path(folder).absolute()
    hub = raw.get("_name_or_path")
    if (isinstance(hub, str) and hub.strip() and hub == hub.strip() and hub.count("/") <= 1
            and not hub.startswith(("/", ".", "~")) and "\\" not in hub and not Path(hub).exists()):
        return hub
    return d.name or str(d)


def _preset(name: str) -> tuple[str, dict[str, Any]] | None:
    key = _ALIASES.get(name, name)
    return _PRESETS.get(key)


def _unknown(name: str) -> PtplanError:
    hint = (f"; {name} looks like a path but is not a folder" if any(c in name for c in "/\\") or name.startswith(".")
            else "")
    return PtplanError(f"unknown model {name!r}{hint}; choose one of {', '.join(MODEL_NAMES)}, or give a local "
                       f"Hugging Face model folder (its config.json is enough; weights are loaded when present)")


def model_source(name: str | os.PathLike, weights: str | os.PathLike | None = None) -> ModelSource:
    """Resolve ``name`` (a preset, an alias, or a local model folder) and ``weights`` (a folder of weights
    whose config.json sets the architecture) into a ModelSource; PtplanError when neither works.

    The adapter follows the folder's config.json ``model_type``; a preset name given with ``weights`` of
    another layer structure (e.g. ``gpt2`` with a BERT folder) is refused, one of the same structure
    (``llama-tiny`` with a Mistral folder) is run with the folder's own model type.
    """
    name = str(name)
    preset = _preset(name)
    if preset is None and not is_model_folder(name):
        raise _unknown(name)
    if weights is None:
        if preset is not None:
            return ModelSource(label=_ALIASES.get(name, name), family=preset[0], preset=dict(preset[1]),
                               folder=None, load_weights=False)
        raw = read_folder_config(name)
        d = Path(name)
        return ModelSource(label=folder_label(d, raw), family=raw["model_type"], preset=None, folder=d,
                           load_weights=bool(weight_files(d)))
    d = Path(weights)
    if not d.is_dir():
        raise PtplanError(f"weights folder not found: {d}")
    raw = read_folder_config(d)
    family = raw["model_type"]
    named = preset[0] if preset is not None else read_folder_config(name)["model_type"]
    if _structure(named) != _structure(family):
        raise PtplanError(f"weights in {d} are a {family!r} model but {name} is a {named!r} model; give the folder "
                          f"itself as the model (ptplan profile {d} / ptplan run --model {d}) or pick a {family} "
                          f"model name")
    if not weight_files(d):
        raise PtplanError(f"weights folder {d} has no *.safetensors or pytorch_model*.bin weight files; to build "
                          f"the model from its config.json alone (random init), give the folder as the model "
                          f"(ptplan profile {d})")
    return ModelSource(label=folder_label(d, raw), family=family, preset=None, folder=d, load_weights=True)


def family_of(name: str | os.PathLike) -> str | None:
    """The family (model_type) of a preset name or model folder; None when ``name`` is neither (or the
    folder's config cannot be read)."""
    preset = _preset(str(name))
    if preset is not None:
        return preset[0]
    if not is_model_folder(name):
        return None
    try:
        return str(read_folder_config(name)["model_type"])
    except PtplanError:
        return None
