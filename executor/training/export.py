"""The trained model as a Hugging Face folder (``ptplan run --export DIR``).

Rank 0 gathers every layer (``runtime.ElasticRuntime.gather``) after the last step; ``export_hf``
builds a fresh Hugging Face model of the adapter's class from the run's config
(``BertForSequenceClassification``, ``ViTForImageClassification``, ``GPT2LMHeadModel``), lays the
same layer adapters over it (``families.hf_model``: the adapters hold the Hugging Face submodules
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

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

from ptplan.executor.families import hf_model

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
    os.chmod(tmp, 0o777 & ~_umask())  # a folder for others to load, as mkdir makes it (mkdtemp's is 0700)
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if type(e).__name__ == "SafetensorError":  # safetensors' failed write (a full disk) is not an OSError
            raise PtplanError(f"cannot write the export {dest}: {str(e).splitlines()[0][:200]}; free space or "
                              f"export elsewhere") from None
        raise
    return dest


# ---- a folder a user can ship: tokenizer, label names, model card (issue 25) ----------------------------------

def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it: a window for other threads' files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            return next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def finish_export(dest: str | os.PathLike, *, sources: list[str | None], data: str | None, plan_path: str,
                  log_path: str | None) -> list[str]:
    """Complete the export at ``dest`` after the run: the tokenizer or image-processor files from the first of
    ``sources`` (``--weights``, the ``--model`` folder) that has them, ``id2label``/``label2id`` in config.json from
    the data file's label names (``ptplan data`` records them), and a model card (README.md) saying how it was
    trained. Every file is written beside its destination and renamed into place. Returns notes for the user
    (what could not be added and why)."""
    out = Path(dest)
    notes: list[str] = []
    have = {f for f in _SIDE_FILES if (out / f).is_file()}
    source = next((s for s in sources if s and any((Path(s) / f).is_file() for f in _SIDE_FILES)), None)
    if not have and source is not None:
        for name in _SIDE_FILES:
            if (Path(source) / name).is_file():
                _copy_atomic(Path(source) / name, out / name)
    elif not have:
        notes.append(f"no tokenizer or image-processor files in {', '.join(s for s in sources if s) or 'any folder'}: "
                     f"{out} holds the model only; copy your tokenizer files into it before AutoTokenizer.from_pretrained")
    labels = data_label_names(data)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    heads = len(config["id2label"]) if config.get("id2label") else 2  # transformers 5 leaves its default 2 out
    if labels and len(labels) == heads:
        config["id2label"] = {str(i): name for i, name in enumerate(labels)}
        config["label2id"] = {name: i for i, name in enumerate(labels)}
        _write_atomic(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    elif labels:
        notes.append(f"the data's {len(labels)} label names do not match the head's {heads} classes; config.json "
                     f"keeps LABEL_i names")
    _write_atomic(out / "README.md", model_card(out, config=config, plan_path=plan_path, log_path=log_path,
                                                data=data, base=source or next((s for s in sources if s), None)))
    return notes


def data_label_names(data: str | None) -> list[str]:
    """The class names a ``ptplan data`` file records (``meta.label_names``, class order); [] when none."""
    if not data or data == "synthetic" or not data.endswith(".pt") or not os.path.isfile(data):
        return []
    try:
        d = torch.load(data, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 -- an unreadable file was refused before the run; no names then
        return []
    names = (d.get("meta") or {}).get("label_names") if isinstance(d, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else []


def model_card(out: Path, *, config: dict[str, Any], plan_path: str, log_path: str | None, data: str | None,
               base: str | None) -> str:
    """A short README.md for the export: the base model, the data, the plan's phases run, epochs, held-out metric,
    and how to load it."""
    from ptplan.planner.plan import load_plan
    from ptplan.planner.runlog import read_run_log

    plan = load_plan(plan_path)
    # a log this run wrote no step to (resumed at its last step) reads: the card then says "not logged"
    log = read_run_log(log_path, require_steps=False) if log_path and os.path.isfile(log_path) else None
    steps = log.steps if log else ()
    ran = sorted({(s.phase, s.frozen_blocks, s.K, s.D) for s in steps})
    evals = [r for r in (log.records if log else ()) if r.type == "eval"]
    best = [r for r in (log.records if log else ()) if r.type == "export" and r.get("kind") == "best"]
    metric = best[-1] if best else (evals[-1] if evals else None)
    arch = (config.get("architectures") or ["?"])[0]
    lines = [f"# {out.name}", "", f"A `{arch}` fine-tuned with ptplan's elastic "
             f"pipelined training (PipeTransformer's freezing, planned ahead of time).", "",
             "| | |", "|---|---|",
             f"| base model | `{plan.inputs.profile.model}`{f' (from `{base}`)' if base else ''} |",
             f"| training data | `{data or 'synthetic'}` |",
             f"| plan | `{plan_path}`: {len(plan.phases)} planned phases, freeze `{_freeze_words(plan.inputs.freeze)}` |",
             f"| epochs | {max((s.epoch for s in steps), default=-1) + 1} ({len(steps)} optimizer steps) |",
             f"| phases run (frozen blocks, K x D) | "
             f"{'; '.join(f'{f} frozen, {k} x {d}' for _, f, k, d in ran) or 'not logged'} |"]
    if metric is not None:
        what = "best held-out evaluation (--export-best)" if best else "held-out evaluation after the last epoch"
        acc = metric.get("accuracy")
        lines.append(f"| {what} | " + (f"accuracy {acc:.4f}, " if acc is not None else "")
                     + f"loss {metric.get('loss'):.4f} at step {metric.get('step')} |")
    labels = config.get("id2label") or {}
    if labels:
        lines.append(f"| labels | {', '.join(f'{i}: {n}' for i, n in sorted(labels.items(), key=lambda x: int(x[0])))} |")
    task = "AutoModelForCausalLM" if arch.endswith("LMHeadModel") or arch.endswith("CausalLM") else \
        ("AutoModelForImageClassification" if "Image" in arch else "AutoModelForSequenceClassification")
    pre = "AutoImageProcessor" if "Image" in task else "AutoTokenizer"
    lines += ["", "```python", f"from transformers import {pre}, {task}", "",
              f'{"processor" if "Image" in task else "tokenizer"} = {pre}.from_pretrained("{out.name}")',
              f'model = {task}.from_pretrained("{out.name}")', "```", ""]
    return "\n".join(lines)


def _freeze_words(freeze: Any) -> str:
    """``geometric, alpha 0.333`` / ``none`` / ``manual 0,2,4``."""
    if freeze.policy == "geometric":
        return f"geometric, alpha {freeze.alpha:.3g}"
    if freeze.policy == "manual":
        return "manual " + ",".join(map(str, freeze.manual))
    return str(freeze.policy)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PtplanError(f"cannot write {path}: {e.strerror or e}; free space or export elsewhere") from None


def _copy_atomic(src: Path, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        shutil.copy2(src, tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PtplanError(f"cannot copy {src} into the export: {e.strerror or e}") from None
