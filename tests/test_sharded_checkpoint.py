"""Sharded checkpoints (``executor/training/sharded.py``, issue 23 items 1-2): saved by every rank in parallel with
torch.distributed.checkpoint, resumed on another world size and plan of the same profile.

Pinned: after loading on the new plan every weight and optimizer-state tensor equals the saved one exactly;
a run saved on 4 processes and resumed on 2 (and 2 -> 4, with an async save) ends where the uninterrupted
run of the new plan ends (the runtime parity tests' SGD tolerance); each rank passes DCP exactly its own
stage's bytes (not the model's); a tp2 x FSDP stage passes only its DTensor shards and they read back equal to
the run's gathered state; ranks that do not share the checkpoint folder are refused before training; a new plan
that cannot continue is refused with the numbers.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from parity import max_rel_diff
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.runtime.transition import holdings, owned_layers
from ptplan.executor.training import sharded
from ptplan.executor.training.callbacks import Callback, Hooks
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.loop import run_training
from ptplan.executor.training.runlog import read_records
from ptplan.planner.errors import PtplanError

TOL = 1e-5
"""tests/test_runtime_parity.py's SGD tolerance (another world size sums the gradients in another order)."""


def _model():
    return build_model("bert-tiny", seq_len=8, dropout=0.0, seed=0)


