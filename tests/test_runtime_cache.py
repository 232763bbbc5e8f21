"""The AutoCache in real elastic runs (forked gloo processes): same weights as recomputing, hits, cleanup, refusals.

The run: bert-tiny (4 blocks, 11 layers at half granularity), 16 samples, global batch 4, 5 epochs
of 4 steps with frozen blocks 0, 1, 1, 2, 2 per epoch. Phase f=1 (3 frozen layers) is K=2 with rank
1 as stage 0 and caches; phase f=2 (5 frozen layers) is K=1, D=2 and caches, so both ranks read
rows that rank 1 wrote, and epoch 3 refreshes every row from 3 to 5 layers (incremental refresh).
Per epoch the cache must see: -, 16 misses, 16 hits, 16 refreshes, 16 hits.

Bit-identical weights with and without the cache are real, not luck, because the cache computes the
prefix micro-batch by micro-batch, on the very shapes the recomputing stage uses (``cache.py``'s
``prefix_forward``): torch does not promise a sample the same bits in batches of different sizes,
and on this CPU BERT's MLP gives other bits at micro-batch 1 than at 2 (a GEMM of 8 rows is blocked
differently from one of 16). For the same reason both cached phases use micro-batches of b = 2: a
refreshed row was computed up to the old count at the old phase's b. Where b changes between the
phase that cached a row and the one that refreshes it, the two runs agree to float32 rounding
only; ``test_refresh_across_micro_batch_sizes_agrees_to_rounding`` pins that case.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.loop import Hooks, run_training

pytestmark = pytest.mark.multiproc

SEQ, N = 8, 16
TRAJECTORY = [0, 1, 1, 2, 2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _build(dropout: float = 0.0, name: str = "bert-tiny"):
    return build_model(name, seq_len=SEQ, granularity="half", dropout=dropout, seed=0)


def _plan(model, trajectory=TRAJECTORY, world: int = 2, b2: int = 2):
    """``b2``: the micro-batch size of the last phase (the first cached phase has b = 2)."""
    if world == 4:  # K=4 -> K=2,D=2 (two stage-0 ranks write at once) -> K=1,D=4, with 1F1B
        return make_plan(model, [spec(0, K=4, D=1, M=4, b=2), spec(1, K=2, D=2, M=2, b=2, ranks=((3, 1), (0, 2)),
                                                                 cache=True),
                                 spec(2, K=1, D=4, M=2 // b2, b=b2, cache=True)],
                         trajectory=trajectory, samples_per_epoch=N, schedule="1f1b")
    return make_plan(model, [spec(0, K=2, D=1, M=2, b=2),
                             spec(1, K=2, D=1, M=2, b=2, ranks=((1, 0),), cache=True),
                             spec(2, K=1, D=2, M=2 // b2, b=b2, cache=True)],
                     trajectory=trajectory, samples_per_epoch=N)


def _run(tmp, *, cache: str, dropout: float = 0.0, dataset_cls=TensorDataset, noisy_layer: int | None = None,
         trajectory=TRAJECTORY, steps_per_epoch=None, name: str = "bert-tiny", world: int = 2, b2: int = 2,
         **cfg_kw):
    """One run of ``world`` processes; returns (result, {step: weights} from rank 0's snapshots, run-log
    path, cache dir)."""
    os.makedirs(tmp, exist_ok=True)
    model = _build(dropout, name)
    plan = _plan(model, trajectory, world, b2)
    data = dataset_cls(*model.make_batch(N, generator=torch.Generator().manual_seed(123)))
    if noisy_layer is not None:
        model.layers[noisy_layer] = _Noisy(model.layers[noisy_layer])
    cache_dir = os.path.join(tmp, "ram")
    if not os.path.isdir(cache_dir):
        os.makedirs(cache_dir)
    cfg = RunConfig(plan="(test)", model=name, optimizer="sgd", lr=0.05, seed=0, progress=False,
                    timeout_s=30, log=os.path.join(tmp, "run.jsonl"), cache=cache, cache_dir=cache_dir,
                    steps_per_epoch=steps_per_epoch, **cfg_kw)

    def worker(rank: int, world: int) -> None:
        def save(event: str, step: int, weights) -> None:
            torch.save(weights, os.path.join(tmp, f"snap-{step}-{event}.pt"))

        run_training(cfg, plan, model, data, hooks=Hooks(snapshots=True, on_snapshot=save))

    res = run_world(world, worker, tmpdir=tmp, timeout_s=30, deadline_s=90)
    snaps = {int(f.split("-")[1]): torch.load(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("snap-")}
    return res, snaps, cfg.log, cache_dir


class _Noisy(nn.Module):
    """A layer that is random even in eval mode (what the repeat-run check must catch)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, attention_mask=None):
        y = self.inner(x, attention_mask=attention_mask)
        return y + 1e-3 * torch.randn_like(y)


