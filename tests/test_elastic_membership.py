"""Re-plan on membership change (issue 23 item 3): two ``ptplan run`` launchers on this machine form one job through a
c10d rendezvous on loopback (``--nnodes 1:2``, one process each); the one that does not host the rendezvous store is
SIGKILLed after the first checkpoint. The survivor's worker fails on the lost peer, torchrun restarts it alone, it
plans again for one process from the plan's profile, resumes from the sharded checkpoint and finishes.

Pinned: the run log holds both plans and a ``membership`` record (2 -> 1 processes, the step resumed from), the
re-planned plan is written beside the log, ``ptplan compare`` reads the log against either plan, and the final
weights equal a reference that ran the same steps with the same data order on the same world sizes (2 processes to
the checkpoint, then the existing resume path on 1 process with the re-planned plan) within
tests/test_sharded_checkpoint.py's tolerance.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from parity import max_rel_diff
from ptplan.cli.main import cli
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.config import RunConfig
from ptplan.planner.cluster import cpu_cluster
from ptplan.planner.config import TrainingConfig
from ptplan.planner.errors import PtplanError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.plan import load_plan, save_plan
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import load_profile
from ptplan.planner.runlog import read_run_log
from ptplan.profiles import shipped

TOL = 1e-5
"""tests/test_sharded_checkpoint.py's tolerance (another world size sums the gradients in another order)."""
STEPS_PER_EPOCH, EPOCHS = 4, 8
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
"""Seconds, not torch's defaults (30 s for more nodes, 15 s to drop a lost one): the restart takes ~1-2 s."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_job(folder: Path, policy: str = "constant-global") -> Path:
    """bert-tiny's shipped CPU profile planned for cpu:2 (4 steps of 8 samples per epoch, freezing per epoch)."""
    path = shipped("bert-tiny_cpu_fp32")
    training = TrainingConfig(epochs=EPOCHS, samples_per_epoch=8 * STEPS_PER_EPOCH, batch=8, optimizer="sgd",
                              batch_policy=policy)
    plan = make_plan(load_profile(path), cpu_cluster(2), training, FreezePolicy(policy="geometric", alpha=0.5),
                     profile_path=str(path))
    save_plan(plan, folder / "plan.json")
    return folder / "plan.json"


def run_args(plan: Path, folder: Path, port: int, conf: str = RDZV_CONF) -> list[str]:
    return [str(plan), "--model", "bert-tiny", "--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}", "--rdzv-conf", conf,
            "--max-restarts", "2", "--checkpoint-dir", str(folder / "ck"), "--checkpoint-format", "sharded",
            "--checkpoint-every", str(STEPS_PER_EPOCH), "--optimizer", "sgd", "--lr", "0.05", "--dropout", "0",
            "--cache", "off", "--timeout", "30", "--no-progress", "--log", str(folder / "run.jsonl")]


