"""The family registry: one row per model family. Each executor family file (``executor/families/``) and its
planner row (``planner/families.py``) must agree -- layers, tensor-parallel split, token slices, heads -- so a
new family is its file, its planner row and a row in ``ROWS`` here."""
from __future__ import annotations

import pytest
import torch

from ptplan.executor.families import FAMILIES, registry
from ptplan.executor.families.base import NormLayer
from ptplan.executor.families.build import _flatten, build_model, config_summary, hf_model, preset_config
from ptplan.executor.runtime.hybrid import split_widths, tp_families, tp_plan
from ptplan.planner.errors import PtplanError
from ptplan.planner.families import FAMILY_FACTS, TP_FAMILIES
from ptplan.planner.tp_split import split_widths as config_widths

ROWS = [  # family, its test preset, (attention heads, key/value heads or None, intermediate size) of that preset
    ("bert", "bert-tiny", (4, None, 256)),
    ("vit", "vit-tiny", (4, None, 256)),
    ("gpt2", "gpt2-tiny", (4, None, 256)),
    ("llama", "llama-tiny", (4, 2, 128)),
    ("roberta", "roberta-tiny", (4, None, 256)),
    ("distilbert", "distilbert-tiny", (4, None, 256)),
    ("mistral", "mistral-tiny", (4, 2, 128)),
    ("qwen2", "qwen2-tiny", (4, 2, 128)),
    ("electra", "electra-tiny", (4, None, 256)),
]


def test_rows_cover_every_family_in_order():
    """Every family has an executor file, a planner row and a row here, listed in the same order."""
    assert [r[0] for r in ROWS] == list(FAMILY_FACTS) == list(registry.families()) == list(FAMILIES)
    assert tp_families() == TP_FAMILIES
    from ptplan.planner.plan import CAUSAL_SLICE_FAMILIES
    from ptplan.planner.families import TOKEN_SLICE_FAMILIES

    assert CAUSAL_SLICE_FAMILIES == TOKEN_SLICE_FAMILIES  # the plan reader accepts slices where the executor runs them
    for name, fam in registry.families().items():
        assert fam.name == name and type(fam).__module__ == f"ptplan.executor.families.{fam.facts.module}"


@pytest.mark.parametrize("family,preset,widths", ROWS, ids=[r[0] for r in ROWS])
@pytest.mark.parametrize("granularity", ["half", "block"])
def test_family_layers_agree_with_the_planner_row(family, preset, widths, granularity):
    """The family's layers are registered to it; attention/MLP layers have the split whose widths the planner
    reads from the config (tp 2 splits them, tp 3 is refused by both); heads, norms and embeddings have none."""
    fam = registry.get(family)
    facts = fam.facts
    model = build_model(preset, granularity=granularity, dropout=0.0)
    assert model.causal == facts.causal and model.pixels == facts.pixels
    heads, kv, mlp = widths
    want = {"attention heads": heads, "intermediate size": mlp, **({"key/value heads": kv} if kv else {})}
    cfg = config_summary(model)
    assert config_widths(family, cfg) == want
    for layer, spec in zip(model.layers, model.specs):
        owner = registry.of_layer(layer)  # the family itself, or the one whose layers it runs through
        assert owner is None or isinstance(fam, type(owner)), (spec.name, type(layer).__name__)
        split = registry.tp_split(layer)
        if spec.kind in ("attention", "mlp", "block"):
            assert owner is not None and split is not None, spec.name
            got = split_widths(layer)
            assert got == {k: v for k, v in want.items() if spec.kind == "block" or
                           (k == "intermediate size") == (spec.kind == "mlp")}, (spec.name, got)
            assert tp_plan(layer, 2) is not None
            with pytest.raises(PtplanError, match="tp=3 cannot split"):
                tp_plan(layer, 3)
        else:
            assert split is None and tp_plan(layer, 2) is None, spec.name
    assert "tp=3 does not divide" in (_refusal(family, cfg, 3) or "")


def _refusal(family: str, cfg: dict, tp: int) -> str | None:
    from ptplan.planner.tp_split import tp_refusal

    return tp_refusal(family, cfg, tp)


def _sliced(layers, ids, cuts, mask):
    """The layers run slice by slice, each attention layer given the earlier slices' keys and values."""
    kv: list[list] = [[] for _ in layers]
    outs, off = [], 0
    for s in cuts:
        x = ids[:, off:off + s]
        for i, layer in enumerate(layers):
            past = None
            if kv[i]:
                past = (torch.cat([k for k, _ in kv[i]], 2), torch.cat([v for _, v in kv[i]], 2))
            x, new = registry.slice_forward(layer, x, off, past, mask)
            assert (new is not None) == registry.is_attention(layer), type(layer).__name__
            if new is not None:
                kv[i].append(new)
        outs.append(x)
        off += s
    return torch.cat(outs, 1)