class _AugmentedDataset(TensorDataset):
    random_augmentation = True


def _assert_same_weights(a: dict, b: dict, steps) -> None:
    for step in steps:
        for k in b[step]:
            assert torch.equal(a[step][k], b[step][k]), f"after {step} steps: {k} differs"


def _cache_records(log: str) -> list[dict]:
    return [r for r in read_records(log) if r["type"] == "cache"]


@pytest.fixture(scope="module")
def recomputed(tmp_path_factory):
    """The reference: the same run with --cache off."""
    tmp = str(tmp_path_factory.mktemp("off"))
    res, snaps, log, _ = _run(tmp, cache="off")
    assert res.ok, res.explain()
    return snaps, log


def test_cached_run_gives_the_same_weights_hits_and_leaves_no_files(recomputed, tmp_path):
    ref_snaps, ref_log = recomputed
    res, snaps, log, cache_dir = _run(str(tmp_path), cache="auto")
    assert res.ok, res.explain()
    # start, the transitions 0->1 (step 4) and 1->2 (step 12), the end: all bit-identical
    assert sorted(snaps) == sorted(ref_snaps) == [0, 4, 12, 20]
    _assert_same_weights(snaps, ref_snaps, [4, 12, 20])
    steps, ref_steps = ([r for r in read_records(p) if r["type"] == "step"] for p in (log, ref_log))
    assert [s["loss"] for s in steps] == [s["loss"] for s in ref_steps]
    assert [(s["frozen_blocks"], s["K"], s["D"]) for s in steps][::4] == [(0, 2, 1), (1, 2, 1), (1, 2, 1), (2, 1, 2),
                                                                         (2, 1, 2)]
    recs = _cache_records(log)
    assert [r["epoch"] for r in recs] == [0, 1, 2, 3, 4]
    got = [(r["frozen_layers"], r["misses"], r["hits"], r["refreshes"]) for r in recs]
    assert got == [(0, 0, 0, 0), (3, 16, 0, 0), (3, 0, 16, 0), (5, 0, 0, 16), (5, 0, 16, 0)], got
    assert all(r["rows_not_cached"] == 0 and r["disk_bytes"] == 0 for r in recs)
    assert recs[4]["ram_slabs"] == 1 and recs[4]["ram_bytes"] >= N * SEQ * 64 * 4  # only the 5-layer rows left
    assert recs[3]["slabs_evicted"] == 1  # the 3-layer slab went once all its rows were refreshed
    setup = next(r for r in read_records(log) if r["type"] == "cache_setup")
    assert setup["phases"] == [1, 2] and setup["frozen_layers"] == [3, 5] and setup["notes"] == []
    assert setup["dir"].startswith(cache_dir) and setup["budget_bytes"] == setup["need_bytes"] > 0
    assert os.listdir(cache_dir) == []  # every slab and directory removed
    assert not any(r["type"] == "cache" for r in read_records(ref_log))  # --cache off: no cache at all


