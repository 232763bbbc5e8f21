"""Each rank builds only its own stage (issue 10): ``build_model(..., layers=...)`` gives storage to those layers
alone, with the values the whole model has there, and a run whose ranks build only their stages holds only its
stages at every step and trains exactly as the single-process reference.

Single process: every family's stage builds equal the whole build (initialised, and loaded from the MiniLM's
safetensors and from a pytorch_model.bin, reading only the stage's tensors). Multi-process (4 forked gloo
ranks): each rank builds ``stage_layers(plan, 0, rank)`` itself, right after which its materialised parameter
bytes are its stage's (a quarter of bert-tiny's, not the whole); then K=4,D=1 -> K=2,D=2 (AutoCache) -> K=1,D=4
leaves storage only on the layers each phase gives the rank, and the weights equal ``test_runtime_parity``'s
reference; a resume builds the checkpoint's phase's stages and reads the checkpoint per rank, or gets it from
the one rank whose folder holds it.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ptplan.executor.families import models
from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from parity import assert_parity, once
from ptplan.executor.cache.run import host_need
from ptplan.executor.training.loop import Hooks, run_training, stage_layers, start_phase
from ptplan.executor.runtime.transition import holdings
from tests.test_runtime_parity import COUNTS, LAYOUTS, OPT, SEED, STEPS_PER_PHASE, TOL, _data, reference

TINY = ("bert-tiny", "vit-tiny", "gpt2-tiny", "llama-tiny", "roberta-tiny", "distilbert-tiny", "mistral-tiny",
        "qwen2-tiny")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _kw(name: str) -> dict:
    return dict(granularity="half", dropout=0.0, seed=SEED, **({} if name.startswith("vit") else {"seq_len": 8}))


def _built(model) -> dict[int, int]:
    """{layer: bytes of parameter storage} of the layers with any (none on the meta device, none empty)."""
    out = {}
    for i, layer in enumerate(model.layers):
        ps = list(layer.parameters())
        real = [p for p in ps if p.device.type != "meta" and p.numel() > 0]
        assert len(real) in (0, len(ps)), (i, "a layer is built whole or not at all")
        if real:
            out[i] = sum(p.numel() * p.element_size() for p in real)
    return out


def _assert_stage_equals_whole(whole, part, want) -> None:
    assert sorted(_built(part)) == sorted(want)
    for i, (a, b) in enumerate(zip(whole.layers, part.layers)):
        for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            if i in want:
                assert torch.equal(pa, pb), (i, n)
            else:
                assert pb.device.type == "meta" and pb.shape == pa.shape and pb.dtype == pa.dtype, (i, n)
    for (n, ba), (_, bb) in zip(whole.named_buffers(), part.named_buffers()):  # buffers are always real
        assert bb.device.type == "cpu" and torch.equal(ba, bb), n


# ---- one process ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY)
def test_a_stage_build_holds_the_whole_builds_values_for_its_layers_only(name):
    whole = build_model(name, **_kw(name))
    n = len(whole.layers)
    assert sorted(_built(whole)) == list(range(n))
    for want in ([0], [1, 2], [3, 4, 5, 6], [n - 2, n - 1], [0, n - 1]):
        _assert_stage_equals_whole(whole, build_model(name, **_kw(name), layers=want), want)
    with pytest.raises(models.PtplanError, match="outside the model's"):
        build_model(name, **_kw(name), layers=[n])


def test_copied_heads_start_as_the_embedding_even_when_it_is_built_elsewhere():
    for name, emb, head in (("gpt2-tiny", "wte.weight", "weight"), ("qwen2-tiny", "embed_tokens.weight",
                                                                     "lm_head.weight")):
        whole = build_model(name, **_kw(name))
        alone = build_model(name, **_kw(name), layers=[len(whole.layers) - 1])
        ref = dict(whole.layers[0].named_parameters())[emb]
        assert torch.equal(dict(alone.layers[-1].named_parameters())[head], ref)
        assert torch.equal(dict(whole.layers[-1].named_parameters())[head], ref)


def _reads(monkeypatch) -> list[str]:
    """The weight-file keys the build reads, in order (``_WeightFiles.get`` wrapped, the files really read)."""
    seen: list[str] = []
    get = models._WeightFiles.get

    def counting(self, key):
        seen.append(key)
        return get(self, key)

    monkeypatch.setattr(models._WeightFiles, "get", counting)
    return seen


def test_a_stage_loads_only_its_tensors_of_the_minilm(minilm_dir, monkeypatch):
    """The MiniLM (6 blocks, safetensors, keys without the ``bert.`` prefix): a stage of blocks 2-3 equals the
    whole load on its layers and reads exactly its 32 tensors of the file's 104; the classifier head (not in a
    sentence-embedding checkpoint) is initialised from the seed, equal in both builds."""
    whole = build_model("bert-base", weights=minilm_dir, seq_len=16, dropout=0.0)
    seen = _reads(monkeypatch)
    stage = list(range(5, 9))  # block2.attn, block2.mlp, block3.attn, block3.mlp
    part = build_model("bert-base", weights=minilm_dir, seq_len=16, dropout=0.0, layers=stage)
    _assert_stage_equals_whole(whole, part, stage)
    assert sorted(seen) == sorted({k for k in seen if k.startswith(("encoder.layer.2.", "encoder.layer.3."))})
    assert len(seen) == 32 and len(set(seen)) == 32
    seen.clear()
    n = len(whole.layers)
    head = build_model("bert-base", weights=minilm_dir, seq_len=16, dropout=0.0, layers=[n - 2, n - 1])
    _assert_stage_equals_whole(whole, head, [n - 2, n - 1])
    assert sorted(seen) == ["pooler.dense.bias", "pooler.dense.weight"]  # the classifier: from the seed


def test_a_stage_loads_from_pytorch_model_bin(minilm_dir, tmp_path):
    """The same weights as a ``pytorch_model.bin`` (mapped, read tensor by tensor): the same stage values."""
    from safetensors.torch import load_file

    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(minilm_dir / "config.json", d / "config.json")
    torch.save(load_file(str(minilm_dir / "model.safetensors")), d / "pytorch_model.bin")
    whole = build_model("bert-base", weights=minilm_dir, seq_len=16, dropout=0.0)
    part = build_model("bert-base", weights=d, seq_len=16, dropout=0.0, layers=[0, 1, 2])
    _assert_stage_equals_whole(whole, part, [0, 1, 2])


# ---- four processes ------------------------------------------------------------------------------

def _plan(model, schedule: str, cache: bool):
    l0, l1, l2 = LAYOUTS[model.name]
    return make_plan(model, [spec(0, K=4, D=1, M=4, b=2, ranks=l0, schedule=schedule),
                             spec(1, K=2, D=2, M=2, b=2, ranks=l1, schedule=schedule, cache=cache),
                             spec(2, K=1, D=4, M=2, b=1, ranks=l2, schedule=schedule, cache=cache)],
                     trajectory=[0, 1, 2])


def _cfg(tmp: str, name: str, optimizer: str, **kw) -> RunConfig:
    o = OPT[optimizer]
    return RunConfig(plan="(test)", model=name, optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                     weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=SEED,
                     freeze_every=STEPS_PER_PHASE, steps_per_epoch=len(COUNTS), epochs=1, progress=False,
                     timeout_s=60, log=os.path.join(tmp, "run.jsonl"), **kw)


def _stage_run(tmp: str, name: str, plan, cfg_of, data, *, resume_phase: bool = False):
    """4 forked ranks, each building its own stage in the child; returns (result, snapshots, per-rank records)."""
    os.makedirs(tmp, exist_ok=True)

    def worker(rank: int, world: int) -> None:
        cfg = cfg_of(rank)
        out = open(os.path.join(tmp, f"rank{rank}.jsonl"), "w")

        def write(**rec) -> None:
            out.write(json.dumps(rec) + "\n")
            out.flush()

        first = start_phase(cfg, plan, model_name=name, samples=len(data[0])) if resume_phase else 0
        model = build_model(name, **_kw(name), layers=stage_layers(plan, first, rank))
        sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.layers]
        write(kind="build", phase=first, built=_built(model), sizes=sizes)

        def after(step: int, r: int) -> None:
            write(kind="step", step=step, built=_built(model))

        def snap(event: str, step: int, weights) -> None:
            torch.save(weights, os.path.join(tmp, f"snap-{step}-{event}.pt"))

        run_training(cfg, plan, model, TensorDataset(*data),
                     hooks=Hooks(snapshots=True, on_snapshot=snap, after_step=after))

    res = run_world(4, worker, tmpdir=tmp, timeout_s=60, deadline_s=170)
    assert res.ok, res.explain()
    recs = {r: [json.loads(line) for line in open(os.path.join(tmp, f"rank{r}.jsonl"))] for r in range(4)}
    snaps = {int(f.split("-")[1]): torch.load(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("snap-")}
    return snaps, recs


def _held(plan, step: int, rank: int, n: int) -> list[int]:
    """The layers ``rank`` holds during ``step`` (1-based) by the plan alone."""
    ph = plan.phases[COUNTS[step - 1]]
    return sorted(holdings(ph, rank, n, cached_prefix=ph.cache))


@pytest.mark.multiproc
@pytest.mark.parametrize("name,schedule,optimizer,cache", [("bert-tiny", "1f1b", "sgd", True),
                                                            ("gpt2-tiny", "gpipe", "adamw", False)])
def test_ranks_build_only_their_stage_and_train_as_the_reference(name, schedule, optimizer, cache, tmp_path):
    data = _data(build_model(name, **_kw(name)))
    whole = build_model(name, **_kw(name), layers=[])
    plan = _plan(whole, schedule, cache)
    tmp = str(tmp_path)
    kw = dict(cache="auto", cache_dir=str(tmp_path / "ram")) if cache else {}
    if cache:
        os.makedirs(kw["cache_dir"])
    snaps, recs = _stage_run(tmp, name, plan, lambda r: _cfg(tmp, name, optimizer, **kw), data)
    n = len(whole.layers)
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    for rank in range(4):
        build = recs[rank][0]
        want = stage_layers(plan, 0, rank)
        assert sorted(map(int, build["built"])) == want, (rank, build["built"])
        held = sum(build["built"].values())
        assert held == sum(build["sizes"][i] for i in want) and sum(build["sizes"]) == total
        assert held < total / 2, (rank, held, total)  # a quarter-ish of the model, never the whole
        steps = [r for r in recs[rank] if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(1, len(COUNTS) + 1))
        for r in steps:  # every phase: storage exactly on the layers the phase gives this rank
            assert sorted(map(int, r["built"])) == _held(plan, r["step"], rank, n), (rank, r["step"])
    ref, _ = reference(name, optimizer, data)
    worst = assert_parity(snaps, ref, (0, 2, 4, 6), TOL[optimizer])
    print(f"stage build {name} {schedule} {optimizer}: max relative difference {worst:.1e}")
    if cache:
        setup = next(r for r in read_records(os.path.join(tmp, "run.jsonl")) if r["type"] == "cache_setup")
        assert setup["frozen_layers"] == [3, 5] and not setup["notes"]
        # the record's host need counts every frozen layer at full size, also those rank 0 (which writes it) did not
        # build: its stage in phase 0 ends before the cached prefix does
        whole_sizes = [sum(p.numel() * p.element_size() for p in layer.parameters())
                       for layer in build_model(name, **_kw(name)).layers]
        assert max(stage_layers(plan, 0, 0)) + 1 < 5
        assert setup["host_bytes_per_node"] == host_need(plan, setup["phases"], whole_sizes, setup["samples"],
                                                         setup["row_bytes"], 4, pinned=False)


@pytest.mark.multiproc
@pytest.mark.parametrize("folders,fsdp", [("shared", False), ("rank0-only", False), ("rank0-only", True)])
def test_a_resume_builds_the_checkpoints_phase_and_reads_only_its_layers(folders, fsdp, tmp_path):
    """Checkpoint after step 3 (phase 1: K=2,D=2), resume in new processes: each rank builds its stage of phase 1
    (``start_phase``), loads it from the checkpoint (every rank from the shared file, or rank 0 sending the
    others theirs when only its folder has it) and ends with the uninterrupted run's weights -- also when
    phase 1 trains FSDP-sharded copies (built from the loaded weights and state)."""
    from tests.test_hybrid_runtime import with_strategies

    name, optimizer = "gpt2-tiny", "adamw"
    data = _data(build_model(name, **_kw(name)))
    plan = _plan(build_model(name, **_kw(name), layers=[]), "1f1b", False)
    if fsdp:
        plan = with_strategies(plan, [(False, False), (True, False), (True, True)])
    # the uninterrupted run (deterministic: run once per strategy, for every folder layout)
    full = once(("stage-build-full", fsdp), lambda: _stage_run(str(tmp_path / "full"), name, plan, lambda r: _cfg(
        str(tmp_path / "full"), name, optimizer), data)[0])
    ck = tmp_path / "ck"
    first = str(tmp_path / "first")

    def stop_at_3(step: int, rank: int) -> None:
        if step == 3:
            raise SystemExit(0)

    os.makedirs(first)
    cfg1 = _cfg(first, name, optimizer, checkpoint_dir=str(ck), checkpoint_every=3)

    def worker(rank: int, world: int) -> None:
        model = build_model(name, **_kw(name), layers=stage_layers(plan, 0, rank))
        run_training(cfg1, plan, model, TensorDataset(*data), hooks=Hooks(after_step=stop_at_3))

    res = run_world(4, worker, tmpdir=first, timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    dirs = {r: str(ck) for r in range(4)}
    if folders == "rank0-only":
        for r in range(1, 4):
            dirs[r] = str(tmp_path / f"node{r}")
            os.makedirs(dirs[r])
    second = str(tmp_path / "second")
    snaps, recs = _stage_run(second, name, plan,
                             lambda r: _cfg(second, name, optimizer, checkpoint_dir=dirs[r], resume=True), data,
                             resume_phase=True)
    n = plan.inputs.profile.num_layers
    for rank in range(4):
        build = recs[rank][0]
        assert build["phase"] == 1 and sorted(map(int, build["built"])) == stage_layers(plan, 1, rank)
        for r in (x for x in recs[rank] if x["kind"] == "step"):
            got, want = sorted(map(int, r["built"])), _held(plan, r["step"], rank, n)
            if fsdp:  # the active layers train as FSDP shards (hybrid): the canonical layers keep no more
                assert set(got) <= set(want), (rank, r["step"])
            else:
                assert got == want, (rank, r["step"])
    for k, v in full[6].items():
        assert torch.equal(snaps[6][k], v), k
    resume = next(r for r in read_records(os.path.join(second, "run.jsonl")) if r["type"] == "resume")
    assert resume["step"] == 3 and resume["phase"] == 1 and resume["source_rank"] == 0
    sent = resume["bytes"]["checkpoint_sent_max"]
    assert (sent == 0) == (folders == "shared"), sent


def test_a_store_that_cannot_pin_warns_once_and_keeps_its_values():
    """Where the driver refuses to page-lock (here: a CPU build of torch, which has no page-locked allocator),
    ``LayerStore.pin`` warns once, leaves the layer's values and pageable storage as they were, and stops trying."""
    import warnings

    from ptplan.executor.runtime.stage import LayerStore

    model = build_model("bert-tiny", seq_len=8)
    want = [p.detach().clone() for p in model.layers[1].parameters()]
    store = LayerStore(model.layers, torch.device("cpu"))
    assert not store.pins  # a CPU rank never pins
    store.pins = True  # as a CUDA rank starts
    with pytest.warns(UserWarning, match="cannot page-lock host memory for layer 1"):
        store.pin(1)
    assert not store.pins and all(torch.equal(p, w) for p, w in zip(model.layers[1].parameters(), want))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.pin(2)  # no second warning, nothing copied
    store.release(1)
    assert not store.unlocked  # nothing page-locked was let go
    store.unlocked = True
    store.trim()  # no accelerator to hand blocks back to: nothing to do, no error
    assert not store.unlocked
