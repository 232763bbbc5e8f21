"""The executor runs exactly the plan's actions.

Pure: how a phase's action lists become torch's schedule IR (``executor/runtime/actions.py``) and what it refuses.
Multi-process: 4 gloo processes run an elastic plan (K=4,D=1 -> K=2,D=2 -> K=1,D=4) while every
rank records the compute actions its stages really run -- the step interpreter's compute entry points
(``_forward``, ``_backward`` full or input-gradient only, ``_backward_weight``) at every K; torch's
``PipelineStage`` entry points are recorded too, so a return to torch's runtime would show twice -- and each step's record equals the
plan's list for that rank's position (``planner.schedule.torch_compute_order``), for GPipe, 1F1B,
ZB-H1, interleaved 1F1B and looped BFS (V=2), and for a plan without stored actions. (ZB-V's lists
are refused: their receives between two ranks do not follow the sends' order.)
"""
from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

from ptplan.executor.runtime.actions import phase_schedule, torch_actions, torch_text
from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.runtime.groups import chunks_of, locate
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, schedule_text, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.executor.runtime.transition import DEVICE, HOST, holdings, needs, owned_layers
from ptplan.planner.errors import PtplanError
from ptplan.planner.schedule import (Schedule, ScheduleError, build_schedule, check_message_order, parse_action,
                                     torch_compute_order)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


SEQ = 8


@pytest.fixture(scope="module")
def bert():
    return build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0)


def _plan(model, schedule: str, V: int = 1, *, actions: bool = True):
    kw = dict(schedule=schedule, V=V) if actions else dict(schedule=schedule, V=V, actions=())
    return make_plan(model, [spec(0, K=4, D=1, M=4, b=2, **kw),
                             spec(1, K=2, D=2, M=2, b=2, ranks=((2, 0), (3, 1)), **kw),  # stage order != rank order
                             spec(2, K=1, D=4, M=2, b=1, **kw)], trajectory=[0, 1, 2])


# ---- pure: the plan's lists in torch's IR --------------------------------------------------------

def test_actions_map_token_by_token_to_torch(bert):
    ph = _plan(bert, "zb-h1").phases[1]  # K=2, M=2
    assert ph.actions == schedule_text("zb-h1", 2, 2)
    text = torch_text(phase_schedule(ph))
    assert text == (
        ("0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0I0", "0W0", "0RECV_B1", "0I1", "0W1", "0REDUCE_GRAD"),
        ("1RECV_F0", "1F0", "1I0", "1SEND_B0", "1RECV_F1", "1F1", "1I1", "1SEND_B1", "1W0", "1W1", "1REDUCE_GRAD"))
    ph = _plan(bert, "1f1b").phases[1]  # no W: B stays torch's full backward
    assert torch_text(phase_schedule(ph))[0] == ("0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1",
                                                 "0B1", "0REDUCE_GRAD")
    acts = torch_actions(phase_schedule(ph))
    assert [str(a) for a in acts[1]] == list(torch_text(phase_schedule(ph))[1])