def test_four_processes_gpt2_1f1b_cached_equals_recomputed(tmp_path):
    """GPT-2 (causal mask), 1F1B, 4 processes: 8-sample global batches, 2 steps per epoch."""
    kw = dict(name="gpt2-tiny", world=4)
    a = _run(str(tmp_path / "on"), cache="auto", **kw)
    b = _run(str(tmp_path / "off"), cache="off", **kw)
    assert a[0].ok and b[0].ok, a[0].explain() + b[0].explain()
    assert sorted(a[1]) == sorted(b[1]) == [0, 2, 6, 10]
    _assert_same_weights(a[1], b[1], [2, 6, 10])
    got = [(r["misses"], r["hits"], r["refreshes"]) for r in _cache_records(a[2])]
    assert got == [(0, 0, 0), (16, 0, 0), (0, 16, 0), (0, 0, 16), (0, 16, 0)], got
    assert os.listdir(a[3]) == []


def test_refresh_across_micro_batch_sizes_agrees_to_rounding(tmp_path):
    """The last phase at b = 1: epoch 3 refreshes rows that phase f=1 computed up to 3 layers at b = 2,
    while recomputation runs those 3 layers at b = 1, which BERT's GEMMs round differently here (see
    the module docstring). Everything before the refresh stays bit-identical; after it the weights
    agree to float32 rounding (measured here: 2.3e-7 relative; the bound leaves 40x room)."""
    a = _run(str(tmp_path / "on"), cache="auto", b2=1)
    b = _run(str(tmp_path / "off"), cache="off", b2=1)
    assert a[0].ok and b[0].ok, a[0].explain() + b[0].explain()
    _assert_same_weights(a[1], b[1], [4, 12])
    for k, ref in b[1][20].items():
        rel = ((a[1][20][k] - ref).abs().max() / ref.abs().max().clamp_min(0.02)).item()
        assert rel <= 1e-5, f"{k}: relative difference {rel:.2e}"
    got = [(r["misses"], r["hits"], r["refreshes"]) for r in _cache_records(a[2])]
    assert got == [(0, 0, 0), (16, 0, 0), (0, 16, 0), (0, 0, 16), (0, 16, 0)], got


def test_spilled_cache_gives_the_same_weights(recomputed, tmp_path):
    """A zero RAM budget with a spill directory: every slab lives on disk, results unchanged."""
    ref_snaps, _ = recomputed
    spill = str(tmp_path / "spill")
    res, snaps, log, cache_dir = _run(str(tmp_path / "run"), cache="auto", cache_budget=0, cache_spill_dir=spill)
    assert res.ok, res.explain()
    _assert_same_weights(snaps, ref_snaps, [4, 12, 20])
    recs = _cache_records(log)
    assert [r["hits"] for r in recs] == [0, 0, 16, 0, 16]
    assert recs[4]["ram_bytes"] == 0 and recs[4]["disk_slabs"] == 1
    assert os.listdir(cache_dir) == [] and os.listdir(spill) == []


def test_a_full_cache_folder_recomputes_with_a_warning_and_the_same_weights(recomputed, tmp_path, capfd):
    """The cache's RAM folder on a real 8 KiB tmpfs (a slab needs more): no slab can be created, so every
    row is recomputed, the run says so once per folder on stderr and counts it in its cache records,
    and the weights equal the uncached run's."""
    import subprocess
    ram = tmp_path / "ram"
    ram.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k,mode=0777", "tmpfs", str(ram)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        res, snaps, log, cache_dir = _run(str(tmp_path), cache="auto")
    finally:
        subprocess.run(["umount", "-l", str(ram)], capture_output=True)
    assert res.ok, res.explain()
    _assert_same_weights(snaps, recomputed[0], [4, 12, 20])
    recs = _cache_records(log)
    assert recs and all(r["hits"] == 0 for r in recs)
    assert sum(r.get("disk_full") or 0 for r in recs) > 0, recs
    out = capfd.readouterr().out  # the forked ranks print to this process's stdout
    assert "activation cache's folder" in out and "is full" in out, out