@pytest.mark.parametrize("family,preset,widths", ROWS, ids=[r[0] for r in ROWS])
def test_token_slices_where_the_planner_row_says(family, preset, widths):
    """A family with token slices gives, slice by slice, the whole sequence's logits (padding masked); the
    others refuse at their first layer with a PtplanError."""
    if not registry.get(family).facts.token_slices:
        model = build_model(preset, granularity="half")
        with pytest.raises(PtplanError, match="token slicing cannot run"):
            registry.slice_forward(model.layers[1], torch.zeros(2, 4, 64), 0, None, None)
        return
    model = build_model(preset, granularity="half", dropout=0.0, seq_len=12)
    ids, _, mask = model.make_batch(2, torch.Generator().manual_seed(0))
    mask[1, 9:] = 0
    with torch.no_grad():
        whole = model(ids, mask)
        got = _sliced(list(model.layers), ids, (5, 4, 3), mask)
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)


def test_token_slices_honour_a_sliding_window():
    """Mistral with a 4-token window: the sliced attention bands its mask as the whole model does (and the
    window changes the logits, so a slice that ignored it would fail here)."""
    from transformers import MistralForCausalLM

    def logits(window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = preset_config("mistral-tiny")
        cfg.sliding_window = window
        torch.manual_seed(0)
        hf = MistralForCausalLM(cfg).eval()
        layers, _ = _flatten("mistral", hf, "half")
        ids = torch.randint(1, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            x = ids
            for layer in layers:
                x = layer(x, attention_mask=mask)
            return x, _sliced(layers, ids, (5, 4, 3), mask)

    whole, sliced = logits(4)
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(whole, logits(None)[0], atol=1e-3)


@pytest.mark.parametrize("family,preset,widths", ROWS, ids=[r[0] for r in ROWS])
def test_family_file_facts(family, preset, widths):
    """What each family file declares is real: its transformers classes, dropout fields and head weights."""
    fam = registry.get(family)
    config_cls, model_cls = fam.classes()
    cfg = preset_config(preset)
    assert isinstance(cfg, config_cls) and cfg.model_type == family
    assert all(hasattr(cfg, f) for f in fam.dropout_fields), fam.dropout_fields
    assert {fam.facts.heads_key, fam.facts.mlp_key} <= set(cfg.to_dict()) | {None}
    with torch.device("meta"):
        names = {n for n, _ in model_cls(cfg).named_parameters(remove_duplicate=False)}
    assert fam.head_keys <= names, fam.head_keys - names
    assert preset in fam.presets and all(a not in fam.presets for a in fam.aliases)


def test_registry_refuses_unknown_and_refused_types():
    with pytest.raises(PtplanError, match="relative-position table"):
        registry.get("deberta-v2")
    with pytest.raises(PtplanError, match="no adapter for the model type 't5'"):
        registry.get("t5")
    assert registry.of_layer(NormLayer(torch.nn.LayerNorm(4))) is None
    assert registry.tp_twin(NormLayer(torch.nn.LayerNorm(4)), 2) == {}


def _hf_output(hf, x, mask):
    kw = {"pixel_values": x} if x.is_floating_point() else {"input_ids": x, "attention_mask": mask}
    return hf(**kw).logits


@pytest.mark.parametrize("family,preset,widths", ROWS, ids=[r[0] for r in ROWS])
def test_layers_compute_the_hugging_face_model_and_export_back(family, preset, widths):
    """The family's flat layers laid over a Hugging Face task model give its logits (padding masked), and the
    export mapping (``hf_model``: the layers over a fresh model, then ``Family.to_hf``) turns the adapter's
    weights back into a Hugging Face model with the adapter's outputs."""
    fam = registry.get(family)
    config_cls, model_cls = fam.classes()
    cfg = preset_config(preset)
    for f in fam.dropout_fields:
        setattr(cfg, f, 0.0)
    torch.manual_seed(0)
    hf = model_cls(cfg).eval()
    layers, _ = _flatten(family, hf, "half")
    model = build_model(preset, dropout=0.0, seed=3)
    x, _, mask = model.make_batch(2, torch.Generator().manual_seed(0))
    if mask is not None:
        mask[1, -3:] = 0
    with torch.no_grad():
        y = x
        for layer in layers:
            y = layer(y, attention_mask=mask)
        torch.testing.assert_close(y, _hf_output(hf, x, mask), rtol=1e-5, atol=1e-5)
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():  # as training leaves them: the head no longer equals the embedding
            p.add_(0.01 * torch.randn(p.shape, generator=g))
        exported = hf_model(model, {n: p.detach() for n, p in model.named_parameters()})
        torch.testing.assert_close(_hf_output(exported, x, mask), model(x, mask), rtol=1e-5, atol=1e-5)
