"""The trained model as a Hugging Face folder (``ptplan run --export DIR``).

Rank 0 gathers every layer (``runtime.ElasticRuntime.gather``) after the last step; ``export_hf``
builds a fresh Hugging Face model of the adapter's class from the run's config
(``BertForSequenceClassification``, ``ViTForImageClassification``, ``GPT2LMHeadModel``), lays the
same layer adapters over it (``models._flatten``: the adapters hold the Hugging Face submodules
themselves), loads the gathered weights into them -- so every weight lands in its Hugging Face
parameter -- and writes ``save_pretrained`` output (config.json, model.safetensors) plus, when the run
started from ``--weights DIR``, that folder's tokenizer or image-processor files. GPT-2: the
adapter's LM head is untied from the token embedding (a pipeline cannot share one parameter between
its first and last stage), so the export says ``tie_word_embeddings: false`` and writes both.

The folder is written next to its destination and renamed into place: a failed export leaves no
half-written folder. ``AutoModelForSequenceClassification`` / ``AutoModelForImageClassification`` /
``AutoModelForCausalLM.from_pretrained(DIR)`` load it and give the executor's predictions
(``tests/test_export.py``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "merges.txt",
               "vocab.json", "added_tokens.json", "preprocessor_config.json")
"""Files copied from the --weights folder, when there: what a user needs to feed the exported model."""


def check_export_dir(path: str | os.PathLike) -> None:
    """Refuse an export destination that exists and is not empty, or whose folder cannot hold it."""
    p = Path(path)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise PtplanError(f"--export {p} exists and is not an empty folder; give a new folder name")
    parent = p.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise PtplanError(f"--export {p}: cannot create it in {parent}; create that folder or export elsewhere")


def hf_model(model: nn.Module, weights: dict[str, Tensor]) -> nn.Module:
    """A Hugging Face model of ``model``'s family and config holding ``weights`` (the LayeredModel's
    parameter names, e.g. from ``gather``)."""
    from ptplan.executor.families.models import LayeredModel, _classes, _flatten, _quiet_transformers

    family = model.family
    config = model.config.__class__.from_dict(model.config.to_dict())
    _, cls = _classes(family)
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
    if family == "gpt2":
        head = dict(shell.named_parameters())[f"layers.{len(layers) - 1}.weight"]
        hf.config.tie_word_embeddings = False
        hf.lm_head.weight = nn.Parameter(head.detach().clone())
    hf.eval()
    return hf


def export_hf(model: nn.Module, weights: dict[str, Tensor], out: str | os.PathLike,
              source: str | os.PathLike | None = None, *, replace: bool = False) -> Path:
    """Write ``weights`` as a Hugging Face folder at ``out`` (atomically); returns its path.

    ``replace``: ``out`` may hold an earlier export (``--export-best``, model-only checkpoints): the new
    folder is written beside it and swapped in, so ``out`` always holds one whole export."""
    dest = Path(out).absolute()
    if replace:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PtplanError(f"cannot create {dest.parent}: {e.strerror or e}; write elsewhere") from None
    if not (replace and dest.is_dir()):
        check_export_dir(out)
    hf = hf_model(model, weights)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        if source is not None:
            for name in _SIDE_FILES:
                f = Path(source) / name
                if f.is_file():
                    shutil.copy2(f, tmp / name)
        if dest.exists() and replace and any(dest.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / "x")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if dest.exists():
                dest.rmdir()  # empty (check_export_dir)
            os.replace(tmp, dest)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PtplanError(f"cannot write the export {dest}: {e.strerror or e}; free space or export elsewhere") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
