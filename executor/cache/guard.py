"""AutoCache safety checks: is the frozen prefix's output a fixed function of the sample id?

Caching replays the first output computed for a sample in every later epoch. That equals
recomputation only if the prefix is deterministic for the sample. Three things break it:

1. **Dropout active in the prefix**: an ``nn.Dropout``-family module with p > 0, or an attention
   module with attention dropout > 0 (a float attribute or the Hugging Face config's
   ``attention_probs_dropout_prob`` / ``attn_pdrop`` / ``attention_dropout``), **in training mode**.
   ptplan's own stage puts the frozen prefix in eval mode, so its prefix has no active dropout; a
   training loop that leaves frozen layers in train mode (as PipeTransformer's code does) has.
2. **Random data augmentation**: a dataset that declares ``random_augmentation = True``, or whose
   ``batch`` returns different inputs for the same id on two calls (PipeTransformer's cache reused
   the first augmented view forever).
3. **Anything else random in eval mode** (``F.dropout(training=True)``, noise layers,
   nondeterministic kernels): caught by running the prefix twice on one sample and comparing bitwise.

Each check raises a PtplanError that names the cause and the fixes, unless the caller accepts it
with ``allow_nondeterministic=True`` (then it returns the reasons, for a log line).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

_CONFIG_ATTENTION_DROPOUT = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
_MODULE_ATTENTION_DROPOUT = ("attention_dropout", "dropout_prob", "attn_dropout_p", "attn_pdrop")
_FIX = ("Fix: put the frozen layers in eval mode (ptplan's stage does this; for your own loop call "
        "model.layers[:{f}].eval()), or build the model without dropout (build_model(..., dropout=0.0)), "
        "or pass allow_nondeterministic=True to cache the eval-mode (dropout-free) output anyway")


def _layer_name(model: nn.Module, i: int) -> str:
    specs = getattr(model, "specs", None)
    return f"layers[{i}] ({specs[i].name})" if specs is not None else f"layers[{i}]"


def active_dropout(model: nn.Module, frozen_layers: int) -> list[str]:
    """Descriptions of the dropout that is active (training mode, p > 0) in ``layers[:frozen_layers]``."""
    config = getattr(model, "config", None)
    cfg_attn = {k: getattr(config, k) for k in _CONFIG_ATTENTION_DROPOUT
                if isinstance(getattr(config, k, None), (int, float)) and getattr(config, k) > 0}
    found: list[str] = []
    for i, layer in enumerate(model.layers[:frozen_layers]):
        here: list[str] = []
        attention_in_train: str | None = None
        for name, m in layer.named_modules():
            if not m.training:
                continue
            where = f"{_layer_name(model, i)}.{name}" if name else _layer_name(model, i)
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
                here.append(f"{where} ({type(m).__name__} p={m.p})")
                continue
            v = next((getattr(m, a) for a in _MODULE_ATTENTION_DROPOUT if isinstance(getattr(m, a, None), float)), 0.0)
            if v > 0:
                here.append(f"{where} ({type(m).__name__} attention dropout {v})")
            elif attention_in_train is None and "Attention" in type(m).__name__:
                attention_in_train = f"{where} ({type(m).__name__})"
        if not here and cfg_attn and attention_in_train is not None:
            k, v = next(iter(cfg_attn.items()))
            here.append(f"{attention_in_train} with config {k}={v}")
        found.extend(here)
    return found


def _refuse_or_note(reasons: list[str], allow: bool) -> list[str]:
    if reasons and not allow:
        raise PtplanError("; ".join(reasons))
    return reasons


def check_prefix_modules(model: nn.Module, frozen_layers: int, *, allow_nondeterministic: bool) -> list[str]:
    """Refuse caching when dropout is active in the frozen prefix (see the module docstring)."""
    found = active_dropout(model, frozen_layers)
    if not found:
        return []
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    msg = (f"cannot cache the frozen prefix (layers [0, {frozen_layers})): dropout is active in it, so "
           f"recomputing it gives a new random output each epoch and a cache would replay the first one "
           f"forever: {shown}. " + _FIX.format(f=frozen_layers))
    return _refuse_or_note([msg], allow_nondeterministic)


def check_dataset(dataset: Any, *, allow_nondeterministic: bool) -> list[str]:
    """Refuse caching for a dataset that declares random augmentation or returns sample 0 differently twice."""
    reasons = []
    if getattr(dataset, "random_augmentation", False):
        reasons.append(f"cannot cache the frozen prefix: the dataset ({type(dataset).__name__}) declares "
                       f"random_augmentation=True, so each epoch sees a new view of a sample and a cache would "
                       f"replay the first view forever (PipeTransformer's bug). Fix: turn augmentation off for "
                       f"cached runs, or pass allow_nondeterministic=True to accept reusing the first view")
    elif len(dataset) > 0:
        ids = torch.tensor([0])
        a, b = dataset.batch(ids)[0], dataset.batch(ids)[0]
        if not torch.equal(a, b):
            reasons.append(f"cannot cache the frozen prefix: the dataset ({type(dataset).__name__}) returned "
                           f"different inputs for sample 0 on two reads (random augmentation?). Fix: make "
                           f"batch() deterministic per id, or pass allow_nondeterministic=True")
    return _refuse_or_note(reasons, allow_nondeterministic)


def check_repeatable(model: nn.Module, frozen_layers: int, inputs: Tensor, attention_mask: Tensor | None, *,
                     allow_nondeterministic: bool, checked: int = 0) -> list[str]:
    """Run the prefix twice on the first sample (no_grad, eval) and refuse if the outputs differ at all.

    ``checked``: layers ``[0, checked)`` already passed this check; they run once, only
    ``[checked, frozen_layers)`` twice.
    """
    x = inputs[:1]
    m = None if attention_mask is None else attention_mask[:1]
    with torch.no_grad(), eval_mode(model.layers[:frozen_layers]):
        h = model.run_layers(x, 0, checked, m)
        a = model.run_layers(h, checked, frozen_layers, m)
        b = model.run_layers(h, checked, frozen_layers, m)
    if torch.equal(a, b):
        return []
    diff = (a.float() - b.float()).abs().max().item()
    msg = (f"cannot cache the frozen prefix (layers [{checked}, {frozen_layers}) of [0, {frozen_layers})): two "
           f"eval-mode runs on the same "
           f"sample differ (max |diff| {diff:.3g}), so something in it is random even in eval mode "
           f"(F.dropout(training=True), a noise layer, nondeterministic kernels). Fix: make the prefix "
           f"deterministic (e.g. torch.use_deterministic_algorithms(True)), or pass allow_nondeterministic=True")
    return _refuse_or_note([msg], allow_nondeterministic)


def check_repeatable_layers(model: nn.Module, counts: list[int], inputs: Tensor, attention_mask: Tensor | None,
                            runner: list[int], rank: int, *, allow_nondeterministic: bool) -> list[str]:
    """``check_repeatable`` for a model whose layers live on several processes: the prefix
    ``layers[:max(counts)]`` runs once on the first sample, layer by layer, each layer on rank
    ``runner[i]`` (one that holds it), which runs it twice on the same input and compares bitwise; the
    hidden state goes from rank to rank (point-to-point on the default group; collective over the ranks
    in ``runner``, every rank may call it). Equivalent to running the prefix twice: two runs first differ
    at a layer given the same input. Refuses (on the rank that found it) the smallest count above the
    first layer that differs, naming it; returns the reasons under ``allow_nondeterministic``."""
    import torch.distributed as dist

    top = max(counts, default=0)
    segments: list[tuple[int, int, int]] = []  # (rank, lo, hi): consecutive layers on one rank
    for i in range(top):
        if segments and segments[-1][0] == runner[i]:
            segments[-1] = (runner[i], segments[-1][1], i + 1)
        else:
            segments.append((runner[i], i, i + 1))
    x = inputs[:1]
    m = None if attention_mask is None else attention_mask[:1]
    shape = (1, int(model.seq_len), int(model.config.hidden_size))
    dtype = next(model.parameters()).dtype
    bad: tuple[int, float] | None = None
    for k, (r, lo, hi) in enumerate(segments):
        if r != rank:
            continue
        if lo == 0:
            h = x
        else:
            h = torch.empty(shape, dtype=dtype, device=x.device)
            dist.recv(h, src=segments[k - 1][0])
        with torch.no_grad(), eval_mode(model.layers[lo:hi]):
            for i in range(lo, hi):
                a = model.run_layers(h, i, i + 1, m)
                b = model.run_layers(h, i, i + 1, m)
                if bad is None and not torch.equal(a, b):
                    bad = (i, (a.float() - b.float()).abs().max().item())
                h = a
        if k + 1 < len(segments):
            dist.send(h.contiguous(), dst=segments[k + 1][0])
    if bad is None:
        return []
    j, diff = bad
    f = min(c for c in counts if c > j)
    msg = (f"cannot cache the frozen prefix (layers [0, {f})): two eval-mode runs on the same sample differ "
           f"(max |diff| {diff:.3g}) from {_layer_name(model, j)} on, so something in it is random even in eval "
           f"mode (F.dropout(training=True), a noise layer, nondeterministic kernels). Fix: make the prefix "
           f"deterministic (e.g. torch.use_deterministic_algorithms(True)), or pass allow_nondeterministic=True")
    return _refuse_or_note([msg], allow_nondeterministic)


class eval_mode:
    """Context manager: put modules in eval mode, restoring every submodule's own flag after."""

    def __init__(self, modules) -> None:
        self.modules = list(modules)
        self.saved: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.saved = [(m, m.training) for mod in self.modules for m in mod.modules()]
        for mod in self.modules:
            mod.eval()

    def __exit__(self, *exc) -> None:
        for m, flag in self.saved:
            m.training = flag


def prefix_fingerprint(model: nn.Module, frozen_layers: int, samples_per_tensor: int = 1024) -> str:
    """A short hash of the prefix's weights (shapes, dtypes and up to ``samples_per_tensor`` strided values
    per tensor): cheap, exact across processes, and different for different weights in practice."""
    h = hashlib.blake2b(digest_size=12)
    h.update(str(frozen_layers).encode())
    for layer in model.layers[:frozen_layers]:
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // samples_per_tensor)
            picked = flat[::step].cpu().contiguous()
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            h.update(picked.view(torch.uint8).numpy().tobytes() if picked.numel() else b"")
    return h.hexdigest()