def test_dropout_in_the_model_is_no_reason_to_refuse(tmp_path):
    """The frozen prefix runs in eval mode either way, so caching it changes nothing even with dropout."""
    kw = dict(dropout=0.1, trajectory=[1, 1], steps_per_epoch=2, shuffle=False)
    a = _run(str(tmp_path / "on"), cache="auto", **kw)
    b = _run(str(tmp_path / "off"), cache="off", **kw)
    assert a[0].ok and b[0].ok, a[0].explain() + b[0].explain()
    _assert_same_weights(a[1], b[1], [4])
    assert [r["hits"] for r in _cache_records(a[2])] == [0, 8]


@pytest.mark.parametrize("case", ["augmented-data", "random-prefix"])
def test_nondeterministic_prefix_is_refused_before_training(case, tmp_path):
    kw = dict(dataset_cls=_AugmentedDataset) if case == "augmented-data" else dict(noisy_layer=1)
    res, _, log, cache_dir = _run(str(tmp_path), cache="auto", trajectory=[1], steps_per_epoch=1, **kw)
    assert res.exitcodes == (1, 1), res.explain()
    want = "random_augmentation=True" if case == "augmented-data" else "two eval-mode runs on the same sample differ"
    for err in res.errors:  # the same clear message on every rank
        assert "PtplanError: cannot cache the frozen prefix" in err and want in err, err
        assert "--cache-allow-nondeterministic" in err and "--cache off" in err
    assert not os.path.exists(log)  # refused before the first step: a new run log is written only from it
    assert os.listdir(cache_dir) == []


@pytest.mark.parametrize("case", ["augmented-data", "random-prefix"])
def test_nondeterministic_prefix_is_accepted_with_the_flag(case, tmp_path):
    kw = dict(dataset_cls=_AugmentedDataset) if case == "augmented-data" else dict(noisy_layer=1)
    res, _, log, cache_dir = _run(str(tmp_path), cache="auto", trajectory=[1], steps_per_epoch=1,
                                  cache_allow_nondeterministic=True, **kw)
    assert res.ok, res.explain()
    setup = next(r for r in read_records(log) if r["type"] == "cache_setup")
    assert setup["allow_nondeterministic"] and setup["notes"]
    assert [r["misses"] for r in _cache_records(log)] == [4]
    assert os.listdir(cache_dir) == []


# ---- ptplan run's options (no processes) ----------------------------------------------------------

def test_ptplan_run_cache_options_reach_the_config(tmp_path):
    import json
    import shlex

    from click.testing import CliRunner

    from ptplan.cli.main import cli
    from ptplan.planner.plan import save_plan

    plan_path = tmp_path / "plan.json"
    save_plan(_plan(_build()), plan_path)
    base = ["run", str(plan_path), "--model", "bert-tiny", "--nproc-per-node", "2", "--dry-run"]
    r = CliRunner().invoke(cli, base + ["--cache-dir", str(tmp_path), "--cache-budget", "1.5GiB",
                                        "--cache-spill-dir", str(tmp_path / "spill"), "--cache-allow-nondeterministic"])
    assert r.exit_code == 0, r.output
    argv = shlex.split(r.output.strip().splitlines()[-1])
    cfg = json.loads(argv[argv.index("--config") + 1])
    assert (cfg["cache"], cfg["cache_dir"], cfg["cache_budget"], cfg["cache_allow_nondeterministic"]) == (
        "auto", str(tmp_path), int(1.5 * 2**30), True)
    assert cfg["cache_spill_dir"] == str(tmp_path / "spill")
    r = CliRunner().invoke(cli, base + ["--cache", "off"])
    assert r.exit_code == 0 and '"cache": "off"' in r.output, r.output
    r = CliRunner().invoke(cli, base + ["--cache-budget", "lots"])
    assert r.exit_code == 2 and "--cache-budget 'lots': expected a size such as 8GiB" in r.output, r.output
    r = CliRunner().invoke(cli, base + ["--cache-dir", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "--cache-dir" in r.output and "no such directory" in r.output, r.output
