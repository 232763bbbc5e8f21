"""A sent tensor is freed once its receiver is known to have it, not at the end of the step (or, under 2BW, of
the phase).

The step interpreter's sends are asynchronous; before, it held every sent tensor until the step ended (a flushed
schedule: M activations and M input gradients a stage, where the stage model prices the micro-batches in
flight) or, under 2BW, until the phase's drain -- gloo's sends report completion only to ``wait``, so
``reap(wait=False)`` never let one go and the held tensors grew by 2M a step for the whole phase. The proof that
a message arrived is ``planner.schedule.delivered_by``: a position holding message X from P knows P received
every message sent to it before the last one P had received when it sent X (a receive blocks; messages between
two positions arrive in order). Found as a memory under-prediction: docs/strategies.md's run measured the last
stage's activations at 4.30 MB against 3.45 MB predicted (M = 32 input gradients held).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import warnings

import pytest
import torch

from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.profiling.profiler import profile_model
from ptplan.executor.runtime.step import StepInterpreter
from ptplan.executor.runtime.twobw import stretches
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.executor.training.runlog import read_records
from ptplan.planner.cluster import cpu_cluster
from ptplan.planner.costs import CostTable
from ptplan.planner.schedule import (SCHEDULE_NAMES, ActionKind, build_schedule, delivered_by, message_of,
                                     terapipe, two_bw)
from ptplan.planner.schedule import peak_inflight, peak_stashed
from ptplan.planner.stage import PhaseShape, StageModel, links_for

SEQ = 8


def _schedules():
    for name in SCHEDULE_NAMES:
        for K in (1, 2, 3, 4):
            for M in (1, 2, 3, 5, 8):
                for V in ((2, 3) if name in ("interleaved-1f1b", "looped-bfs") else (2,) if name == "zb-v" else (1,)):
                    try:
                        yield name, build_schedule(name, K, M, V), [build_schedule(name, K, M, V).actions]
                    except Exception:  # a (K, M, V) the schedule does not take
                        continue
    for K, M, S in ((2, 2, 3), (3, 4, 2), (4, 1, 4)):
        s = terapipe(K, M, S)
        yield "terapipe", s, [s.actions]
    for K, M in ((2, 2), (2, 4), (3, 3), (4, 5)):
        s = two_bw(K, M)
        cut = [stretches(acts, M, s.minibatches)[0] for acts in s.actions]
        yield "2bw", s, [[parts[t] for parts in cut] for t in range(s.minibatches)]


def test_a_proof_names_a_prefix_of_what_the_receiver_sent_and_its_sender_had_received():
    """Brute force over every generated schedule (and 2BW's stretches, the lists its steps run): for each message X
    from P to Q, the set of Q's messages P had received before sending X (read from P's list) is exactly Q's
    sends to P up to ``delivered_by``'s answer, in Q's send order -- so releasing that send and every earlier one
    to P frees only what arrived."""
    n = 0
    for name, sched, steps in _schedules():
        s2r = sched.stage_to_rank
        proofs = {}
        for lists in steps:
            proofs.update(delivered_by(lists, s2r))
        # each position's sends to each peer, in order, over the whole of its lists (2BW: stretch after stretch)
        order: dict[tuple[int, int], list] = {}
        for q in range(len(steps[0])):
            for lists in steps:
                for a in lists[q]:
                    m = message_of(a, s2r)
                    if m is not None and a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                        order.setdefault((m[0], m[1]), []).append(m[2])
        for p in range(len(steps[0])):
            had: dict[int, list] = {}  # peer -> its messages p received so far, in order (2BW: over the stretches)
            for lists in steps:
                here: set[int] = set()  # peers p received from in this list
                for a in lists[p]:
                    m = message_of(a, s2r)
                    if m is None:
                        continue
                    src, dst, msg = m
                    if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                        had.setdefault(src, []).append(msg)
                        here.add(src)
                        continue
                    got, sent = had.get(dst, []), order.get((dst, p), [])
                    assert got == sent[:len(got)], (name, sched.K, sched.M)  # received in the order sent
                    want = proofs.get(msg)
                    if want is None:
                        assert dst not in here, (name, sched.K, sched.M, msg)
                    else:
                        assert sent.index(want) + 1 == len(got), (name, sched.K, sched.M, msg, want)
                        n += 1
    assert n > 1000  # the proofs above were exercised, not skipped


def test_1f1b_two_positions_by_hand():
    """K = 2, M = 3 1F1B. Position 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 RECV_B2 B2; position 1:
    RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 RECV_F2 F2 B2 SEND_B2. Position 0 sends F2 after receiving B0, so
    position 1, holding F2, knows B0 arrived; F0 and F1 prove nothing (position 0 had received nothing). Position 1
    sends B<m> after receiving F<m>: position 0, holding B<m>, knows F0 .. F<m> arrived."""
    s = build_schedule("1f1b", 2, 3)
    assert delivered_by(s.actions, s.stage_to_rank) == {
        ("F", 0, 2, 0): ("B", 1, 0, 0),
        ("B", 1, 0, 0): ("F", 0, 0, 0), ("B", 1, 1, 0): ("F", 0, 1, 0), ("B", 1, 2, 0): ("F", 0, 2, 0)}


# ---- on real processes --------------------------------------------------------------------------------------

def _interpreter() -> StepInterpreter:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = [o for o in gc.get_objects() if isinstance(o, StepInterpreter)]
    assert len(found) == 1, len(found)
    return found[0]


def _run(tmp, plan, steps: int, *, log_pending: bool):
    model = build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0)
    cfg = RunConfig(plan="(test)", model="bert-tiny", optimizer="adamw", lr=1e-3, seed=0, progress=False,
                    steps_per_epoch=steps, epochs=1, timeout_s=60, log=os.path.join(tmp, "run.jsonl"))
    data = TensorDataset(*model.make_batch(plan.phases[0].global_batch * steps,
                                           generator=torch.Generator().manual_seed(1)))

    def worker(rank: int, world: int) -> None:
        out = open(os.path.join(tmp, f"pending-{rank}.jsonl"), "w")

        def after(step: int, r: int) -> None:
            if log_pending:
                out.write(json.dumps({"step": step, "pending": len(_interpreter().msgs.pending)}) + "\n")
                out.flush()

        run_training(cfg, plan, model, data, hooks=Hooks(after_step=after))

    res = run_world(2, worker, tmpdir=tmp, timeout_s=60, deadline_s=150)
    assert res.ok, res.explain()
    pending = {r: [json.loads(x) for x in open(os.path.join(tmp, f"pending-{r}.jsonl"))] for r in range(2)}
    return model, read_records(cfg.log), pending


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule,recompute,layers,M", [
    ("1f1b", False, 0, 16), ("gpipe", False, 0, 16), ("2bw", False, 0, 16), ("1f1b", True, 0, 16),
    ("gpipe", True, 0, 64), ("2bw", True, 0, 16), ("zb-h1", False, 0, 16), ("zb-h1", True, 0, 16),
    ("1f1b", True, 1, 16), ("zb-h1", True, 1, 16), ("2bw", True, 1, 16)])
def test_many_micro_batches_peak_within_the_stage_model(tmp_path, one_torch_thread, schedule, recompute, layers, M):
    """K = 2, M micro-batches of 1, with and without recomputation (``layers``: of each stage's first layers only,
    which under ZB-H1 B rebuilds once for itself and W): every rank's measured peak
    (``memory.StepMemory``) at most the stage model's; also no further under it than the backward's accumulate term
    (``tests/test_runtime_memory.py``'s bound; under ZB-H1 plus the stash of the most micro-batches between B and
    W), and the static terms exact. Held sends put 1F1B's last stage over
    it before (1,869,604 bytes against 1,845,554). 2BW (sampled at its 4th step, the first with its optimizer
    state and both weight versions) was measured with one weight version and no optimizer state, and priced with
    one gradient where it holds two. A recomputing stage was priced with its input per micro-batch in flight but
    not its output, which the runtime holds until the micro-batch's backward: GPipe's stage 0 at M = 64 measured
    3,709,076 bytes against 3,641,888. Under ZB-H1 a recomputing stage's B rebuilds the graph its W reads (before,
    every backward pass recomputed it: the last stage measured 2,573,376 bytes against 1,849,666); and its W
    frees each parameter group's weight gradients before the next group's are made (torch's one call kept two
    groups' at once: the last stage without recomputation measured 2,038,272 bytes against 2,004,892). GPipe's
    activations without recomputation are over-predicted here (by 8-10 %, the safe side; not this test's class), so
    only its upper bound is checked."""
    model = build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0)
    steps = 5 if schedule == "2bw" else 2
    plan = make_plan(model, [spec(0, K=2, D=1, M=M, b=1)], schedule=schedule, samples_per_epoch=M * steps)
    if recompute:
        plan = dataclasses.replace(plan, phases=tuple(dataclasses.replace(
            p, recompute=True, recompute_layers=(layers,) * p.K) for p in plan.phases))
    _, records, _ = _run(str(tmp_path), plan, steps, log_pending=False)
    prof = profile_model(build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0),
                         device="cpu", batch_sizes=(1, 2), warmup=0, repeats=1, progress=False)
    table = CostTable(prof)
    ph = plan.phases[0]
    twobw = schedule == "2bw"
    shape = PhaseShape(K=ph.K, M=ph.M, b=ph.micro_batch_size, D=ph.D, frozen=ph.frozen_layers, cache=ph.cache,
                       inflight=peak_inflight(ph.schedule, ph.K, ph.M), optimizer="adamw", device_is_host=True,
                       weight_versions=2 if twobw else 1, own_p2p=twobw, recompute=recompute, recompute_layers=layers,
                       stashed=peak_stashed(ph.schedule, ph.K, ph.M))
    predicted = StageModel(table, shape, links_for(cpu_cluster(2), ph.K)).stage_memory(ph.partition)
    (rec,) = [r for r in records if r["type"] == "step" and r.get("memory_sampled")]
    assert rec["step"] == (4 if twobw else 2) - 1, rec["step"]  # records count steps from 0
    for rank, got in enumerate(rec["memory"]["per_rank"]):
        s = next(row.index(rank) for row in ph.ranks if rank in row)
        lo, hi = ph.partition[s]
        counters = 4 * sum(1 for i in range(lo, hi) for _ in model.layers[i].parameters())
        # the peak need not fall where a backward accumulates, nor (zero-bubble) where the most micro-batches wait
        # between B and W, each holding what its B left for its W (the stage model adds both at their largest)
        stashed = peak_stashed(ph.schedule, ph.K, ph.M)[s]
        slack = float(table.accumulate_bytes[lo:hi].max()) + stashed * ph.micro_batch_size * float(
            table.stash_per_sample[lo:hi].sum())
        want = predicted[s]
        where = (schedule, recompute, layers, rank)
        assert (got["params"], got["grads"], got["optimizer"] - counters, got["buffers"]) == (
            want.weights, want.gradients, want.optimizer, want.buffers), where
        assert got["total"] - counters <= want.total, (where, got["total"] - counters, want.total)
        if schedule != "gpipe" or recompute:
            assert want.total - slack <= got["total"] - counters, (where, got["total"] - counters, want.total)


@pytest.mark.multiproc
def test_2bw_sends_do_not_pile_up_over_a_phase(tmp_path, one_torch_thread):
    """2BW, K = 2, M = 4, 24 steps (three times its 8-mini-batch window) on gloo: the sends still held after each
    step stay as few as after the first steps, on both ranks. Before, they grew by 2M a step (8 per step, 192+
    after 24) until the phase's drain."""
    model = build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0)
    plan = make_plan(model, [spec(0, K=2, D=1, M=4, b=2, schedule="2bw")], schedule="2bw", samples_per_epoch=8 * 24)
    _, _, pending = _run(str(tmp_path), plan, 24, log_pending=True)
    for rank, rows in pending.items():
        counts = [r["pending"] for r in rows]
        assert len(counts) == 24, (rank, counts)
        assert max(counts) <= 2 * 4 + 2, (rank, counts)  # at most one mini-batch's messages and their headers
        assert max(counts[8:]) <= max(counts[:8]), (rank, counts)
