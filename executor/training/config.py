"""What ``ptplan run`` asks the runtime to do: one keyword-only record, checked on construction."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ptplan.planner.errors import PtplanError

from ptplan.executor.runtime.optim import OPTIMIZERS

FREEZE_MODES = ("planned", "adaptive")
DEFAULT_LR = {"adamw": 5e-5, "sgd": 0.01}
"""The learning rate a run takes where none is given: fine-tuning's usual AdamW rate, and SGD's."""
DTYPES = ("float32", "bfloat16", "float16")
CACHE_MODES = ("auto", "off")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Settings of one training run (the plan decides the layout; this decides everything else)."""

    plan: str
    """Path of the plan file (``ptplan plan`` output)."""
    model: str
    """Model adapter name (``executor.models.MODEL_NAMES``); must match the plan's profile."""
    weights: str | None = None
    """Local Hugging Face model folder to start from (None: random init from ``seed``)."""
    epochs: int | None = None
    """Epochs to run (None: the plan's)."""
    steps_per_epoch: int | None = None
    """Optimizer steps per epoch (None: as many full global batches as the epoch's samples hold)."""
    optimizer: str = "plan"
    """``plan`` (the optimizer the plan priced the state of: ``resolved``), ``sgd`` (with momentum) or ``adamw``."""
    lr: float | None = None
    """Peak learning rate (None: ``DEFAULT_LR`` of the optimizer, set by ``resolved``)."""
    momentum: float = 0.9
    """SGD momentum (ignored by AdamW)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) or L2 (SGD) weight decay, on weight matrices only (``optim.param_groups``)."""
    decay_all: bool = False
    """Also decay biases and normalisation weights (the 1-D parameters), as ptplan did before."""
    lr_schedule: str = "constant"
    """``constant``, ``linear`` or ``cosine`` decay to 0 at the last step (``optim.lr_factor``)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over the first N optimizer steps."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm (all stages, after the data-parallel average) to this value, as
    ``torch.nn.utils.clip_grad_norm_`` on the whole model would; None: no clipping."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (1e-6, as in BERT pre-training, damps the noise of near-zero gradients)."""
    seed: int = 0
    """Seeds the model init, the data order and the synthetic data."""
    freeze: str = "planned"
    """``planned``: follow the plan's trajectory; ``adaptive``: the gradient-norm rule picks the count."""
    freeze_every: int | None = None
    """Take a freeze step every N optimizer steps instead of the plan's cadence (planned: the plan's
    trajectory entries are consumed one per N steps)."""
    alpha: float | None = None
    """Freeze rate for ``adaptive`` (None: the plan's, else 1/3)."""
    checkpoint_dir: str | None = None
    """Folder for ``checkpoint.pt`` (None: no checkpoints)."""
    checkpoint_every: int = 0
    """Also checkpoint every N optimizer steps (0: only at the end of each epoch and of the run)."""
    resume: bool = False
    """Continue from ``checkpoint_dir/checkpoint.pt`` (in whatever phase it was written)."""
    checkpoint_format: str = "single"
    """``single``: rank 0 gathers and writes ``checkpoint.pt`` (resumes the same plan and world size; no shared
    folder needed). ``sharded``: every rank writes its own layers with torch.distributed.checkpoint into one
    folder every rank sees (``training/sharded.py``); resumes on any world size and plan of the same profile."""
    async_checkpoint: bool = False
    """``sharded`` only: write in the background (DCP ``async_save``), training goes on during the write."""
    log: str | None = None
    """Run log path (JSON lines), written by rank 0; appended to on resume."""
    data: str = "synthetic"
    """``synthetic`` or a .pt/.npz file of tensors (inputs, labels, optional attention_mask)."""
    shuffle: bool = True
    """Visit samples in a seeded random order per epoch (False: in id order)."""
    eval_data: str | None = None
    """A held-out .pt/.npz file (the training data's format) evaluated at each epoch end and every
    ``eval_every`` steps (``evaluate``); None: no evaluation."""
    eval_every: int = 0
    """Also evaluate every N optimizer steps (0: only at epoch ends)."""
    eval_batch_size: int = 32
    """Samples per evaluation micro-batch on each pipeline."""
    export: str | None = None
    """Folder to write the final model to as a Hugging Face folder (``export.export_hf``); None: none."""
    export_best: bool = False
    """Write ``export`` at the best held-out evaluation instead of the end (accuracy, ties and causal LMs by
    loss; needs ``eval_data``): rewritten each time an evaluation beats the best so far."""
    save_model_every: int = 0
    """Every N optimizer steps, write the model only (a Hugging Face folder, no optimizer state) to
    ``save_model_dir/model-step<N>`` (0: never)."""
    save_model_dir: str | None = None
    """Folder for the ``save_model_every`` model-only checkpoints."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: the forward passes under ``torch.autocast`` in bfloat16 (CUDA, or CPU), with the
    weights, gradients and optimizer state kept in ``dtype``."""
    dropout: float | None = None
    """Set every dropout of the model (None: keep the config's)."""
    image_size: int | None = None
    """ViT only: pixels per side (None: from the plan's sequence length)."""
    num_labels: int | None = None
    """Classes of the classification head (bert, vit; None: the plan's profile's, see
    ``job.plan_num_labels``). GPT-2's head is its LM head: leave None."""
    dtype: str = "float32"
    device: str = "auto"
    """``auto`` (CUDA from LOCAL_RANK when available, else CPU), ``cpu`` or ``cuda``."""
    timeout_s: float = 600.0
    """Process-group timeout: a dead peer makes the job fail after at most this long."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    cache: str = "auto"
    """AutoCache: ``auto`` caches the frozen prefix's output in the phases where the plan says so
    (``Phase.cache``); ``off`` always recomputes it (same results, slower stage 0)."""
    cache_dir: str | None = None
    """Directory of the cache's RAM tier, one subdirectory per node, removed at the end (None: /dev/shm)."""
    cache_budget: int | None = None
    """Cap on the cache's RAM-tier bytes per node (None: what the data set needs, see ``cache_run``)."""
    cache_spill_dir: str | None = None
    """Disk directory for slabs beyond the budget (None: rows that do not fit are recomputed each time)."""
    cache_allow_nondeterministic: bool = False
    """Cache even when the frozen prefix is not a fixed function of the sample (random augmentation, an
    eval-mode random layer): every later epoch then replays the first output computed."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("plan", *OPTIMIZERS):
            raise PtplanError(f"unknown optimizer {self.optimizer!r}; use one of plan, {', '.join(OPTIMIZERS)}")
        if self.freeze not in FREEZE_MODES:
            raise PtplanError(f"unknown freeze mode {self.freeze!r}; use one of {', '.join(FREEZE_MODES)}")
        if self.dtype not in DTYPES:
            raise PtplanError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise PtplanError(f"unknown device {self.device!r}; use auto, cpu or cuda")
        for name in ("epochs", "steps_per_epoch", "freeze_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise PtplanError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
        if self.checkpoint_every < 0:
            raise PtplanError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_format not in ("single", "sharded"):
            raise PtplanError(f"unknown --checkpoint-format {self.checkpoint_format!r}; use single or sharded")
        if self.async_checkpoint and self.checkpoint_format != "sharded":
            raise PtplanError("--async-checkpoint needs --checkpoint-format sharded (a single file is written by "
                              "rank 0 after a gather)")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise PtplanError(f"unknown --lr-schedule {self.lr_schedule!r}; use constant, linear or cosine")
        if self.warmup_steps < 0:
            raise PtplanError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.clip_grad_norm is not None:
            _number("--clip-grad-norm", self.clip_grad_norm, low=0.0, low_open=True, hint="e.g. --clip-grad-norm 1.0")
        if self.eval_every < 0:
            raise PtplanError(f"--eval-every must be >= 0, got {self.eval_every}")
        if self.eval_every and not self.eval_data:
            raise PtplanError("--eval-every needs --eval-data (the held-out file to evaluate)")
        if self.eval_batch_size < 1:
            raise PtplanError(f"--eval-batch-size must be at least 1, got {self.eval_batch_size}")
        if self.lr is not None:
            _number("--lr", self.lr, low=0.0, low_open=True, hint="e.g. --lr 1e-4")
        _number("--momentum", self.momentum, low=0.0, high=1.0, high_open=True, hint="e.g. --momentum 0.9")
        _number("--weight-decay", self.weight_decay, low=0.0, hint="e.g. --weight-decay 0.01")
        _number("--adam-eps", self.adam_eps, low=0.0, low_open=True, hint="e.g. --adam-eps 1e-8")
        _number("--timeout", self.timeout_s, low=0.0, low_open=True, high=7 * 86400.0,
                hint="seconds, e.g. --timeout 600")
        if self.dropout is not None:
            _number("--dropout", self.dropout, low=0.0, high=1.0, high_open=True, hint="e.g. --dropout 0.1")
        if not 0 <= self.seed < 2**32:
            raise PtplanError(f"--seed must lie in 0..{2**32 - 1}, got {self.seed}")
        if self.alpha is not None and not 0 < self.alpha < 1:
            raise PtplanError(f"--alpha must lie strictly between 0 and 1, got {self.alpha}")
        if self.resume and not self.checkpoint_dir:
            raise PtplanError("--resume needs --checkpoint-dir (the folder holding checkpoint.pt)")
        if self.cache not in CACHE_MODES:
            raise PtplanError(f"unknown cache mode {self.cache!r}; use one of {', '.join(CACHE_MODES)}")
        if self.num_labels is not None and self.num_labels < 1:
            raise PtplanError(f"--num-labels must be at least 1, got {self.num_labels}")
        if self.precision not in PRECISIONS:
            raise PtplanError(f"unknown --precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if self.export_best and not (self.export and self.eval_data):
            raise PtplanError("--export-best needs --export DIR (where to write) and --eval-data (what 'best' is "
                              "measured on)")
        if self.save_model_every < 0:
            raise PtplanError(f"--save-model-every must be >= 0, got {self.save_model_every}")
        if self.save_model_every and not self.save_model_dir:
            raise PtplanError("--save-model-every needs a folder: --save-model-dir DIR (or --checkpoint-dir)")
        if self.cache_budget is not None and self.cache_budget < 0:
            raise PtplanError(f"--cache-budget must be >= 0 bytes, got {self.cache_budget}")

    def resolved(self, plan: Any) -> "RunConfig":
        """This config with what it leaves to the plan made concrete: the optimizer (``plan``: the one the plan
        priced) and the learning rate (None: ``DEFAULT_LR`` of that optimizer). The one place these defaults
        are set, for ``ptplan run`` and for ``run_training`` alike; a resolved config is returned unchanged."""
        optimizer = optimizer_for(plan, self.optimizer)[0]
        lr = self.lr if self.lr is not None else DEFAULT_LR[optimizer]
        return self if (optimizer, lr) == (self.optimizer, self.lr) else replace(self, optimizer=optimizer, lr=lr)

    @property
    def peak_lr(self) -> float:
        """The learning rate of a resolved config (``resolved``)."""
        if self.lr is None:
            raise PtplanError("this run config leaves the learning rate to the plan; use RunConfig.resolved(plan)")
        return self.lr

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        d: dict[str, Any] = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PtplanError(f"run config: unknown keys {unknown}")
        return cls(**d)


def optimizer_for(plan: Any, optimizer: str) -> tuple[str, str | None]:
    """``--optimizer`` -> (the optimizer to run, a note or None): ``plan`` is the one the plan priced; another comes
    with a note (the plan's optimizer-state bytes are not the run's)."""
    from ptplan.planner.costs import OPTIMIZER_SLOTS

    planned = plan.inputs.training.optimizer
    if optimizer == "plan" or optimizer == planned:
        return planned, None
    return optimizer, (f"the plan priced {planned}'s optimizer state ({OPTIMIZER_SLOTS[planned]} value(s) per "
                       f"parameter) and this run uses {optimizer} ({OPTIMIZER_SLOTS[optimizer]}): its memory differs "
                       f"from the plan's; make the plan with `ptplan plan ... --optimizer {optimizer}` to price it")


def _number(option: str, value: float, *, low: float | None = None, high: float | None = None,
            low_open: bool = False, high_open: bool = False, hint: str = "") -> None:
    """Refuse a non-finite value or one outside [low, high] (open ends where asked), naming the option."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PtplanError(f"{option} must be a finite number, got {value!r}" + (f" ({hint})" if hint else ""))
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
        raise PtplanError(f"{option} must be {' and '.join(x for x in (lo, hi) if x)}, got {value!r}"
                          + (f" ({hint})" if hint else ""))
