"""Megatron's sequence parallelism in the runtime (issue 22 item 2): with ``Phase.sp`` the split layers' norms and
residual stream run on sequence shards (``executor/runtime/hybrid.py``: the norms' output all-gathered, the
row-parallel outputs reduce-scattered, the whole sequence gathered where a run of split layers ends).

Two gloo processes train tiny GPT-2 and tiny Llama through tp2·sp (K=1) -> a plain 2-stage pipeline -> tp2·sp with
recomputation and a split frozen prefix (K=1), equal to the single-process reference of
``tests/test_runtime_parity.py`` with SGD and AdamW; each rank's norms see S/tp tokens and the activations a split
layer saves for its backward shrink as ``planner/strategy.py`` prices them (all of them / tp with sp, only
Megatron's split part without); families without sp are refused at plan load and at run time.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import tests.test_runtime_parity as trp
from parity import assert_parity
from ptplan.executor.handplan import spec
from ptplan.executor.training.runlog import read_records
from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import plan_from_json
from tests.test_hybrid_runtime import _mixed_plan
from tests.test_tp_families import _builder, _run

CHUNKS = {0: 2, 1: 2, 2: 2}
"""Micro-batches per global batch of 8 in each phase (D*M)."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def with_sp(plan, flags):
    """``plan`` with phase i's ``sp`` = ``flags[i]``, validated as a loaded plan is."""
    phases = tuple(dataclasses.replace(ph, sp=s) for ph, s in zip(plan.phases, flags))
    plan = dataclasses.replace(plan, phases=phases)
    return plan_from_json(json.loads(json.dumps(plan.to_json())), source="test plan")


def sp_plan(model):
    """tp2·sp (K=1, M=2) -> plain K=2 pipeline -> tp2·sp·rc (K=1) with 2 frozen blocks run as split twins."""
    plan = _mixed_plan(model, [spec(0, K=1, D=1, M=2, b=4, schedule="1f1b"),
                               spec(1, K=2, D=1, M=2, b=4, schedule="1f1b"),
                               spec(2, K=1, D=1, M=2, b=4, schedule="1f1b")],
                       [(2, False, False), (1, False, False), (2, False, True)])
    return with_sp(plan, [True, False, True])


@pytest.mark.multiproc
@pytest.mark.parametrize("name,granularity,optimizer", [("gpt2-tiny", "half", "sgd"), ("gpt2-tiny", "block", "adamw"),
                                                        ("llama-tiny", "half", "adamw"), ("llama-tiny", "block", "sgd")])
