"""Which tensor-parallel widths split a model's layers: tp must divide the attention heads, the key/value
heads (grouped-query attention) and the MLP's intermediate width, read from a profile's config (pure).

Megatron's split gives each of tp ranks whole heads (query, key and value column-wise, the attention output
row-wise) and 1/tp of the MLP's intermediate width (``executor/runtime/hybrid.py``); which config keys hold
them is the family's row in ``families.FAMILY_FACTS``. With grouped-query attention
(the Llama family: H query heads share G key/value heads, H/G each) a rank holds G/tp key/value heads and
the H/tp query heads that read them, so tp must divide G too.
"""
from __future__ import annotations

from typing import Any, Mapping

from .families import family_facts


def split_widths(family: str, config: Mapping[str, Any]) -> dict[str, int]:
    """The widths tp must divide, by name ("attention heads", "key/value heads", "intermediate size"), from
    a Hugging Face config dict (a profile's ``model.config``) and the family's config keys
    (``families.FAMILY_FACTS``); {} for a family without a split or a config that lacks them (a profile
    written without its config)."""
    facts = family_facts(family)
    if facts is None or not facts.tensor_parallel:
        return {}
    heads = config.get(facts.heads_key)
    if not isinstance(heads, int):
        return {}
    out = {"attention heads": heads}
    if facts.kv_heads_key is not None:
        kv = config.get(facts.kv_heads_key)
        out["key/value heads"] = kv if isinstance(kv, int) else heads  # absent: multi-head attention
    mlp = config.get(facts.mlp_key)
    hidden = config.get(facts.hidden_key)
    if mlp is None and facts.mlp_default_factor is not None and isinstance(hidden, int):
        mlp = facts.mlp_default_factor * hidden  # GPT-2's n_inner=None: 4 x the width
    if isinstance(mlp, int):
        out["intermediate size"] = mlp
    return out


def tp_refusal(family: str, config: Mapping[str, Any], tp: int) -> str | None:
    """Why ``tp`` ranks cannot split this model's layers, with the numbers (None when they can, or when the
    config does not say)."""
    widths = split_widths(family, config)
    bad = [(what, n) for what, n in widths.items() if n % tp]
    if tp <= 1 or not bad:
        return None
    reasons = {"attention heads": "each tp rank holds whole heads",
               "key/value heads": "grouped-query attention: each tp rank holds whole key/value heads and the "
                                  "query heads that read them",
               "intermediate size": "each tp rank holds an equal part of the MLP"}
    fits = [t for t in (2, 4, 8, 16, 32, 64) if t < tp and all(m % t == 0 for m in widths.values())]
    sizes = ", ".join(f"{w} {m}" for w, m in widths.items())
    return (f"tensor parallelism tp={tp} does not divide this {family} model's "
            f"{' and '.join(f'{n} {what}' for what, n in bad)} ({'; '.join(reasons[w] for w, _ in bad)}; {sizes}); "
            f"{'tp must be one of ' + ', '.join(map(str, fits)) if fits else 'no tp > 1 divides them all'}")


def sp_refusal(family: str | None, seq_len: int | None, tp: int, *, K: int = 2, V: int = 1,
               sliced: bool = False) -> str | None:
    """Why a phase cannot run Megatron's sequence parallelism (``Strategy.sp``) with these numbers (None when it
    can): it needs tp > 1, a family whose executor adapter splits its norms by sequence
    (``FamilyFacts.sequence_parallel``), a sequence length tp divides (each tp rank holds S/tp tokens), no token
    slices (the sliced loop runs the canonical layers), and not several chunks on one position at K = 1 (the
    runtime gathers the sequence where a run of consecutive split layers ends; two chunks of one rank would touch)."""
    facts = family_facts(family) if family is not None else None
    if tp <= 1:
        return f"sequence parallelism splits the sequence over the tensor-parallel ranks: it needs tp > 1, not tp={tp}"
    if facts is None or not facts.sequence_parallel:
        from .families import SP_FAMILIES

        return (f"sequence parallelism runs only for the pre-LN families {', '.join(SP_FAMILIES)} "
                f"(FamilyFacts.sequence_parallel), not a {family or 'custom'} model; plan tp={tp} without sp")
    if seq_len is not None and seq_len % tp:
        return (f"sequence parallelism gives each of tp={tp} ranks S/tp tokens, but the sequence length {seq_len} is "
                f"not a multiple of {tp}; profile with --seq-len a multiple of {tp}, or plan without sp")
    if sliced:
        return "sequence parallelism does not run with token slices (the sliced loop runs the canonical layers)"
    if K == 1 and V > 1:
        return (f"sequence parallelism with one pipeline position holding V={V} chunks is not run (the chunks' "
                f"layers touch on one rank); plan V=1 at K=1")
    return None