def test_interleaved_phase_places_chunk_c_on_position_c_mod_k(bert):
    ph = _plan(bert, "interleaved-1f1b", V=2).phases[0]  # K=4, 8 chunks
    assert ph.stages == 8 and len(ph.partition) == 8
    assert [chunks_of(ph, k) for k in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    sched = phase_schedule(ph)
    assert sched.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert torch_compute_order(sched) == torch_compute_order(build_schedule("interleaved-1f1b", 4, 4, 2))


def test_with_v_chunks_a_rank_holds_and_needs_the_layers_of_all_its_chunks(bert):
    ph = _plan(bert, "interleaved-1f1b", V=2).phases[1]  # 1 frozen block (3 layers), K=2, D=2, 4 chunks
    assert ph.partition == ((3, 5), (5, 7), (7, 9), (9, 11)) and ph.ranks == ((2, 0), (3, 1))
    assert owned_layers(ph, 2, 11) == owned_layers(ph, 3, 11) == [3, 4, 7, 8]  # chunks 0 and 2
    assert owned_layers(ph, 0, 11) == owned_layers(ph, 1, 11) == [5, 6, 9, 10]  # chunks 1 and 3
    need = needs(ph, 11)
    assert all(need[i] == frozenset({2, 3}) for i in (0, 1, 2, 3, 4, 7, 8))  # prefix and position 0's chunks
    assert all(need[i] == frozenset({0, 1}) for i in (5, 6, 9, 10))
    assert holdings(ph, 3, 11, cached_prefix=True) == {0: HOST, 1: HOST, 2: HOST, 3: DEVICE, 4: DEVICE, 7: DEVICE,
                                                       8: DEVICE}


def test_a_plan_without_actions_runs_its_schedules_generated_lists(bert):
    plan = _plan(bert, "1f1b", actions=False)
    for ph in plan.phases:
        assert ph.actions == ()
        assert phase_schedule(ph).actions == build_schedule("1f1b", ph.K, ph.M).actions


def _with_actions(ph, actions):
    from dataclasses import replace

    return replace(ph, actions=tuple(actions))


def test_an_unknown_action_is_refused_with_the_phase_and_the_fix(bert):
    ph = _plan(bert, "1f1b").phases[1]
    bad = [ph.actions[0].replace("0F1", "0X1", 1), ph.actions[1]]
    with pytest.raises(PtplanError, match=r"plan phase 3 \(1 frozen blocks, schedule '1f1b', K=2, V=1, M=2\): the "
                                          r"executor cannot run its schedule: cannot parse action '0X1'.*"
                                          r"re-run `ptplan plan`"):
        phase_schedule(_with_actions(ph, bad), 3)


def test_lists_that_cannot_run_are_refused_before_any_process_starts(bert):
    ph = _plan(bert, "1f1b").phases[1]
    missing = [ph.actions[0], ph.actions[1].replace(" 1B1 ", " ", 1)]
    with pytest.raises(PtplanError, match=r"1B1 is missing"):
        phase_schedule(_with_actions(ph, missing))
    deadlock = [ph.actions[0].replace("0F0 0SEND_F0", "0F0 0RECV_B0 0SEND_F0", 1).replace("0F1 0SEND_F1 0RECV_B0",
                                                                                         "0F1 0SEND_F1", 1),
                ph.actions[1]]
    with pytest.raises(PtplanError, match=r"deadlock"):
        phase_schedule(_with_actions(ph, deadlock))
    swapped = [ph.actions[0].replace("0RECV_B0 0B0 0RECV_B1 0B1", "0RECV_B1 0RECV_B0 0B0 0B1"), ph.actions[1]]
    with pytest.raises(PtplanError, match=r"rank 0 receives from rank 1 in another order than rank 1 sends"):
        phase_schedule(_with_actions(ph, swapped))
    sliced = [ph.actions[0].replace("0F0 ", "0F0.1 ", 1), ph.actions[1]]
    with pytest.raises(PtplanError, match="slice"):
        phase_schedule(_with_actions(ph, sliced))


def test_receives_out_of_send_order_are_refused():
    """Torch pairs the messages between two ranks in order; rank 0 sends micro-batch 0's and 1's
    activations, rank 1 posts the receive for 1 first: refused, though each list alone is fine."""
    one = [parse_action(t) for t in "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0ALLREDUCE".split()]
    two = [parse_action(t) for t in "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1ALLREDUCE".split()]
    sched = Schedule(name="hand-made", K=2, M=2, stage_to_rank=(0, 1), actions=(one, two))
    with pytest.raises(ScheduleError, match=r"rank 1 receives from rank 0 in another order than rank 0 sends: "
                                            r"message 0 is 0SEND_F0 on rank 0 but 1RECV_F1 on rank 1"):
        check_message_order(sched)
    check_message_order(build_schedule("interleaved-1f1b", 2, 4, 2))
    check_message_order(build_schedule("zb-h1", 4, 4))


# ---- multi-process: what the executor really ran --------------------------------------------------

def _record_compute_actions() -> list[str]:
    """In this (forked) process only: wrap every compute entry point so that each call appends its
    action in torch's text to the returned list."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from ptplan.executor.runtime.step import StepInterpreter

    log: list[str] = []

    def wrap(cls, name, token):
        orig = getattr(cls, name)
        sig = inspect.signature(orig)

        def run(self, *a, **k):
            bound = sig.bind(self, *a, **k)
            bound.apply_defaults()
            log.append(token(self, bound.arguments))
            return orig(self, *a, **k)

        setattr(cls, name, run)

    wrap(_PipelineStageBase, "forward_one_chunk", lambda s, a: f"{s.stage_index}F{a['fwd_chunk_id']}")
    wrap(_PipelineStageBase, "backward_one_chunk",
         lambda s, a: f"{s.stage_index}{'B' if a['full_backward'] else 'I'}{a['bwd_chunk_id']}")
    wrap(_PipelineStageBase, "backward_weight_one_chunk", lambda s, a: f"{s.stage_index}W{a['bwd_chunk_id']}")
    wrap(StepInterpreter, "_forward", lambda s, a: f"{a['c']}F{a['m']}")
    wrap(StepInterpreter, "_backward", lambda s, a: f"{a['c']}{'B' if a['full'] else 'I'}{a['m']}")
    wrap(StepInterpreter, "_backward_weight", lambda s, a: f"{a['c']}W{a['m']}")
    return log


def _recorded_run(model, plan, tmp: str) -> tuple[dict[tuple[int, int], list[str]], list[dict]]:
    """Run ``plan`` for 6 steps (2 per phase) on 4 processes; per (step, rank) the compute actions run."""
    cfg = RunConfig(plan="(test)", model=model.name, optimizer="sgd", lr=0.05, seed=0, freeze_every=2,
                    steps_per_epoch=6, epochs=1, progress=False, timeout_s=60, log=os.path.join(tmp, "run.jsonl"))
    data = TensorDataset(*model.make_batch(48, generator=torch.Generator().manual_seed(1)))

    def worker(rank: int, world: int) -> None:
        log = _record_compute_actions()

        def after(step: int, r: int) -> None:
            with open(os.path.join(tmp, f"order-{step}-{r}.json"), "w") as f:
                json.dump(log, f)
            log.clear()

        run_training(cfg, plan, model, data, hooks=Hooks(after_step=after))

    res = run_world(4, worker, tmpdir=tmp, timeout_s=60, deadline_s=150)
    assert res.ok, res.explain()
    ran = {}
    for name in os.listdir(tmp):
        if name.startswith("order-"):
            _, step, rank = name[:-5].split("-")
            with open(os.path.join(tmp, name)) as f:
                ran[(int(step), int(rank))] = json.load(f)
    return ran, [r for r in read_records(cfg.log) if r["type"] == "step"]


def _plan_order(ph) -> tuple[tuple[str, ...], ...]:
    """The compute actions the plan gives each position, read from the plan alone (no executor code)."""
    if not ph.actions:
        return torch_compute_order(build_schedule(ph.schedule, ph.K, ph.M, ph.V))
    lists = [[parse_action(t) for t in text.split()] for text in ph.actions]
    return torch_compute_order(Schedule(name=ph.schedule, K=ph.stages, M=ph.M, stage_to_rank=ph.stage_to_rank(),
                                        actions=lists))


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule,V,actions", [("gpipe", 1, True), ("1f1b", 1, True), ("zb-h1", 1, True),
                                                ("interleaved-1f1b", 2, True), ("looped-bfs", 2, True),
                                                ("zb-v", 2, True), ("1f1b", 1, False)],
                         ids=["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "looped-bfs", "zb-v", "1f1b-no-actions"])
def test_every_rank_runs_the_plans_compute_order_through_elastic_transitions(bert, schedule, V, actions, tmp_path):
    plan = _plan(bert, schedule, V, actions=actions)
    ran, steps = _recorded_run(bert, plan, str(tmp_path))
    assert [(r["K"], r["D"]) for r in steps] == [(4, 1)] * 2 + [(2, 2)] * 2 + [(1, 4)] * 2
    assert sorted(ran) == [(step, rank) for step in range(1, 7) for rank in range(4)]
    for rec in steps:
        ph = plan.phases[rec["phase"]]
        want = _plan_order(ph)
        for rank in range(4):
            got = ran[(rec["step"] + 1, rank)]
            assert got == list(want[locate(ph, rank).stage]), (rec["step"], rank, got)
    kinds = {tok.lstrip("0123456789")[0] for got in ran.values() for tok in got}
    assert kinds == ({"F", "I", "W"} if schedule in ("zb-h1", "zb-v") else {"F", "B"})


# ---- pre-launch: the launcher refuses what the workers could not run, with the workers' own check ------

@pytest.mark.parametrize("case", ["1f1b-M<K-no-actions", "unknown-action", "receive-order"])
def test_a_plan_the_workers_cannot_run_is_refused_before_launch(bert, tmp_path, case):
    """`ptplan run --dry-run` checks every phase's schedule with ``actions.phase_schedule`` -- the function
    the runtime builds its schedule with -- so a plan refused by the workers is refused before any process
    starts: one line, exit 2, naming the phase. All three are already refused by the plan reader every command
    shares (``plan_checks``), naming the phase's field: M < K for 1F1B, an unknown action, and receives in another
    order than the sends (``check_message_order``, part of ``check_schedule`` since the planner generated ZB-V
    lists that the simulator ran and the runtime could not)."""
    from dataclasses import replace

    from click.testing import CliRunner

    from ptplan.cli.main import cli
    if case == "1f1b-M<K-no-actions":  # no stored lists: the generator's size rule (1F1B needs M >= K)
        plan = make_plan(bert, [spec(0, K=4, D=1, M=2, b=4, schedule="1f1b", actions=())], trajectory=[0],
                         check=False)
        want = "1F1B needs at least as many micro-batches as stages: M=2 < K=4"
    else:
        plan = _plan(bert, "1f1b")
        ph = plan.phases[1]
        acts = ([ph.actions[0].replace("0F1", "0X1", 1), ph.actions[1]] if case == "unknown-action" else
                [ph.actions[0].replace("0RECV_B0 0B0 0RECV_B1 0B1", "0RECV_B1 0RECV_B0 0B0 0B1"), ph.actions[1]])
        plan = replace(plan, phases=tuple(replace(p, actions=tuple(acts)) if i == 1 else p
                                          for i, p in enumerate(plan.phases)))
        want = "cannot parse action '0X1'" if case == "unknown-action" else "in another order than rank 1 sends"
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_json()))  # as written, past save_plan's own check
    x, y, m = bert.make_batch(64, generator=torch.Generator().manual_seed(0))
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, tmp_path / "data.pt")
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "plan.json"), "--model", "bert-tiny", "--nproc-per-node",
                                 str(plan.world_size), "--data", str(tmp_path / "data.pt"), "--dry-run"])
    assert r.exit_code == 2, r.output
    assert want in r.output and r.output.count("\n") == 1, r.output
    field = "phases[0].M" if case == "1f1b-M<K-no-actions" else "phases[1].actions"
    assert r.output.startswith("error: ") and f"field '{field}'" in r.output, r.output