def test_sequence_parallel_matches_reference(name, granularity, optimizer, tmp_path, monkeypatch):
    """tp2·sp -> K=2 -> tp2·sp·rc on 2 processes: weights after every transition and at the end within the
    parity tolerance of the single-process reference, every step's loss within 1e-5."""
    build = _builder(name, granularity)
    model = build()  # the ranks train forked copies; this one stays as built
    plan = sp_plan(model)
    assert [ph.strategy_label for ph in plan.phases] == ["tp2·sp", "dp", "tp2·sp·rc"]
    data, snaps, log, sharded = _run(model, optimizer, plan, str(tmp_path), 2)
    # under sp every parameter of a split layer trains as a DTensor: its norms' too (replicated)
    split = sum(len(list(layer.parameters())) for layer, s in zip(model.layers, model.specs)
                if s.kind in ("attention", "mlp", "block"))
    for r in range(2):  # the sp phases train split parameters (fewer local elements than full), the K=2 one none
        for step, n, loc, full in sharded[r]:
            sp = plan.phases[trp.COUNTS[step - 1]].sp
            assert (n > 0 and loc < full) if sp else n == 0, (r, step, n, loc, full)
            assert step > 2 or n == split, (r, step, n, split)
    monkeypatch.setattr(trp, "_build", lambda _: build())  # the reference builds the same model
    ref, ref_losses = trp.reference(model.name, optimizer, data, chunks=CHUNKS)
    assert sorted(snaps) == [0, 2, 4, 6], sorted(snaps)
    worst = assert_parity(snaps, ref, (2, 4, 6), trp.TOL[optimizer])
    print(f"parity tp2·sp -> K2 -> tp2·sp·rc {name} {granularity} {optimizer}: max relative difference {worst:.1e}")
    steps = [r["loss"] for r in read_records(log) if r["type"] == "step"]
    assert steps == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sequence_parallel_with_fsdp_matches_reference(optimizer, tmp_path, monkeypatch):
    """llama-tiny on 4 processes: tp2·sp·fsdp on a D x tp = 2 x 2 mesh (FSDP2 reduces the norms' partial gradients
    over tp itself) -> tp2·sp in a 2-stage pipeline (K=2, D=1: the sequence gathered at the stage boundary) ->
    tp2·sp·fsdp·rc with the split and sharded frozen prefix: equal to the reference."""
    build = _builder("llama-tiny", "half")
    model = build()
    plan = _mixed_plan(model, [spec(0, K=1, D=2, M=2, b=2, schedule="1f1b"),
                                 spec(1, K=2, D=1, M=4, b=2, schedule="1f1b"),
                                 spec(2, K=1, D=2, M=2, b=2, schedule="1f1b")],
                       [(2, True, False), (2, False, False), (2, True, True)])
    plan = with_sp(plan, [True, True, True])
    assert [ph.strategy_label for ph in plan.phases] == ["tp2·sp·fsdp", "tp2·sp", "tp2·sp·fsdp·rc"]
    data, snaps, log, _ = _run(model, optimizer, plan, str(tmp_path), 4)
    monkeypatch.setattr(trp, "_build", lambda _: build())
    ref, ref_losses = trp.reference(model.name, optimizer, data, chunks={0: 4, 1: 4, 2: 4})
    worst = assert_parity(snaps, ref, (2, 4, 6), trp.TOL[optimizer])
    print(f"parity tp2·sp·fsdp -> tp2·sp K2 -> tp2·sp·fsdp·rc llama-tiny half {optimizer}, 4 processes: {worst:.1e}")
    assert [r["loss"] for r in read_records(log) if r["type"] == "step"] == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("schedule,V", [("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_sequence_parallel_with_split_backward_and_chunks_matches_reference(schedule, V, tmp_path, monkeypatch):
    """gpt2-tiny tp2·sp in a 2-stage pipeline on 4 processes (three phases, the last recomputing) with ZB-H1 (the
    weight gradients, the norms' partial ones included, in their own pass) and interleaved 1F1B (2 chunks per rank:
    the sequence gathered at each chunk's end): equal to the reference with SGD."""
    build = _builder("gpt2-tiny", "half")
    model = build()
    plan = _mixed_plan(model, [spec(f, K=2, D=1, M=4, b=2, schedule=schedule, V=V) for f in range(3)],
                       [(2, False, False), (2, False, False), (2, False, True)])
    plan = with_sp(plan, [True, True, True])
    data, snaps, _, _ = _run(model, "sgd", plan, str(tmp_path), 4)
    monkeypatch.setattr(trp, "_build", lambda _: build())
    ref, _ = trp.reference(model.name, "sgd", data, chunks={0: 4, 1: 4, 2: 4})
    worst = assert_parity(snaps, ref, (2, 4, 6), trp.TOL["sgd"])
    print(f"parity tp2·sp K=2 {schedule} gpt2-tiny half sgd, 4 processes: {worst:.1e}")


def test_sp_refused_for_families_without_it():
    """A plan asking sp of a post-LN family (BERT) is refused at load with the reason; so is sp without tp and a
    sequence length tp does not divide; ``tp_plan`` refuses it at run time too."""
    from ptplan.executor.families.models import build_model
    from ptplan.executor.runtime.hybrid import tp_plan
    from ptplan.planner.tp_split import sp_refusal

    bert = build_model("bert-tiny", granularity="half", dropout=0.0, seed=0, seq_len=8)
    plan = _mixed_plan(bert, [spec(0, K=1, D=1, M=2, b=4, schedule="1f1b")], [(2, False, False)])
    with pytest.raises(PtplanError, match=r"sp'.*only for the pre-LN families gpt2, llama, mistral, qwen2.*not a "
                                          r"bert model"):
        with_sp(plan, [True])
    assert "needs tp > 1" in sp_refusal("gpt2", 8, 1)
    assert "not a multiple of 4" in sp_refusal("gpt2", 10, 4)
    assert sp_refusal("llama", 8, 2) is None and sp_refusal("vit", 197, 2) is not None
    layer = next(layer for layer, s in zip(bert.layers, bert.specs) if s.kind == "attention")
    assert tp_plan(layer, 2) is not None
    with pytest.raises(PtplanError, match="sequence parallelism cannot run a BertAttentionHalf"):
        tp_plan(layer, 2, sp=True)


def test_every_sp_family_names_its_norms():
    """The families ``FamilyFacts.sequence_parallel`` marks (GPT-2, Llama, Mistral, Qwen2) name every split layer's
    pre-LN norms, which exist in the layer; the others name none (the planner never offers them sp)."""
    from ptplan.executor.families import registry
    from ptplan.planner.families import SP_FAMILIES

    for fam_name, fam in registry.families().items():
        for cls, split in fam.tp_splits.items():
            assert bool(split.norms) == (fam_name in SP_FAMILIES), (fam_name, cls.__name__)
    for name in ("gpt2-tiny", "llama-tiny", "mistral-tiny", "qwen2-tiny"):
        for g in ("half", "block"):
            model = _builder(name, g)()
            for layer in model.layers:
                split = registry.tp_split(layer)
                for path in split.norms if split else ():
                    assert "norm" in type(layer.get_submodule(path)).__name__.lower(), (name, path)


SAVED_S, SAVED_B = 16, 2
"""Tokens and samples of the activation measurement (16 tokens: 8 per tp rank)."""


def _saved_bytes(layer, x) -> tuple[int, list[int]]:
    """(bytes this rank's autograd keeps for ``layer``'s backward on input ``x`` -- each saved tensor's local storage
    once, the parameters left out --, the local sequence length each of its norms saw)."""
    from torch.distributed.tensor import DTensor

    from ptplan.executor.families.registry import tp_split

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    params = {local(p).untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}
    lens: list[int] = []

    def pack(t):
        st = local(t).untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    hooks = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a: lens.append(local(a[0]).shape[1]))
             for n in tp_split(layer).norms]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    for h in hooks:
        h.remove()
    y.sum().backward()  # the layer's backward runs (collectives included) on every rank alike
    return sum(seen.values()), lens


def _measure_saved(rank: int, world: int, out: str) -> None:
    """Per family and half: the saved bytes and norm input lengths of the whole layer (one process's view) and of
    its tp2 and tp2·sp twins on this rank."""
    import copy

    from ptplan.executor.families.models import build_model
    from ptplan.executor.families.registry import tp_twin
    from ptplan.executor.runtime.hybrid import _parallelize, _sequence_bounds
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("tp",))
    res = {}
    for name in ("gpt2-tiny", "llama-tiny"):
        model = build_model(name, granularity="half", dropout=0.0, seed=0, seq_len=SAVED_S)
        x = torch.randn(SAVED_B, SAVED_S, model.config.to_dict().get("n_embd") or model.config.hidden_size,
                        generator=torch.Generator().manual_seed(1))
        for layer, spec_ in zip(model.layers, model.specs):
            if spec_.kind not in ("attention", "mlp") or spec_.block != 0:
                continue
            row = {"whole": _saved_bytes(layer, x.clone().requires_grad_(True))}
            for sp in (False, True):
                twin = copy.deepcopy(layer)
                tp_twin(twin, world)
                _parallelize(twin, mesh, sp)
                if sp:
                    _sequence_bounds({0: twin}, [0], mesh)
                row["tp2·sp" if sp else "tp2"] = _saved_bytes(twin, x.clone().requires_grad_(True))
            res[f"{name} {spec_.kind}"] = row
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(res, fh)


