"""Tensor parallelism for every family (issue 14): ViT, DistilBERT, Llama, Mistral (with a sliding window)
and Qwen2 layers split Megatron-style (``executor/runtime/hybrid.py``: q/k/v column-wise by heads -- by key/value
heads with grouped-query attention --, the attention output row-wise; the MLP's first linear(s) column-wise,
its second row-wise) train equal to the single-process reference of ``tests/test_runtime_parity.py``
through phase transitions that enter, leave and re-enter tp; one 8-process run on a K x D x tp = 2 x 2 x 2
mesh with FSDP; and tp that does not divide the heads, key/value heads or MLP width refused with the
numbers and the fix by ``ptplan run`` and never chosen by ``ptplan plan --strategies auto``.
"""
from __future__ import annotations

import json
import math
import os

import pytest

import tests.test_runtime_parity as trp
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import spec
from parity import assert_parity
from tests.test_hybrid_runtime import _mixed_plan, _optimizer_params

OPT, SEED, SEQ, TOL = trp.OPT, trp.SEED, trp.SEQ, trp.TOL
COUNTS = trp.COUNTS  # frozen blocks 0, 0, 1, 1, 2, 2: a transition every 2 steps
WINDOW = 4
"""Mistral's sliding window in these runs: shorter than the SEQ=8 tokens, so the banded mask matters."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """A tiny Mistral (llama-tiny's sizes: 4 query heads sharing 2 key/value heads) with a sliding window of
    4 tokens, as a local model folder (the preset has none)."""
    from ptplan.executor.families.models import preset_config

    d = tmp_path_factory.mktemp("mistral") / "mistral-window"
    d.mkdir()
    cfg = preset_config("mistral-tiny").to_dict()
    cfg.update(sliding_window=WINDOW, architectures=["MistralForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _builder(name: str, granularity: str):
    def build():
        kw = {} if name.startswith("vit") else {"seq_len": SEQ}
        return build_model(name, granularity=granularity, dropout=0.0, seed=SEED, **kw)
    return build


def _run(model, optimizer: str, plan, tmp: str, world: int):
    """The elastic run of ``tests/test_hybrid_runtime.py`` on ``world`` processes (each trains a forked copy of
    ``model``): rank 0's snapshots after every transition, per rank what its optimizer holds sharded after each
    step, and the run log."""
    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.data.dataset import TensorDataset
    from parity import recorded_run

    data = trp._data(model)
    o = OPT[optimizer]
    cfg = RunConfig(plan="(test)", model=model.name, optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                    weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=SEED,
                    freeze_every=trp.STEPS_PER_PHASE, steps_per_epoch=len(COUNTS), epochs=1, progress=False,
                    timeout_s=60, log=os.path.join(tmp, "run.jsonl"))

    snaps, sharded = recorded_run(cfg, plan, model, TensorDataset(*data), world=world, tmpdir=tmp, deadline_s=240,
                                  record=lambda step, r: [step, *_optimizer_params(r)])
    return data, snaps, cfg.log, sharded


def _check(build, model, optimizer, plan, chunks, tmp_path, monkeypatch, label, world=4) -> float:
    """Run ``plan`` (``model``: ``build()`` as built) and compare with the single-process reference after every transition and at the end
    (weights within ``TOL``, every step's loss within 1e-5); the tp and FSDP phases must train sharded
    parameters (fewer local elements than full), the others none."""
    data, snaps, log, sharded = _run(model, optimizer, plan, str(tmp_path), world)
    for r in range(world):
        assert [s[0] for s in sharded[r]] == list(range(1, len(COUNTS) + 1))
        for step, n, loc, full in sharded[r]:
            ph = plan.phases[COUNTS[step - 1]]
            if ph.tp > 1 or ph.fsdp and ph.D > 1:
                assert n > 0 and loc < full, (r, step, n, loc, full)
            else:
                assert n == 0, (r, step, n)
    monkeypatch.setattr(trp, "_build", lambda name: build())  # the reference builds the same model
    ref, ref_losses = trp.reference(model.name, optimizer, data, chunks=chunks)
    assert sorted(snaps) == [0, 2, 4, 6], sorted(snaps)
    worst = assert_parity(snaps, ref, (2, 4, 6), TOL[optimizer])
    print(f"parity {label}: max relative difference {worst:.1e}")
    steps = [r for r in read_records(log) if r["type"] == "step"]
    assert len(steps) == len(ref_losses)
    for r, want in zip(steps, ref_losses):
        assert math.isclose(r["loss"], want, rel_tol=1e-5), (r["step"], r["loss"], want)
    trans = [r for r in read_records(log) if r["type"] == "transition"]
    assert trans[0]["bytes"]["optimizer_state"] > 0, trans  # state moved, not reset
    return worst


def _tp_back_plan(model, schedule: str):
    """tp2 in a 2-stage pipeline (K=2, D=1, tp=2), then FSDP without tp (K=2, D=2: every layer leaves its tp
    copy and its tp group), then tp2 with recomputation again on another shape (K=1, D=2, tp=2); 4 ranks,
    4 micro-batches per global batch of 8 in every phase."""
    return _mixed_plan(model, [spec(0, K=2, D=1, M=4, b=2, schedule=schedule),
                               spec(1, K=2, D=2, M=2, b=2, schedule=schedule),
                               spec(2, K=1, D=2, M=2, b=2, schedule=schedule)],
                       [(2, False, False), (1, True, False), (2, False, True)])


TP_BACK_CHUNKS = {0: 4, 1: 4, 2: 4}

CASES = [("vit-tiny", "half", "1f1b", "sgd"), ("vit-tiny", "block", "gpipe", "adamw"),
         ("distilbert-tiny", "block", "gpipe", "sgd"), ("distilbert-tiny", "half", "1f1b", "adamw"),
         ("llama-tiny", "half", "1f1b", "sgd"), ("llama-tiny", "block", "gpipe", "adamw"),
         ("mistral-window", "block", "gpipe", "sgd"), ("mistral-window", "half", "1f1b", "adamw"),
         ("qwen2-tiny", "block", "1f1b", "sgd"), ("qwen2-tiny", "half", "gpipe", "adamw"),
         ("roberta-tiny", "block", "1f1b", "adamw")]
"""Each newly split family with SGD and AdamW, one run at each granularity (halves and whole blocks), GPipe
and 1F1B; Mistral with a 4-token sliding window (``mistral_dir``); RoBERTa (BERT's layers, split before but
refused by the check) once."""


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name,granularity,schedule,optimizer", CASES)
def test_tensor_parallel_in_and_out_matches_reference(name, granularity, schedule, optimizer, tmp_path, monkeypatch,
                                                      request):
    """tp2 (K=2) -> FSDP (K=2, D=2) -> tp2 with recomputation (K=1, D=2) on 4 processes: equal to the
    single-process reference; the split layers' weights and optimizer state map back at each transition."""
    build = _builder(request.getfixturevalue("mistral_dir") if name == "mistral-window" else name, granularity)
    model = build()
    if name == "mistral-window":  # every attention masks a band of WINDOW tokens
        halves = [getattr(layer, "attn", layer) for layer, s in zip(model.layers, model.specs) if s.kind != "mlp"]
        assert {getattr(h, "window", None) for h in halves} == {None, WINDOW}
    plan = _tp_back_plan(model, schedule)
    _check(build, model, optimizer, plan, TP_BACK_CHUNKS, tmp_path, monkeypatch,
           f"tp2 -> fsdp -> tp2-rc {name} {granularity} {schedule} {optimizer}")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_tensor_parallel_with_fsdp_on_eight_processes_matches_reference(optimizer, tmp_path, monkeypatch):
    """llama-tiny (grouped-query attention: each tp rank 2 query heads and the 1 key/value head they read)
    on 8 processes: tp2 x FSDP on a K x D x tp = 2 x 2 x 2 mesh, then data parallel (K=2, D=4), then tp2 x
    FSDP with recomputation (K=1, D=4, tp=2): equal to the reference. (AdamW's worst, 5.9e-05, is an element of
    the embedding, FSDP-sharded but not tp-split, whose step-2 gradient is a near-cancellation of -8.8e-07,
    about eps = 1e-6: there AdamW turns the summation order's rounding into 5e-06 of weight; SGD: 2.0e-07.)"""
    build = _builder("llama-tiny", "half")
    model = build()
    plan = _mixed_plan(model, [spec(0, K=2, D=2, M=2, b=2, schedule="1f1b"),
                                 spec(1, K=2, D=4, M=2, b=1, schedule="1f1b"),
                                 spec(2, K=1, D=4, M=2, b=1, schedule="1f1b")],
                       [(2, True, False), (1, False, False), (2, True, True)])
    assert [ph.K * ph.D * ph.tp for ph in plan.phases] == [8, 8, 8]
    _check(build, model, optimizer, plan, {0: 4, 1: 8, 2: 8}, tmp_path, monkeypatch,
           f"tp2·fsdp (2x2x2) -> dp (2x4) -> tp2·fsdp·rc (1x4x2) llama-tiny 1f1b {optimizer}, 8 processes", world=8)


# ---- what cannot be split is refused, with the numbers and the fix ----------------------------------------

@pytest.mark.parametrize("name", ["bert-tiny", "roberta-tiny", "distilbert-tiny", "vit-tiny", "gpt2-tiny",
                                  "llama-tiny", "mistral-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("granularity", ["half", "block"])
def test_every_family_splits_its_attention_and_mlp(name, granularity):
    """Every attention and MLP half (or block) of every family has a split whose paths exist: q/k/v and the
    MLP's first linear(s) column-wise, the attention output and the MLP's second linear row-wise; embeddings,
    norms and heads none. The widths read from the layers equal those read from the config (the check)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ptplan.executor.runtime.hybrid import split_widths, tp_plan
    from ptplan.planner.tp_split import split_widths as config_widths

    model = _builder(name, granularity)()
    for layer, s in zip(model.layers, model.specs):
        plan = tp_plan(layer, 2)
        if s.kind not in ("attention", "mlp", "block"):
            assert plan is None, s.name
            continue
        assert plan is not None, s.name
        for path in plan:
            layer.get_submodule(path)
        cols = [p for p, st in plan.items() if isinstance(st, ColwiseParallel)]
        rows = [p for p, st in plan.items() if isinstance(st, RowwiseParallel)]
        want_rows = {"attention": 1, "mlp": 1, "block": 2}[s.kind]
        gated = model.family in ("llama", "mistral", "qwen2")
        want_cols = {"attention": 1 if name == "gpt2-tiny" else 3, "mlp": 2 if gated else 1}
        want_cols["block"] = want_cols["attention"] + want_cols["mlp"]
        assert (len(cols), len(rows)) == (want_cols[s.kind], want_rows), (s.name, plan)
        widths = split_widths(layer)
        want = config_widths(model.family, model.config.to_dict())
        mlp = {"intermediate size"}
        keep = {"attention": set(want) - mlp, "mlp": mlp, "block": set(want)}[s.kind]
        assert widths == {k: v for k, v in want.items() if k in keep}, (s.name, widths, want)


def test_tp_that_does_not_divide_the_key_value_heads_is_refused():
    """llama-tiny has 4 query heads and 2 key/value heads: tp2 runs, tp4 is refused before launch
    (``check_plan``) and by the split itself, naming the numbers and the fix."""
    from ptplan.executor.runtime.hybrid import tp_plan
    from ptplan.executor.training.validate import check_plan
    from ptplan.planner.errors import PtplanError

    build = _builder("llama-tiny", "half")
    model = build()
    ok = _mixed_plan(model, [spec(0, K=2, D=1, M=4, b=2), spec(1, K=1, D=2, M=2, b=2)], [(2, False, False)] * 2)
    check_plan(ok, model, 4)
    bad = _mixed_plan(model, [spec(0, K=1, D=1, M=4, b=2), spec(1, K=1, D=1, M=4, b=2)], [(4, False, False)] * 2)
    with pytest.raises(PtplanError, match=r"plan phase 0 \(0 frozen blocks, tp4\): tensor parallelism tp=4 does not "
                                          r"divide this llama model's 2 key/value heads \(grouped-query attention.*"
                                          r"attention heads 4, key/value heads 2, intermediate size 128\); tp must "
                                          r"be one of 2; make the plan with `ptplan plan --strategies off`"):
        check_plan(bad, model, 4)
    with pytest.raises(PtplanError, match=r"tp=4 cannot split a LlamaAttentionHalf: it does not divide its 2 "
                                          r"key/value heads"):
        tp_plan(model.layers[1], 4)
    with pytest.raises(PtplanError, match=r"tp=3 cannot split a LlamaMLPHalf: it does not divide its 128 "
                                          r"intermediate size"):
        tp_plan(model.layers[2], 3)


def test_config_widths_refuse_what_does_not_divide():
    """``planner.tp_split`` (pure, from a profile's config): every family's widths, and the refusals."""
    from ptplan.planner.tp_split import split_widths, tp_refusal

    assert split_widths("gpt2", {"n_head": 12, "n_embd": 768, "n_inner": None}) == \
        {"attention heads": 12, "intermediate size": 3072}
    assert split_widths("llama", {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}) \
        == {"attention heads": 32, "key/value heads": 8, "intermediate size": 14336}
    assert split_widths("distilbert", {"n_heads": 12, "hidden_dim": 3072}) == \
        {"attention heads": 12, "intermediate size": 3072}
    assert split_widths("custom", {"num_attention_heads": 4}) == {} and split_widths("bert", {}) == {}
    qwen = {"num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864}  # qwen2.5-0.5b
    assert tp_refusal("qwen2", qwen, 2) is None
    assert "does not divide this qwen2 model's 14 attention heads and 2 key/value heads (each tp rank holds whole " \
        "heads; grouped-query attention" in tp_refusal("qwen2", qwen, 4)
    assert tp_refusal("vit", {"num_attention_heads": 12, "intermediate_size": 3072}, 8) == (
        "tensor parallelism tp=8 does not divide this vit model's 12 attention heads (each tp rank holds whole "
        "heads; attention heads 12, intermediate size 3072); tp must be one of 2, 4")
    assert tp_refusal("bert", {}, 8) is None  # a config without the sizes: the split itself checks


def test_the_search_plans_only_tp_that_splits_the_key_value_heads(tmp_path):
    """``ptplan plan --strategies auto`` on 8-GPU nodes for a memory-bound decoder (it needs tp or FSDP):
    with 32 query heads sharing 8 key/value heads the search uses tp up to 8; the same profile as a model
    with 2 key/value heads only tp <= 2 (tp4 and tp8 would not split them; ``ptplan run`` refuses them)."""
    import dataclasses

    from click.testing import CliRunner

    from ptplan.cli.main import cli
    from ptplan.planner.plan import load_plan
    from ptplan.planner.profile import save_profile
    from ptplan.planner.synthetic import synthetic_profile

    prof = synthetic_profile(num_blocks=2, hidden=32768, seq_len=1024, vocab=32000, batch_sizes=(1, 2, 4))
    widest = {}
    for kv in (8, 2):
        config = dict(prof.model.config, num_attention_heads=32, num_key_value_heads=kv, intermediate_size=4 * 32768)
        p = dataclasses.replace(prof, model=dataclasses.replace(prof.model, family="llama", config=config))
        save_profile(p, tmp_path / f"kv{kv}.json")
        out = CliRunner().invoke(cli, ["plan", str(tmp_path / f"kv{kv}.json"), "--cluster", "h100-4node", "--batch",
                                       "32", "--samples-per-epoch", "1024", "--epochs", "2", "--allow-extrapolation",
                                       "--strategies", "auto", "--out", str(tmp_path / f"kv{kv}-plan.json")])
        assert out.exit_code == 0, out.output
        widest[kv] = max(ph.tp for ph in load_plan(tmp_path / f"kv{kv}-plan.json").phases)
    print(f"widest tp planned: 8 key/value heads tp{widest[8]}, 2 key/value heads tp{widest[2]}")
    assert widest[8] >= 4 and widest[2] == 2, widest


def test_ptplan_run_refuses_tp_that_does_not_divide_the_key_value_heads(tmp_path):
    """The launcher's check (``ptplan run --dry-run``, exit 2): a tp4 plan of llama-tiny (2 key/value heads)
    is refused with the numbers and the fix before any process starts."""
    from click.testing import CliRunner

    from ptplan.cli.main import cli
    from ptplan.planner.plan import save_plan

    model = _builder("llama-tiny", "half")()
    bad = _mixed_plan(model, [spec(0, K=1, D=1, M=4, b=2), spec(1, K=1, D=1, M=4, b=2)], [(4, False, False)] * 2)
    save_plan(bad, tmp_path / "tp4.json")
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "tp4.json"), "--model", "llama-tiny", "--nproc-per-node", "4",
                                 "--dry-run"])
    assert r.exit_code == 2, r.output
    assert "tensor parallelism tp=4 does not divide this llama model's 2 key/value heads" in r.output
    assert "tp must be one of 2; make the plan with `ptplan plan --strategies off`" in " ".join(r.output.split())
