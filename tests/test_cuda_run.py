"""``ptplan run`` on a CUDA device (skipped without one; ``bench/gpu_check.sh`` runs it on a lent GPU).

One process, K = 1, D = 1, two phases (block 0 frozen after step 2), SGD in float32: the CUDA run's losses equal
the same command's on the CPU within float32 summation-order differences, each step records the device's peak
memory (``torch.cuda.max_memory_allocated``), and a bf16 autocast run on the GPU trains too."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.runtime.stage import LayerStore
from ptplan.executor.runtime.transition import DEVICE, HOST
from ptplan.executor.training.runlog import read_records
from ptplan.planner.plan import save_plan


def plan_file(d: Path, *, cache: bool = False) -> Path:
    """The two-phase plan; ``cache``: phase 1 reads its frozen prefix from the AutoCache."""
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=1, M=2, b=2), spec(1, K=1, D=1, M=2, b=2, cache=cache)],
                     trajectory=[0, 1], samples_per_epoch=8, optimizer="sgd")  # the runs' --optimizer
    path = d / ("plan-cache.json" if cache else "plan.json")
    save_plan(plan, path)
    return path


def run_cli(plan: Path, d: Path, device: str, *extra: str) -> list[dict]:
    """``ptplan run`` on ``device`` (2 epochs of 2 steps); the run log's step records."""
    log = d / f"run-{device}{'-'.join(extra)}.jsonl"
    cmd = [sys.executable, "-m", "ptplan.cli.main", "run", str(plan), "--model", "bert-tiny", "--nproc-per-node", "1",
           "--steps-per-epoch", "2", "--dropout", "0", "--optimizer", "sgd", "--lr", "0.05", "--device", device,
           "--log", str(log), "--timeout", "60", "--no-progress", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ptplan run: 4 steps" in r.stdout, r.stdout
    return [rec for rec in read_records(log) if rec["type"] == "step"]


@pytest.mark.gpu
def test_a_cuda_run_equals_the_cpu_run_and_records_device_memory(tmp_path):
    plan = plan_file(tmp_path)
    gpu = run_cli(plan, tmp_path, "cuda")
    cpu = run_cli(plan, tmp_path, "cpu")
    assert [(s["epoch"], s["phase"], s["frozen_blocks"]) for s in gpu] == \
        [(s["epoch"], s["phase"], s["frozen_blocks"]) for s in cpu] == [(0, 0, 0), (0, 0, 0), (1, 1, 1), (1, 1, 1)]
    # float32 both: the kernels sum in other orders (relative rounding ~1e-7 per addition, a few hundred
    # additions deep in a 4-step run of a 128-wide model), far inside 1e-4; a wrong device path is off by far more
    for g, c in zip(gpu, cpu):
        assert math.isclose(g["loss"], c["loss"], rel_tol=1e-4), (g["loss"], c["loss"])
    sampled = [s for s in gpu if s.get("memory_sampled")]
    assert sampled and all(s["peak_memory_bytes"] > 0 for s in sampled), gpu
    bf16 = run_cli(plan, tmp_path, "cuda", "--precision", "bf16")
    # autocast: bfloat16 matmuls (8 mantissa bits, relative ~4e-3 per rounding) on the same weights
    assert all(math.isfinite(s["loss"]) for s in bf16)
    assert math.isclose(bf16[0]["loss"], gpu[0]["loss"], rel_tol=2e-2), (bf16[0]["loss"], gpu[0]["loss"])


@pytest.mark.gpu
def test_a_caching_cuda_run_equals_the_cpu_run(tmp_path):
    """Phase 1 caches: on the GPU its frozen prefix lives in (pinned) host memory and is streamed through the device
    at each fill step; the losses are the CPU run's, as in the plain run above."""
    plan = plan_file(tmp_path, cache=True)
    (tmp_path / "cache-gpu").mkdir()
    (tmp_path / "cache-cpu").mkdir()
    gpu = run_cli(plan, tmp_path, "cuda", "--cache-dir", str(tmp_path / "cache-gpu"))
    cpu = run_cli(plan, tmp_path, "cpu", "--cache-dir", str(tmp_path / "cache-cpu"))
    assert [s["phase"] for s in gpu] == [s["phase"] for s in cpu] == [0, 0, 1, 1]
    assert all(s.get("cache_misses", 0) + s.get("cache_hits", 0) > 0 for s in gpu[2:]), gpu  # the cache served
    for g, c in zip(gpu, cpu):
        assert math.isclose(g["loss"], c["loss"], rel_tol=1e-4), (g["loss"], c["loss"])


@pytest.mark.gpu
def test_held_host_layers_of_a_cuda_rank_are_pinned():
    """``pin`` page-locks a CUDA rank's host layer with its values, whether it was built there or moved there from
    the device; ``place`` alone (a gather's or a resume's receive buffer) leaves host storage pageable."""
    model = build_model("bert-tiny", seq_len=8)
    want = [p.detach().clone() for p in model.layers[1].parameters()]
    store = LayerStore(model.layers, torch.device("cuda"))
    assert store.pins and store.where[1] == HOST and not any(p.is_pinned() for p in model.layers[1].parameters())
    store.pin(1)
    assert all(p.is_pinned() for p in model.layers[1].parameters())
    store.place(1, DEVICE, keep_values=True)
    store.pin(1)  # on the device: nothing to do
    assert all(p.device.type == "cuda" for p in model.layers[1].parameters())
    store.place(1, HOST, keep_values=True)
    assert not any(p.is_pinned() for p in model.layers[1].parameters())
    store.pin(1)
    got = list(model.layers[1].parameters())
    assert all(p.is_pinned() for p in got) and all(torch.equal(a, b) for a, b in zip(got, want))
    store.release(2)
    store.place(2, HOST, keep_values=False)
    assert not any(p.is_pinned() for p in model.layers[2].parameters())
    assert not store.unlocked
    store.release(1)  # a pinned layer let go: its blocks go back to the system at the next trim
    assert store.unlocked
    store.trim()
    assert not store.unlocked