@pytest.mark.multiproc
def test_each_rank_saves_a_sequence_shard_of_activations(tmp_path):
    """On each of 2 ranks, a split attention or MLP half's norm sees S/tp tokens under sp (S without it), and the
    share of the whole layer's saved-for-backward bytes each rank keeps is the stage model's
    (``strategy.saved_share``: Megatron's unsplit part whole with tp alone; only the gathered linear input whole
    with sp) within 0.1, and smaller with sp than without."""
    from ptplan.executor.launch.local import run_world
    from ptplan.planner.strategy import saved_share

    out = str(tmp_path / "saved.json")
    res = run_world(2, _measure_saved, (out,), tmpdir=str(tmp_path), deadline_s=120)
    assert res.ok, res.explain()
    got = json.load(open(out))
    assert len(got) == 4, got
    heads, hidden = 4, 64  # both tiny presets
    for what, row in got.items():
        (whole, lw), (tp, lt), (sp, ls) = row["whole"], row["tp2"], row["tp2·sp"]
        kind = what.split()[-1]
        want_tp, want_sp = (saved_share(kind, 2, s, 5.0 * heads * SAVED_S / hidden) for s in (False, True))
        print(f"{what}: saved bytes per rank whole {whole}, tp2 {tp} ({tp / whole:.2f}, model {want_tp:.2f}), "
              f"tp2·sp {sp} ({sp / whole:.2f}, model {want_sp:.2f}); norm input tokens {lw} / {lt} / {ls}")
        assert lw == lt == [SAVED_S] and ls == [SAVED_S // 2], (what, lw, lt, ls)
        assert sp < tp < whole, (what, whole, tp, sp)
        assert abs(tp / whole - want_tp) <= 0.1 and abs(sp / whole - want_sp) <= 0.1, (what, whole, tp, sp)


@pytest.mark.slow
@pytest.mark.multiproc
def test_ptplan_run_trains_a_plan_with_sp(tmp_path):
    """``ptplan run`` (its checks, torchrun, 2 worker processes) trains a tp2·sp plan of tiny GPT-2: every step
    logged with a finite loss, the phase's strategy label in the log's plan."""
    import math
    import subprocess
    import sys

    from ptplan.planner.plan import save_plan

    model = _builder("gpt2-tiny", "half")()
    plan = with_sp(_mixed_plan(model, [spec(0, K=1, D=1, M=2, b=4, schedule="1f1b")], [(2, False, False)]), [True])
    save_plan(plan, tmp_path / "sp.json")
    log = tmp_path / "run.jsonl"
    r = subprocess.run([sys.executable, "-m", "ptplan.cli.main", "run", str(tmp_path / "sp.json"), "--model",
                        "gpt2-tiny", "--nproc-per-node", "2", "--epochs", "1", "--steps-per-epoch", "3",
                        "--optimizer", "sgd", "--lr", "0.01", "--log", str(log)],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [x for x in read_records(str(log)) if x["type"] == "step"]
    assert len(steps) == 3 and all(math.isfinite(x["loss"]) for x in steps), steps
