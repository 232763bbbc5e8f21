"""The one step interpreter (``executor/runtime/step.py``) runs the plan's lists, action for action.

Single process (K = 1) and 2 gloo processes (K = 2): for GPipe, 1F1B, ZB-H1, interleaved 1F1B and looped BFS
(V = 2), every position's executed actions (``step.TRACE``: computes, messages and ALLREDUCE) equal the plan's
list, and the gradients equal one process's backward of the whole chain on the whole batch. PipeDream-2BW: three
steps and a drain run exactly the planner's continuous 1F1B over three mini-batches (``two_bw(K, M, 3)``), with
one update per mini-batch, the first on the gradient at the starting weights. Token slices: a TeraPipe step
runs ``terapipe``'s lists. Pure: ``twobw.stretches`` cuts the planner's window into steps whose concatenation is
the continuous list for any number of steps, shorter or longer than the window.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ptplan.executor.launch.local import run_world
from ptplan.executor.runtime import step as step_mod
from ptplan.executor.runtime.step import ChunkCompute, StepInterpreter
from ptplan.executor.runtime.twobw import TwoBW, _shift, stretches
from ptplan.planner.errors import PtplanError
from ptplan.planner.schedule import build_schedule, terapipe, two_bw

FLUSHED = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("looped-bfs", 2), ("zb-v", 2)]
M, B, H = 4, 8, 6


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _chain(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(n)]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)


def _reference(n: int) -> list[dict[str, torch.Tensor]]:
    """Each chunk's gradients from one backward of the whole chain on the whole batch (mean loss)."""
    chunks = _chain(n)
    x, y = _data()
    for c in chunks:
        x = c(x)
    nn.functional.mse_loss(x, y).backward()
    return [{k: p.grad.clone() for k, p in c.named_parameters()} for c in chunks]


def _run(schedule, position: int, group) -> tuple[list[str], list[dict[str, torch.Tensor]], list[float]]:
    chunks = _chain(schedule.K)
    mine = {c: chunks[c] for c in range(schedule.K) if schedule.stage_to_rank[c] == position}
    compute = ChunkCompute(mine, nn.functional.mse_loss, M=schedule.M, last=schedule.K - 1)
    step = StepInterpreter(schedule, position, compute, group=group, device=torch.device("cpu"))
    x, y = _data()
    step_mod.TRACE = []
    try:
        losses = step.run(x if 0 in mine else None, y if schedule.K - 1 in mine else None, {})
        ran = [a for _, a in step_mod.TRACE]
    finally:
        step_mod.TRACE = None
    grads = [{k: p.grad.clone() for k, p in chunks[c].named_parameters()} if c in mine else {} for c in range(len(chunks))]
    return ran, grads, [float(t) for t in losses]