def _wait_joined(store: Any, rdzv_id: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until a node has joined the rendezvous ``rdzv_id``: its state in the store is no longer the c10d backend's
    empty sentinel."""
    key = f"torch.rendezvous.{rdzv_id}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"node 1 ended early: {proc.communicate()}")
        if store.check([key]) and store.get(key) != b"Y2FuaW1hZGFt":
            return
        time.sleep(0.05)
    raise AssertionError("node 1 never joined the rendezvous")


def _poll(log: Path, pred: Any, timeout: float, procs: list[subprocess.Popen]) -> list[dict[str, Any]]:
    """The run log's whole lines once ``pred(records)`` holds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        recs = []
        if log.exists():
            for line in log.read_text().splitlines():
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    break
        if pred(recs):
            return recs
        if procs[0].poll() is not None:
            raise AssertionError(f"node 0 ended before the expected record: {procs[0].communicate()}")
        time.sleep(0.02)
    for p in procs:
        p.kill()
    raise AssertionError(f"timed out waiting for the run log ({timeout} s)")


def _first_new_step(recs: list[dict[str, Any]]) -> bool:
    seen = [i for i, r in enumerate(recs) if r["type"] == "membership"]
    return bool(seen) and any(r["type"] == "step" for r in recs[seen[0]:])


def two_nodes_one_killed(folder: Path, plan: Path) -> dict[str, Any]:
    """Two launchers joined through a rendezvous store this process hosts (so that neither launcher's end takes the
    store away): node 1 joins first and waits up to 60 s for more nodes, node 0 then completes the round (both
    nodes in the first round, whatever their start-up times). SIGKILL node 1's launcher once the first checkpoint
    is committed; node 0 re-rendezvous alone after its own 1 s last call. Returns the survivor's exit, its output
    and the seconds from the kill to its first new step."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(last_call: int) -> subprocess.Popen:
        conf = RDZV_CONF.replace("last_call_timeout=1", f"last_call_timeout={last_call}") + ",is_host=false"
        args = run_args(plan, folder, port, conf=conf)
        return subprocess.Popen([sys.executable, "-m", "ptplan.cli.main", "run", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    node1 = start(60)
    _wait_joined(store, f"job{port}", node1)
    node0 = start(1)
    log = folder / "run.jsonl"
    _poll(log, lambda rs: any(r["type"] == "checkpoint" for r in rs), 90, [node0, node1])
    node1.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _poll(log, lambda rs: any(r["type"] == "membership" for r in rs), 90, [node0, node1])
    membership_s = time.monotonic() - killed
    _poll(log, _first_new_step, 90, [node0, node1])
    first_new_step_s = time.monotonic() - killed
    out, err = node0.communicate(timeout=120)
    node1.communicate(timeout=30)
    del store
    return {"code": node0.returncode, "out": out, "err": err, "first_new_step_s": first_new_step_s, "membership_s": membership_s,
            "node1_code": node1.returncode}


def worker_config(plan: Path, folder: Path) -> RunConfig:
    """The RunConfig ``ptplan run`` hands its workers for these arguments (its --dry-run command's --config)."""
    r = CliRunner().invoke(cli, ["run", *run_args(plan, folder, free_port()), "--dry-run"])
    assert r.exit_code == 0, r.output
    argv = shlex.split(r.output.strip().splitlines()[-1])
    return RunConfig.from_json(argv[argv.index("--config") + 1])


def _train(rank: int, world: int, cfg: RunConfig) -> None:
    from ptplan.executor.launch.worker import run_job

    run_job(cfg, torch.device("cpu"))


def reference(folder: Path, cfg: RunConfig, replanned: str, at: int) -> None:
    """The same steps on the same world sizes through the existing resume path: 2 processes with the job's plan to
    step ``at`` (its last checkpoint), then 1 process resuming it with the re-planned plan to the end."""
    ck, log = str(folder / "ref-ck"), str(folder / "ref.jsonl")
    first = dataclasses.replace(cfg, epochs=at // STEPS_PER_EPOCH, checkpoint_dir=ck, log=log)
    res = run_world(2, _train, args=(first,), tmpdir=str(folder), timeout_s=30, deadline_s=120)
    assert res.ok, res.explain()
    rest = dataclasses.replace(cfg, plan=replanned, checkpoint_dir=ck, log=log, resume=True)
    res = run_world(1, _train, args=(rest,), tmpdir=str(folder), timeout_s=30, deadline_s=120)
    assert res.ok, res.explain()


def final_weights(ck: Path) -> dict[str, torch.Tensor]:
    """The model weights of a run's last sharded checkpoint (read in this process)."""
    meta = json.loads((ck / "sharded.json").read_text())
    folder = str(ck / meta["folder"])
    md = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    sd = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items() if not k.startswith("optim.")}
    dcp.load(sd, checkpoint_id=folder, no_dist=True)
    return sd


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_lost_node_replans_resumes_and_equals_the_reference(tmp_path, one_torch_thread):
    plan = make_job(tmp_path)
    got = two_nodes_one_killed(tmp_path, plan)
    assert got["code"] == 0, got
    print(f"kill of node 1 -> the survivor's first new step: {got['first_new_step_s']:.2f} s")
    log = read_run_log(tmp_path / "run.jsonl")
    (m,) = log.memberships
    assert (m["from"]["world_size"], m["to"]["world_size"]) == (2, 1)
    assert m["from"]["plan"] == str(plan) and m["from"]["plan_id"] != m["to"]["plan_id"]
    replanned = m["to"]["plan"]
    assert replanned == str(tmp_path / "run.plan-world1.json") and load_plan(replanned).world_size == 1
    assert [p["K"] * p["D"] for p in m["to"]["phases"]] == [1] * len(m["to"]["phases"])
    at = m["step"]
    assert at > 0 and at % STEPS_PER_EPOCH == 0 and [r["step"] for r in log.resumes] == [at]
    assert [s.step for s in log.steps] == list(range(EPOCHS * STEPS_PER_EPOCH))  # each step once
    assert {s.K * s.D for s in log.steps if s.step < at} == {2} and {s.K * s.D for s in log.steps if s.step >= at} == {1}
    for p, ours in ((plan, at), (Path(replanned), EPOCHS * STEPS_PER_EPOCH - at)):  # compare reads it against both
        r = CliRunner().invoke(cli, ["compare", str(p), str(tmp_path / "run.jsonl")])
        assert r.exit_code == 0 and "membership changed at step" in r.output, r.output
        assert f"{EPOCHS * STEPS_PER_EPOCH - ours} step(s) ran another plan" in r.output, r.output

    reference(tmp_path, worker_config(plan, tmp_path), replanned, at)
    want, have = final_weights(tmp_path / "ref-ck"), final_weights(tmp_path / "ck")
    assert sorted(want) == sorted(have)
    d, where = max_rel_diff(have, want)
    assert d <= TOL, (d, where)


def test_a_varying_node_count_needs_what_a_re_plan_needs(tmp_path):
    plan = make_job(tmp_path)
    args = run_args(plan, tmp_path, free_port())

    def refused(*change: str, drop: tuple[str, ...] = ()) -> str:
        a = list(args)
        for flag in drop:
            i = a.index(flag)
            del a[i:i + 2]
        r = CliRunner().invoke(cli, ["run", *a, *change, "--dry-run"])
        assert r.exit_code != 0, r.output
        return r.output

    assert "the node count cannot vary without an elastic rendezvous" in refused("--rdzv-backend", "static")
    out = refused("--checkpoint-format", "single", "--max-restarts", "0")
    assert "--checkpoint-format sharded" in out and "--max-restarts 1 or more" in out, out
    assert "--checkpoint-every N" in refused(drop=("--checkpoint-every",))
    assert "expected KEY=VALUE pairs" in refused("--rdzv-conf", "last_call_timeout")
    moved = tmp_path / "moved.json"
    obj = json.loads(plan.read_text())
    obj["inputs"]["profile"]["path"] = str(tmp_path / "gone" / "bert-tiny_cpu_fp32.json")
    moved.write_text(json.dumps(obj))
    r = CliRunner().invoke(cli, ["run", str(moved), *args[1:], "--dry-run"])
    assert r.exit_code != 0 and "the profile file of" in r.output and "is not found" in r.output, r.output
    (tmp_path / "pp").mkdir()
    per_pipeline = make_job(tmp_path / "pp", "constant-pipeline")
    r = CliRunner().invoke(cli, ["run", str(per_pipeline), *args[1:], "--dry-run"])
    assert r.exit_code != 0 and "constant-global batch policy (this one's is constant-pipeline" in r.output, r.output
    r = CliRunner().invoke(cli, ["run", *args, "--dry-run"])
    assert r.exit_code == 0 and "--nnodes=1:2" in r.output and f"--rdzv-conf={RDZV_CONF}" in r.output, r.output


def test_every_world_size_the_range_allows_is_re_planned_before_launch(tmp_path):
    """An audit's elastic job planned with --start-K 2 launched fine and, on losing a node, died re-planning for 1
    process (--start-K 2 must divide the 1 GPUs). Now the launcher makes every re-plan the range allows before any
    process starts, and a --start-K that does not divide a new world is left to the search (``replan.for_world``)."""
    from ptplan.executor.launch.replan import ReplanSettings, for_world, replan

    path = shipped("bert-tiny_cpu_fp32")
    training = TrainingConfig(epochs=EPOCHS, samples_per_epoch=8 * STEPS_PER_EPOCH, batch=8, optimizer="sgd",
                              start_K=2)
    plan = make_plan(load_profile(path), cpu_cluster(2), training, FreezePolicy(policy="geometric", alpha=0.5),
                     profile_path=str(path))
    assert plan.phases[0].K == 2
    save_plan(plan, tmp_path / "plan.json")
    args = run_args(tmp_path / "plan.json", tmp_path, free_port())
    r = CliRunner().invoke(cli, ["run", *args, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert for_world(training, 1).start_K is None and for_world(training, 4).start_K == 2
    one = replan(plan, ReplanSettings(profile=str(path), strategies="off", token_slices="off",
                                      log=str(tmp_path / "run.jsonl")), 1, 1)
    assert one.world_size == 1 and one.phases[0].K == 1
    # a range reaching a world the global batch of 8 cannot feed is refused before launch, naming it
    a = list(args)
    a[a.index("1:2")] = "1:16"
    r = CliRunner().invoke(cli, ["run", *a, "--dry-run"])
    assert r.exit_code == 2 and "--nnodes 1:16 lets the job shrink or grow to 6 node(s), 6 processes" in r.output
    assert "global batch 8 does not split over D=3 pipelines" in r.output, r.output


def test_the_cluster_for_the_new_world_keeps_the_device_kind():
    from ptplan.executor.launch.replan import cluster_for
    from ptplan.planner.cluster import PRESETS

    assert cluster_for(cpu_cluster(2), 1, 1).world_size == 1
    paper = cluster_for(PRESETS["paper"], 8, 8)  # one of the paper's two nodes lost
    assert (paper.nodes, paper.gpus_per_node, paper.gpu_name) == (1, 8, "Quadro RTX 5000")
    assert paper.inter_bandwidth == PRESETS["paper"].inter_bandwidth
    with pytest.raises(PtplanError, match="not a whole number of nodes"):
        cluster_for(PRESETS["paper"], 12, 8)
    # a CPU cluster keeps its links and overheads (an audit found them replaced by this machine's cpu:N preset);
    # its node's RAM is shared by the node's processes
    from dataclasses import replace

    own = replace(cpu_cluster(4), name="two-boxes", nodes=2, gpus_per_node=2, intra_bandwidth=5e9,
                  inter_bandwidth=5e9, action_overhead_s=40e-6, step_overhead_s=50e-6, host_memory_bytes=64 << 30,
                  gpu_memory_bytes=32 << 30)
    half = cluster_for(own, 2, 2)  # one of the two boxes lost
    assert (half.nodes, half.gpus_per_node, half.gpu_memory_bytes) == (1, 2, 32 << 30)
    assert (half.intra_bandwidth, half.action_overhead_s, half.step_overhead_s) == (5e9, 40e-6, 50e-6)
    alone = cluster_for(own, 2, 1)
    assert (alone.nodes, alone.gpu_memory_bytes, alone.concurrency_slowdown) == (2, 64 << 30, 1.0)


def _hand_plans() -> tuple[Any, Any]:
    from ptplan.executor.families.models import build_model
    from ptplan.executor.handplan import make_plan as hand_plan, spec

    model = build_model("bert-tiny", seq_len=8, dropout=0.0, seed=0)
    two = hand_plan(model, [spec(0, K=1, D=2, M=1, b=2)], samples_per_epoch=16)
    one = hand_plan(model, [spec(0, K=1, D=1, M=1, b=4)], samples_per_epoch=16)
    return two, one


def _side(plan: Any, path: str) -> dict[str, Any]:
    return {"world_size": plan.world_size, "plan_id": path[-6:], "plan": path,
            "phases": [dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M) for p in plan.phases]}


def test_compare_takes_each_plan_s_own_steps_around_a_membership_change(tmp_path):
    from ptplan.planner.compare import compare, format_comparison

    two, one = _hand_plans()
    log = tmp_path / "run.jsonl"

    def step(s: int, D: int) -> dict[str, Any]:
        return {"type": "step", "epoch": 0, "step": s, "phase": 0, "frozen_blocks": 0, "K": 1, "D": D,
                "seconds": 0.1, "samples": 4, "loss": 1.0, "memory_sampled": True, "peak_memory_bytes": 10,
                "memory": {"per_rank": [{"total": 10}] * D}}

    recs = [{"type": "header", "schema": "ptplan.runlog/1", "model": "bert-tiny", "world_size": 2,
             "phases": _side(two, "")["phases"]}, *[step(s, 2) for s in range(4)],
            {"type": "resume", "step": 2, "epoch": 0, "seconds": 0.1},
            {"type": "membership", "step": 2, "resumed": True, "attempt": 1, "from": _side(two, "/p/plan.json"),
             "to": _side(one, "/p/run.plan-world1.json"), "replan_seconds": 0.2}, *[step(s, 1) for s in range(2, 7)]]
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = read_run_log(log)  # the new world's per-rank memory rows (1) are checked against the membership's world
    assert [s.step for s in got.steps] == list(range(7)) and [m["step"] for m in got.memberships] == [2]
    before, after = compare(two, got, warmup=0), compare(one, got, warmup=0)
    assert (before.phases[0].steps, before.other_plan_steps) == (2, 5)
    assert (after.phases[0].steps, after.other_plan_steps) == (5, 2)
    text = format_comparison(after)
    assert "membership changed at step 2 (line 7): 2 processes" in text and "-> 1 process, plan" in text, text
    assert "2 step(s) ran another plan" in text
    three = dataclasses.replace(one, phases=(dataclasses.replace(one.phases[0], M=2),))
    with pytest.raises(PtplanError, match="compare the run with the plan it ran"):
        compare(three, got)
    bad = recs[:6] + [{**recs[6], "to": {**recs[6]["to"], "world_size": 2}}] + recs[7:]
    log.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(PtplanError, match=r"has 1 entries but the run's world has 2 ranks"):
        read_run_log(log)


def test_the_dtype_diagnosis_reads_a_step_of_the_plan_compared(tmp_path):
    """An audit's run changed membership and ``compare`` of the new plan said "the run's parameters take 0.66x the
    plan's weights ... not in the profile's dtype": it read the log's first memory-sampled step, the old plan's
    stage. It now reads a step the compared plan ran."""
    from ptplan.planner.compare import compare

    path = shipped("bert-tiny_cpu_fp32")
    training = TrainingConfig(epochs=1, samples_per_epoch=64, batch=8, optimizer="sgd")
    plans = {w: make_plan(load_profile(path), cpu_cluster(w), dataclasses.replace(training, start_K=w),
                          FreezePolicy(policy="none"), profile_path=str(path)) for w in (2, 1)}
    two, one = plans[2], plans[1]
    p2, p1 = two.phases[0], one.phases[0]

    def weights(p: Any) -> int:
        return sum(int(m.weights) for m in p.predicted.stage_memory)

    def step(s: int, p: Any, world: int, params: int) -> dict[str, Any]:  # one pipeline: rank = stage
        rows = [{"total": 10, "params": int(m.weights)} for m in p.predicted.stage_memory]
        return {"type": "step", "epoch": 0, "step": s, "phase": 0, "frozen_blocks": 0, "K": p.K, "D": p.D,
                "seconds": 0.1, "samples": p.global_batch, "loss": 1.0, "memory_sampled": True,
                "peak_memory_bytes": 10, "memory": {"per_rank": rows}}

    recs = [{"type": "header", "schema": "ptplan.runlog/1", "model": "bert-tiny", "world_size": 2,
             "plan_fingerprint": two.inputs.profile.fingerprint, "phases": _side(two, "")["phases"]},
            *[step(s, p2, 2, weights(p2)) for s in range(4)],
            {"type": "resume", "step": 2, "epoch": 0, "seconds": 0.1},
            {"type": "membership", "step": 2, "resumed": True, "attempt": 1, "from": _side(two, "/p/plan.json"),
             "to": _side(one, "/p/run.plan-world1.json"), "replan_seconds": 0.2},
            *[step(s, p1, 1, weights(p1)) for s in range(2, 7)]]
    assert (p2.K, p2.D, p1.K, p1.D) == (2, 1, 1, 1)  # the old plan's first stage is part of the new one's
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = compare(one, read_run_log(tmp_path / "run.jsonl"), warmup=0)
    assert not any("parameters take" in m for m in got.mismatches), got.mismatches
    assert not any("parameters take" in m for m in compare(two, read_run_log(tmp_path / "run.jsonl"),
                                                             warmup=0).mismatches)


def _membership_on_restart(rank: int, world: int, cfg: RunConfig, plan: Any, out: str) -> None:
    from ptplan.executor.launch.membership import plan_for_world

    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    got_cfg, got_plan, change = plan_for_world(cfg, plan, None)
    assert got_cfg is cfg and got_plan is plan
    Path(out).write_text(json.dumps(None if change is None else {"old": change.old, "new": change.new}))


@pytest.mark.multiproc
def test_a_restart_on_the_plan_s_own_world_from_another_world_s_checkpoint_is_a_membership_change(tmp_path):
    from ptplan.executor.training import checkpoint as ckpt, sharded

    two, one = _hand_plans()
    ck = tmp_path / "ck"
    (ck / "sharded-step00000004").mkdir(parents=True)
    (ck / "sharded-step00000004" / ".metadata").write_bytes(b"")
    out = str(tmp_path / "change.json")
    cfg = RunConfig(plan=str(tmp_path / "plan.json"), model="bert-tiny", checkpoint_dir=str(ck),
                    checkpoint_format="sharded")
    for saved_by, want in ((two, True), (one, False)):  # a checkpoint of 2 processes; then one of this world's
        meta = {"schema": sharded.SCHEMA, "folder": "sharded-step00000004", "plan_id": ckpt.plan_id(saved_by),
                "plan": ckpt.plan_identity(saved_by), "world_size": saved_by.world_size}
        (ck / sharded.META).write_text(json.dumps(meta))
        res = run_world(1, _membership_on_restart, args=(cfg, one, out), tmpdir=str(tmp_path), timeout_s=30,
                        deadline_s=60)
        assert res.ok, res.explain()
        change = json.loads(Path(out).read_text())
        if not want:
            assert change is None  # a restart on the same world: no membership change
            continue
        assert change["old"]["world_size"] == 2 and change["old"]["plan_id"] == ckpt.plan_id(two)
        assert change["old"]["phases"][0]["D"] == 2 and change["old"]["plan"] is None  # not a plan of this job
        assert change["new"] == {"world_size": 1, "plan_id": ckpt.plan_id(one), "plan": cfg.plan,
                                 "phases": [dict(frozen_blocks=0, K=1, D=1, tp=1, M=1, b=4,
                                                 schedule=one.phases[0].schedule)]}