def _plan(model, world: int, batch: int = 8):
    """Phases for 0 and 1 frozen blocks on ``world`` processes, global batch ``batch`` each."""
    if world == 4:
        phases = [spec(0, K=2, D=2, M=2, b=batch // 4), spec(1, K=1, D=4, M=1, b=batch // 4)]
    else:
        phases = [spec(0, K=2, D=1, M=2, b=batch // 2), spec(1, K=1, D=2, M=1, b=batch // 2)]
    return make_plan(model, phases, trajectory=[0, 1], samples_per_epoch=16)


def _cfg(tmp, name, **kw):
    base = dict(plan="(test)", model="bert-tiny", optimizer="sgd", lr=0.05, epochs=5, progress=False, timeout_s=30,
                log=os.path.join(tmp, f"{name}.jsonl"), checkpoint_format="sharded")
    return RunConfig(**{**base, **kw})


class _Loaded(Callback):
    """On rank 0 after the start (a resume: right after loading), the gathered weights and optimizer state."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_start(self, ctx) -> None:
        weights, state = ctx.rt.gather(with_state=True)
        if ctx.rank == 0:
            torch.save({"weights": weights, "state": state}, self.path)


def _run(tmp, world, cfg, plan, model, data, *, loaded=None):
    """``run_training`` on ``world`` forked ranks; returns the final weights."""
    out = os.path.join(tmp, f"final-{os.urandom(4).hex()}.pt")

    def worker(rank, _world):
        def save(event, step, weights):
            if event == "final":
                torch.save(weights, out)

        run_training(cfg, plan, model, data, hooks=Hooks(snapshots=True, on_snapshot=save),
                     callbacks=[_Loaded(loaded)] if loaded else [])

    res = run_world(world, worker, tmpdir=tmp, timeout_s=30, deadline_s=240)
    assert res.ok, res.explain()
    return torch.load(out)


def _saved(folder):
    """Every tensor of a DCP checkpoint folder, read in this process."""
    md = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    sd = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()}
    dcp.load(sd, checkpoint_id=folder, no_dist=True)
    return sd


@pytest.mark.multiproc
@pytest.mark.parametrize("src,dst,freeze_every,async_save", [(4, 2, 6, False), (2, 4, 3, True)])
def test_resume_on_another_world_size_equals_the_uninterrupted_run(tmp_path, one_torch_thread, src, dst,
                                                                   freeze_every, async_save):
    model = _model()
    data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
    tmp, ck = str(tmp_path), str(tmp_path / "ck")
    plan_src, plan_dst = _plan(model, src), _plan(model, dst)
    want = _run(tmp, dst, _cfg(tmp, "ref", freeze_every=freeze_every), plan_dst, model, data)

    _run(tmp, src, _cfg(tmp, "first", freeze_every=freeze_every, epochs=2, checkpoint_dir=ck,
                        async_checkpoint=async_save), plan_src, model, data)
    meta = json.load(open(os.path.join(ck, "sharded.json")))
    assert meta["position"]["global_step"] == 4 and meta["world_size"] == src
    shutil.copytree(ck, tmp_path / "saved")
    saved = _saved(str(tmp_path / "saved" / meta["folder"]))

    # (c) every rank passed DCP its own stage's tensors only: its layers' weights + its active layers' momentum
    ph = plan_src.phase_for(meta["position"]["frozen_blocks"])
    sizes = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model.layers]
    for r in range(src):
        own = sum(sizes[i] for i in holdings(ph, r, len(sizes), cached_prefix=False))
        own += sum(sizes[i] for i in owned_layers(ph, r, len(sizes)) if i >= ph.frozen_layers)
        assert meta["bytes"][r] == own, (r, meta["bytes"])
    whole = sum(sizes) + sum(sizes[ph.frozen_layers:])
    if ph.K > 1:  # a pipeline: no rank passes the whole model (pure data parallelism: each stage is the model)
        assert max(meta["bytes"]) < 0.75 * whole, (meta["bytes"], whole)
    records = [r for r in read_records(os.path.join(tmp, "first.jsonl")) if r["type"] == "checkpoint"]
    assert [r["step"] for r in records] == [2, 4] and all(r["seconds"] > 0 for r in records)
    assert records[-1]["bytes_max"] == max(meta["bytes"]) and records[-1]["async"] is async_save

    got = _run(tmp, dst, _cfg(tmp, "first", freeze_every=freeze_every, checkpoint_dir=ck, resume=True),
               plan_dst, model, data, loaded=os.path.join(tmp, "loaded.pt"))
    # (a) after loading: every weight and optimizer-state tensor equals the saved one, exactly
    loaded = torch.load(os.path.join(tmp, "loaded.pt"))
    flat = {**loaded["weights"], **{f"optim.{n}.{k}": v for n, st in loaded["state"].items() for k, v in st.items()}}
    assert sorted(flat) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(flat[k], v), k
    # (b) the resumed run ends where the uninterrupted run of the new plan ends
    d, where = max_rel_diff(got, want)
    assert d <= TOL, (d, where)
    resume = [r for r in read_records(os.path.join(tmp, "first.jsonl")) if r["type"] == "resume"]
    assert [r["step"] for r in resume] == [4]


def _meta(plan, **kw):
    from ptplan.executor.training import checkpoint as ckpt

    base = {"plan": ckpt.plan_identity(plan), "model_name": "bert-tiny", "optimizer": "sgd",
            "run": {"samples": 16, "seed": 0, "shuffle": True, "freeze": "planned", "freeze_every": 6},
            "position": {"frozen_blocks": 0, "global_step": 4},
            "global_batch": {str(p.frozen_blocks): p.global_batch for p in plan.phases}}
    return {**base, **kw}


def test_another_world_size_of_the_same_profile_can_continue():
    model = _model()
    meta = _meta(_plan(model, 4))
    assert sharded.resume_problems(meta, plan=_plan(model, 2), model_name="bert-tiny", optimizer="sgd",
                                   freeze="planned", run=meta["run"]) == []


def test_a_plan_that_cannot_continue_is_refused_with_the_numbers():
    model = _model()
    meta = _meta(_plan(model, 4))
    run = meta["run"]

    def problems(plan, **kw):
        args = dict(plan=plan, model_name="bert-tiny", optimizer="sgd", freeze="planned", run=run)
        return " ".join(sharded.resume_problems(meta, **{**args, **kw}))

    assert "global batch of 8 samples, this plan's on 4 (plan with --batch 8" in problems(_plan(model, 2, batch=4))
    only0 = make_plan(model, [spec(0, K=2, D=1, M=2, b=4)], samples_per_epoch=16)
    meta["position"] = {"frozen_blocks": 1, "global_step": 4}
    assert "at 1 frozen blocks, and this plan has no phase for that (phases for [0]" in problems(only0)
    assert "it holds sgd state, not adamw" in problems(_plan(model, 2), optimizer="adamw")
    assert "its seed is 0, this run's is 3" in problems(_plan(model, 2), run={**run, "seed": 3})
    other = {**meta, "plan": {**meta["plan"], "profile": "0" * 16}}
    assert "written for profile 0000000000000000" in " ".join(sharded.resume_problems(
        other, plan=_plan(model, 2), model_name="bert-tiny", optimizer="sgd", freeze="planned", run=run))


def test_an_unknown_format_and_async_without_sharded_are_refused():
    with pytest.raises(PtplanError, match="unknown --checkpoint-format 'zip'"):
        RunConfig(plan="p", model="bert-tiny", checkpoint_format="zip")
    with pytest.raises(PtplanError, match="--async-checkpoint needs --checkpoint-format sharded"):
        RunConfig(plan="p", model="bert-tiny", async_checkpoint=True)


def _check_shared(rank, world, folders):
    sharded.check_shared(folders[rank], rank, wait_s=0.2)


@pytest.mark.multiproc
def test_ranks_that_do_not_share_the_checkpoint_folder_are_refused_before_training(tmp_path, one_torch_thread):
    """Two "nodes" (rank 1 with a folder of its own, as on a node's own disk): every rank raises the same error
    naming rank 1 and the fix -- a run at its start, before any step or log line; one folder for both passes and
    leaves no probe file behind."""
    own = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for f in own:
        os.makedirs(f)
    res = run_world(2, _check_shared, (own,), tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert not res.ok and all("ranks [1] of 2 do not see the file rank 0 wrote" in e and
                              "--checkpoint-format single" in e for e in res.errors), res.explain()
    res = run_world(2, _check_shared, ([own[0]] * 2,), tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.ok, res.explain()
    assert os.listdir(own[0]) == [] and os.listdir(own[1]) == []

    model = _model()  # a run is refused at its start, before any step
    data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
    plan = _plan(model, 2)

    def worker(rank, _world):
        run_training(_cfg(str(tmp_path), "run", checkpoint_dir=own[rank]), plan, model, data)

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.exitcodes == (1, 1) and all("ranks [1] of 2 do not see" in e for e in res.errors), res.explain()
    assert not os.path.exists(tmp_path / "run.jsonl") and os.listdir(own[1]) == []


class _Ended(_Loaded):
    """On rank 0 at the end (after the last save), the gathered weights and optimizer state."""

    def on_start(self, ctx) -> None:
        pass

    def on_end(self, ctx) -> None:
        _Loaded.on_start(self, ctx)


@pytest.mark.multiproc
def test_a_tp_by_fsdp_stage_saves_its_2d_shards_and_they_read_back_whole(tmp_path, one_torch_thread):
    """tp2 x FSDP over D=2 (a 2-D mesh: FSDP's strided shards of tp's halves), AdamW: each rank passes DCP only its
    DTensor shards, and the checkpoint read back in one process equals the run's gathered weights and state."""
    from test_hybrid_runtime import with_strategies

    model = _model()
    data = TensorDataset(*model.make_batch(8, generator=torch.Generator().manual_seed(1)))
    plan = with_strategies(make_plan(model, [spec(0, K=1, D=2, M=2, b=2)], samples_per_epoch=8), [(2, True, False)])
    tmp, ck, end = str(tmp_path), str(tmp_path / "ck"), str(tmp_path / "end.pt")
    cfg = _cfg(tmp, "run", optimizer="adamw", lr=1e-3, epochs=1, checkpoint_dir=ck)

    def worker(rank, _world):
        run_training(cfg, plan, model, data, callbacks=[_Ended(end)])

    res = run_world(4, worker, tmpdir=tmp, timeout_s=30, deadline_s=120)
    assert res.ok, res.explain()
    meta = json.load(open(os.path.join(ck, "sharded.json")))
    saved = _saved(os.path.join(ck, meta["folder"]))
    got = torch.load(end)
    flat = {**got["weights"], **{f"optim.{n}.{k}": v for n, st in got["state"].items() for k, v in st.items()}}
    assert sorted(flat) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(flat[k], v), k
    whole = sum(v.numel() * v.element_size() for v in saved.values())
    assert max(meta["bytes"]) < 0.5 * whole, (meta["bytes"], whole)  # a gather would pass DCP the whole stage


@pytest.mark.multiproc
def test_a_full_disk_during_a_sharded_save_is_one_error_and_keeps_the_last_checkpoint(tmp_path, one_torch_thread):
    """Two processes saving every step to a 9 MB tmpfs (a checkpoint is 3.4 MB; the one of step 2 fits, then the
    disk fills up): every rank raises one PtplanError naming the full disk, the incomplete step folder is removed,
    sharded.json still names step 2's, and after freeing space the resumed run ends with the uninterrupted weights."""
    from test_robustness_files import _fill, small_fs

    model = _model()
    data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
    plan, tmp, out = _plan(model, 2), str(tmp_path), str(tmp_path / "final.pt")

    def run(cfg, after_step=None):
        def worker(rank, _world):
            def save(event, step, weights):
                if event == "final":
                    torch.save(weights, out)
            run_training(cfg, plan, model, data, hooks=Hooks(snapshots=True, on_snapshot=save, after_step=after_step))
        return run_world(2, worker, tmpdir=tmp, timeout_s=30, deadline_s=120)

    assert run(_cfg(tmp, "ref", epochs=2)).ok
    want = torch.load(out)
    with small_fs(tmp_path / "fs", "9m") as fs:
        folder = str(fs / "ck")
        res = run(_cfg(tmp, "run", epochs=2, checkpoint_dir=folder, checkpoint_every=1),
                  after_step=lambda step, rank: _fill(fs) if step == 2 and rank == 0 else None)
        assert res.exitcodes == (1, 1), res.explain()
        for e in res.errors:
            assert "PtplanError: cannot write the checkpoint" in e and "(the disk is full)" in e, e
        assert sorted(os.listdir(folder)) == [os.path.basename(sharded.step_folder(folder, 2)), "sharded.json"]
        os.unlink(fs / "filler")  # the operator frees space, then resumes
        res = run(_cfg(tmp, "run", epochs=2, checkpoint_dir=folder, checkpoint_every=1, resume=True))
        assert res.ok, res.explain()
    got = torch.load(out)
    for k in want:
        assert torch.equal(got[k], want[k]), k