def _assert_grads(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    for c, g in enumerate(got):
        for k, t in g.items():
            torch.testing.assert_close(t, want[c][k], rtol=1e-5, atol=1e-6, msg=f"chunk {c} {k}")


@pytest.mark.parametrize("name,V", FLUSHED, ids=[n for n, _ in FLUSHED])
def test_one_position_runs_the_list_and_matches_one_backward(name, V):
    sched = build_schedule(name, 1, M, V)
    ran, grads, losses = _run(sched, 0, None)
    assert ran == [str(a) for a in sched.actions[0]]
    _assert_grads(grads, _reference(V))
    assert len(losses) == M


def _flushed_worker(rank: int, world: int, name: str, V: int, tmp: str) -> None:
    import torch.distributed as dist

    sched = build_schedule(name, world, M, V)
    ran, grads, losses = _run(sched, rank, dist.group.WORLD)
    torch.save({"ran": ran, "grads": grads, "losses": losses, "buffers": None}, os.path.join(tmp, f"r{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.parametrize("name,V", FLUSHED, ids=[n for n, _ in FLUSHED])
def test_two_positions_run_the_plans_lists_and_match_one_backward(name, V, tmp_path):
    res = run_world(2, _flushed_worker, (name, V, str(tmp_path)), tmpdir=str(tmp_path), timeout_s=30, deadline_s=90)
    assert res.ok, res.explain()
    sched = build_schedule(name, 2, M, V)
    want = _reference(2 * V)
    for r in range(2):
        out = torch.load(tmp_path / f"r{r}.pt")
        assert out["ran"] == [str(a) for a in sched.actions[r]], r
        _assert_grads(out["grads"], want)
    last = torch.load(tmp_path / f"r{sched.stage_to_rank[-1]}.pt")["losses"]
    assert len(last) == M


def _twobw_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    sched = build_schedule("2bw", world, 2)
    chunks = _chain(world)
    mod = chunks[rank]
    updates: list[dict[str, torch.Tensor]] = []
    names = {id(p): k for k, p in mod.named_parameters()}

    def update(pairs):  # begun after the mini-batch's last backward, applied when the policy says (``TwoBW._finish``)
        updates.append({names[id(p)]: g.clone() for p, g in pairs})

        def finish():
            with torch.no_grad():
                for p, g in pairs:
                    p.sub_(0.1 * g)
        return finish

    policy = TwoBW(mod, sched, rank, update)
    compute = ChunkCompute({rank: mod}, nn.functional.mse_loss, M=2, last=world - 1, call=policy.call)
    step = StepInterpreter(sched, rank, compute, group=dist.group.WORLD, device=torch.device("cpu"), policy=policy)
    x, y = _data()
    step_mod.TRACE = []
    for _ in range(3):
        step.run(x if rank == 0 else None, y if rank == world - 1 else None, {})
    step.drain()
    torch.save({"ran": [a for _, a in step_mod.TRACE], "updates": updates,
                "buffers": len(step.recv_buffers())}, os.path.join(tmp, f"r{rank}.pt"))


@pytest.mark.multiproc
def test_two_bw_steps_and_drain_run_the_continuous_list(tmp_path):
    res = run_world(2, _twobw_worker, (str(tmp_path),), tmpdir=str(tmp_path), timeout_s=30, deadline_s=90)
    assert res.ok, res.explain()
    want_lists = two_bw(2, 2, minibatches=3).actions
    chunks = _chain(2)  # mini-batch 0 runs at the starting weights: its gradient is one backward's
    x, y = _data()
    for c in chunks:
        x = c(x)
    nn.functional.mse_loss(x, y).backward()
    for r in range(2):
        out = torch.load(tmp_path / f"r{r}.pt")
        assert out["ran"] == [str(a) for a in want_lists[r]], r
        assert len(out["updates"]) == 3
        for k, p in chunks[r].named_parameters():
            torch.testing.assert_close(out["updates"][0][k], p.grad, rtol=1e-5, atol=1e-6)
    assert torch.load(tmp_path / "r0.pt")["buffers"] == 1  # position 0 receives gradients: one buffer
    assert torch.load(tmp_path / "r1.pt")["buffers"] == 0  # activations arrive in their own tensors


def _sliced_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    from ptplan.executor.families.models import build_model
    from ptplan.executor.runtime.sliced import SlicedStage, run_sliced_step

    model = build_model("gpt2-tiny", granularity="half", seq_len=8, dropout=0.0, seed=0)
    x, y, _ = model.make_batch(4, generator=torch.Generator().manual_seed(0))
    split = len(model.layers) // 2
    lo, hi = (0, split) if rank == 0 else (split, len(model.layers))
    stage = SlicedStage(model.layers[lo:hi], first=rank == 0, last=rank == 1)
    sched = terapipe(2, 2, 2)
    step_mod.TRACE = []
    loss = run_sliced_step(sched, stage, position=rank, ranks=[0, 1], slices=(5, 3),
                           inputs=list(x.chunk(2)) if rank == 0 else None,
                           labels=list(y.chunk(2)) if rank == 1 else None, group=dist.group.WORLD)
    torch.save({"ran": [a for _, a in step_mod.TRACE], "loss": loss}, os.path.join(tmp, f"r{rank}.pt"))


@pytest.mark.multiproc
def test_a_token_sliced_step_runs_terapipes_lists(tmp_path):
    res = run_world(2, _sliced_worker, (str(tmp_path),), tmpdir=str(tmp_path), timeout_s=30, deadline_s=90)
    assert res.ok, res.explain()
    want = terapipe(2, 2, 2).actions
    for r in range(2):
        assert torch.load(tmp_path / f"r{r}.pt")["ran"] == [str(a) for a in want[r]]
    assert torch.load(tmp_path / "r1.pt")["loss"] > 0


@pytest.mark.parametrize("K,Mb", [(2, 2), (3, 4), (4, 4), (4, 7)])
def test_two_bw_stretches_concatenate_to_the_continuous_list(K, Mb):
    window = two_bw(K, Mb).actions
    for steps in (1, 3, 8, 11):
        want = two_bw(K, Mb, minibatches=steps).actions
        for r in range(K):
            parts, tail = stretches(window[r], Mb, 8)
            got = []
            for t in range(steps):
                got += parts[t] if t < 8 else _shift(parts[7], (t - 7) * Mb)
            got += _shift(tail, (steps - 8) * Mb)
            assert [str(a) for a in got] == [str(a) for a in want[r]], (K, Mb, steps, r)


def test_an_action_the_interpreter_cannot_run_is_refused():
    """K = 1 has no messages: a message in its list has no process group to go through."""
    from ptplan.planner.schedule import Schedule, parse_action

    acts = tuple(parse_action(t) for t in "0F0 0SEND_F0 0B0 0ALLREDUCE".split())
    sched = Schedule(name="hand-made", K=2, M=1, stage_to_rank=(0, 1), actions=(acts, ()))
    chunks = _chain(2)
    step = StepInterpreter(sched, 0, ChunkCompute({0: chunks[0]}, nn.functional.mse_loss, M=1, last=1), group=None,
                           device=torch.device("cpu"))
    x, _ = _data()
    with pytest.raises(PtplanError, match="no process group"):
        step.run(x, None, {})
