"""The generic layered model: ``LayeredModel`` (a Transformer as a flat, execution-ordered layer list with a
loss and synthetic batches), ``LayerSpec``, the attention masks and the layers several families share.

Every adapter has the same shape, whatever the family (L = number of Transformer blocks)::

    embedding, (block0.attn, block0.mlp, ..., block{L-1}.mlp) | (block0, ..., block{L-1}), norm, head

so a "half" model has 2L + 3 layers and a "block" model L + 3. Every layer is an ``nn.Module`` with
``forward(x, attention_mask=None) -> Tensor``: one tensor in, one tensor out, plus the raw ``[B, S]``
0/1 padding mask (long) that a pipeline passes to every stage; layers that need it build their own
4-D additive mask, layers that don't ignore it. The family files (``bert.py``, ``vit.py``, ...) hold
each family's own layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.families import family_facts

from ptplan.executor.families.weights import streamed

GRANULARITIES = ("block", "half")


@dataclass(frozen=True)
class LayerSpec:
    """What one entry of the flat layer list is."""

    name: str
    """e.g. ``embeddings``, ``block3.attn``, ``block3.mlp``, ``block3``, ``pooler``, ``head``."""
    kind: str
    """``embedding`` | ``block`` | ``attention`` | ``mlp`` | ``norm`` | ``head``."""
    block: int | None
    """Transformer block index for block/attention/mlp layers, None otherwise."""


# ---- masks -------------------------------------------------------------------------------------

def bert_additive_mask(attention_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``[B, S]`` 0/1 -> ``[B, 1, 1, S]`` additive mask (0 keep, dtype-min drop), as BERT expects."""
    if attention_mask is None:
        return None
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def causal_additive_mask(x: Tensor, attention_mask: Tensor | None, window: int | None = None) -> Tensor:
    """``[B|1, 1, S, S]`` additive mask: causal (within ``window`` earlier tokens when given), and also
    dropping padded keys when a mask is given."""
    S = x.shape[1]
    keep = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    if window is not None:
        keep = keep.triu(-(window - 1))
    keep = keep[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask[:, None, None, :].to(torch.bool)
    zeros = torch.zeros(keep.shape, dtype=x.dtype, device=x.device)
    return zeros.masked_fill(~keep, torch.finfo(x.dtype).min)



# ---- layers several families share ---------------------------------------------------------------

class ClassifierHead(nn.Module):
    """Dropout + linear classifier on ``[B, H]`` (or on token 0 of ``[B, S, H]`` with ``first_token``)."""

    def __init__(self, classifier: nn.Module, dropout: nn.Module | None = None, first_token: bool = False) -> None:
        super().__init__()
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.classifier = classifier
        self.first_token = first_token

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if self.first_token:
            x = x[:, 0, :]
        return self.classifier(self.dropout(x))


# ---- RoBERTa and DistilBERT layers (RoBERTa's embeddings and blocks run through the BERT layers) ----------

class TokenZeroDense(nn.Module):
    """Token 0 of ``[B, S, H]`` -> dropout (when given) -> dense -> activation: ``[B, H]``.

    The first part of RoBERTa's ``RobertaClassificationHead`` (dropout, dense, tanh) and of DistilBERT's
    classifier (``pre_classifier``, ReLU); it takes the ``norm`` slot, as BERT's pooler does.
    """

    def __init__(self, dense: nn.Module, activation: str, dropout: nn.Module | None = None) -> None:
        super().__init__()
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.dense = dense
        self.activation = activation

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        h = self.dense(self.dropout(x[:, 0, :]))
        return torch.tanh(h) if self.activation == "tanh" else F.relu(h)


class NormLayer(nn.Module):
    """A final LayerNorm (ViT ``layernorm``, GPT-2 ``ln_f``)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.norm(x)


# ---- GPT-2 layers ------------------------------------------------------------------------------

# ---- the layered model -------------------------------------------------------------------------

class LayeredModel(nn.Module):
    """A Transformer as a flat, execution-ordered ``layers`` list with a loss and synthetic batches."""

    def __init__(self, *, name: str, family: str, granularity: str, config: Any, seq_len: int,
                 num_blocks: int, layers: list[nn.Module], specs: list[LayerSpec], num_labels: int,
                 image_size: int | None = None, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
                 batch_fn: Callable[..., tuple[Tensor, Tensor, Tensor | None]] | None = None) -> None:
        super().__init__()
        assert len(layers) == len(specs)
        self.name, self.family, self.granularity = name, family, granularity
        self.config = config
        self.seq_len, self.num_blocks = seq_len, num_blocks
        self.num_labels = num_labels
        self.image_size = image_size
        self.layers = nn.ModuleList(layers)
        self.specs = tuple(specs)
        # plain attributes, not submodules (a loss module has no weights to train or move)
        object.__setattr__(self, "loss_fn", loss_fn)
        object.__setattr__(self, "batch_fn", batch_fn)

    @property
    def custom(self) -> bool:
        """Made by ``custom_model`` (the user's layers or loss), not by ``build_model``."""
        return self.loss_fn is not None or self.batch_fn is not None

    @property
    def causal(self) -> bool:
        """A causal LM (next-token loss, labels = the ids): its family's row in ``planner/families.py``."""
        facts = family_facts(self.family)
        return facts is not None and facts.causal

    @property
    def pixels(self) -> bool:
        """Inputs are images ``[B, C, H, W]`` (ViT), not token ids."""
        facts = family_facts(self.family)
        return facts is not None and facts.pixels

    def forward(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Run every layer in order: raw inputs -> logits."""
        return self.run_layers(inputs, 0, len(self.layers), attention_mask)

    def run_layers(self, x: Tensor, lo: int, hi: int, attention_mask: Tensor | None = None) -> Tensor:
        """Run ``layers[lo:hi]`` on x (raw inputs when lo == 0, else the output of layer lo-1).

        A layer whose tensors live on another device than x (a frozen prefix kept in host memory
        while x is on a GPU) is streamed: see ``streamed``.
        """
        if not 0 <= lo <= hi <= len(self.layers):
            raise ValueError(f"layer range [{lo}, {hi}) is outside [0, {len(self.layers)}]")
        for i in range(lo, hi):
            with streamed(self.layers[i], x.device, what=f"layer {i}"):
                x = self.layers[i](x, attention_mask=attention_mask)
        return x

    def loss(self, output: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy (causal LMs: next-token, ignoring label -100), computed in float32; or the
        ``loss_fn`` given to ``custom_model``."""
        if self.loss_fn is not None:
            return self.loss_fn(output, labels)
        if self.causal:
            logits = output[:, :-1, :].float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return F.cross_entropy(output.float(), labels)

    def make_batch(self, batch_size: int, generator: torch.Generator | None = None, *, meta: bool = False
                   ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Synthetic (inputs, labels, attention_mask-or-None) of the right shapes and dtypes.

        BERT: ids ``[B, S]``, class labels ``[B]``, all-ones mask ``[B, S]``. GPT-2: ids, labels =
        the ids, all-ones mask. ViT: pixels ``[B, 3, H, W]`` in the model dtype, class labels, None.
        Tensors are created on the CPU with ``generator`` and moved to the model's device; with ``meta`` they are
        made on the meta device (shapes and dtypes, no storage: the projection's counting, at any batch size).
        """
        if batch_size < 1:
            raise PtplanError(f"batch size must be >= 1, got {batch_size}")
        p = next(self.parameters())
        if p.device.type == "meta":  # a stage build whose first layer another rank builds: the CPU
            p = torch.empty(0, dtype=p.dtype)
        if self.batch_fn is not None:
            bx, by, bm = self.batch_fn(batch_size, generator)
            dev = torch.device("meta") if meta else p.device
            bx = bx.to(dev, p.dtype) if bx.is_floating_point() else bx.to(dev)
            return bx, by.to(dev), None if bm is None else bm.to(dev)
        B, S = batch_size, self.seq_len
        if meta:
            kw: dict[str, Any] = {"device": "meta"}
            if self.pixels:
                c = self.config
                return (torch.empty(B, c.num_channels, self.image_size, self.image_size, dtype=p.dtype, **kw),
                        torch.empty(B, dtype=torch.long, **kw), None)
            ids = torch.empty(B, S, dtype=torch.long, **kw)
            return ids, (torch.empty(B, S, dtype=torch.long, **kw) if self.causal else
                         torch.empty(B, dtype=torch.long, **kw)), torch.empty(B, S, dtype=torch.long, **kw)
        if self.pixels:
            c = self.config
            x = torch.randn(B, c.num_channels, self.image_size, self.image_size, generator=generator)
            y = torch.randint(0, self.num_labels, (B,), generator=generator)
            return x.to(p.device, p.dtype), y.to(p.device), None
        ids = torch.randint(1, self.config.vocab_size, (B, S), generator=generator)
        mask = torch.ones(B, S, dtype=torch.long)
        y = ids.clone() if self.causal else torch.randint(0, self.num_labels, (B,), generator=generator)
        return ids.to(p.device), y.to(p.device), mask.to(p.device)


# ---- building --------------------------------------------------------------------------------
