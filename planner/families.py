"""What the planner knows of each model family, torch-free: one row per Hugging Face ``model_type``.

The executor's adapter for a family lives in ``executor/families/<module>.py`` (its layers, weight names,
tensor-parallel split, token-sliced attention and export mapping); this table is the part of it the
planner reads -- which config keys hold the widths tensor parallelism must divide (``tp_split``), whether
the family is a causal LM, whether the executor can run it in token slices -- and the executor's registry
checks that the two agree (``tests/test_family_registry.py``). Adding a family: its adapter file, its
row here, and its row in that test.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class FamilyFacts:
    """One family's planner-side facts (read from a profile's ``model.family`` and ``model.config``)."""

    name: str
    """The Hugging Face ``model_type`` (a profile's ``model.family``)."""
    module: str
    """The executor module holding its adapter: ``executor/families/<module>.py`` (RoBERTa's is ``bert``,
    Mistral's and Qwen2's ``llama``: variants that run through the same layers)."""
    causal: bool
    """A causal LM (language-model head, next-token loss, labels = token ids); else a classifier."""
    pixels: bool = False
    """Inputs are images ``[B, C, H, W]`` (ViT); else token ids ``[B, S]``."""
    heads_key: str
    """Config key of the attention heads."""
    kv_heads_key: str | None = None
    """Config key of the key/value heads (grouped-query attention); None: as many as the heads."""
    mlp_key: str
    """Config key of the MLP's intermediate width."""
    mlp_default_factor: int | None = None
    """When the config leaves ``mlp_key`` unset (GPT-2's ``n_inner=None``): this many times ``hidden_key``."""
    hidden_key: str = "hidden_size"
    """Config key of the model width."""
    tensor_parallel: bool = True
    """The executor splits its attention and MLP layers Megatron-style (``executor/runtime/hybrid.py``)."""
    sequence_parallel: bool = False
    """With tensor parallelism, the executor can also run Megatron's sequence parallelism (``Strategy.sp``): the
    layers' pre-LN norms and residual work on sequence shards (``executor/runtime/hybrid.py``), so ``ptplan plan
    --strategies auto`` may choose it. Off for the post-LN encoders (BERT, RoBERTa, DistilBERT, ELECTRA: their
    norms follow the residual add inside the split layer) and ViT (197 tokens split over no even tp)."""
    token_slices: bool = False
    """The executor runs it in token slices (TeraPipe): causal attention with a key/value context."""
    default_num_labels: int | None = None
    """The usual classifier size (None for a causal LM: its head is the language-model head)."""

    def __post_init__(self) -> None:
        assert self.causal == (self.default_num_labels is None), self.name
        assert not self.token_slices or self.causal, self.name
        assert not self.sequence_parallel or self.tensor_parallel, self.name



FAMILY_FACTS: dict[str, FamilyFacts] = {f.name: f for f in (
    FamilyFacts(name="bert", module="bert", causal=False, default_num_labels=2, heads_key="num_attention_heads",
                mlp_key="intermediate_size"),
    FamilyFacts(name="vit", module="vit", causal=False, pixels=True, default_num_labels=1000,
                heads_key="num_attention_heads", mlp_key="intermediate_size"),
    FamilyFacts(name="gpt2", module="gpt2", causal=True, heads_key="n_head", mlp_key="n_inner", mlp_default_factor=4,
                hidden_key="n_embd", token_slices=True, sequence_parallel=True),
    FamilyFacts(name="llama", module="llama", causal=True, token_slices=True, heads_key="num_attention_heads",
                kv_heads_key="num_key_value_heads", mlp_key="intermediate_size", sequence_parallel=True),
    FamilyFacts(name="roberta", module="bert", causal=False, default_num_labels=2, heads_key="num_attention_heads",
                mlp_key="intermediate_size"),
    FamilyFacts(name="distilbert", module="distilbert", causal=False, default_num_labels=2, heads_key="n_heads",
                mlp_key="hidden_dim", hidden_key="dim"),
    FamilyFacts(name="mistral", module="llama", causal=True, token_slices=True, heads_key="num_attention_heads",
                kv_heads_key="num_key_value_heads", mlp_key="intermediate_size", sequence_parallel=True),
    FamilyFacts(name="qwen2", module="llama", causal=True, token_slices=True, heads_key="num_attention_heads",
                kv_heads_key="num_key_value_heads", mlp_key="intermediate_size", sequence_parallel=True),
    FamilyFacts(name="electra", module="electra", causal=False, default_num_labels=2, heads_key="num_attention_heads",
                mlp_key="intermediate_size"),
)}
"""Every family ptplan has an adapter for, in listing order (the first four are the published ones)."""

FAMILY_NAMES: tuple[str, ...] = tuple(FAMILY_FACTS)
CAUSAL_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILY_FACTS.items() if f.causal)
CLASSIFIER_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILY_FACTS.items() if not f.causal)
TOKEN_SLICE_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILY_FACTS.items() if f.token_slices)
TP_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILY_FACTS.items() if f.tensor_parallel)
SP_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILY_FACTS.items() if f.sequence_parallel)


def family_facts(family: str) -> FamilyFacts | None:
    """The row of ``family`` (a Hugging Face model_type); None for a family ptplan has no adapter for (a
    synthetic or custom profile's)."""
    return FAMILY_FACTS.get(family)
