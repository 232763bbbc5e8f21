"""The frozen prefix under tensor parallelism and FSDP (issue 14) runs split and sharded for real: stage 0 of an
uncached phase with tp > 1 runs its prefix layers' Megatron twins (``hybrid.ShardedStage``, the canonical storage
released), and with FSDP on stage 0 (D > 1) the prefix layers are ``fully_shard``-ed over its data-parallel
group, all-gathered in the no-grad forward and never reduce-scattered -- 4 forked gloo processes through
transitions into and out of those phases (the frozen count growing 0 -> 1 -> 2), equal to the single-process
reference of ``tests/test_runtime_parity.py``; per rank and step, every prefix parameter's local size is its
full size / tp (split) or / D (sharded).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import spec
from parity import assert_parity, once
from tests.test_hybrid_runtime import _mixed_plan
from tests.test_runtime_parity import COUNTS, OPT, SEED, STEPS_PER_PHASE, TOL, _build, _data, reference


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _plan(kind: str):
    """Three phases (frozen blocks 0, 1, 2; micro-batches per global batch 4, 4, 8: the reference's) whose
    middle one has a frozen prefix under ``kind``; the first has none, the last runs it plain."""
    specs = {"tp": [spec(0, K=4, D=1, M=4, b=2), spec(1, K=2, D=1, M=4, b=2), spec(2, K=1, D=4, M=2, b=1)],
             "fsdp": [spec(0, K=4, D=1, M=4, b=2), spec(1, K=2, D=2, M=2, b=2), spec(2, K=2, D=2, M=4, b=1)],
             "tp-fsdp": [spec(0, K=4, D=1, M=4, b=2), spec(1, K=1, D=2, M=2, b=2), spec(2, K=1, D=4, M=2, b=1)]}
    strategies = {"tp": [(1, False, False), (2, False, False), (1, False, False)],
                  # FSDP on stage 0 only (the prefix's stage), stage 1 plain data parallel
                  "fsdp": [(1, False, False), (1, (True, False), False), (1, False, False)],
                  "tp-fsdp": [(1, False, False), (2, True, False), (1, False, False)]}
    return lambda model: _mixed_plan(model, specs[kind], strategies[kind])


def _prefix_report(rank: int) -> dict | None:
    """On a rank running stage 0 with a frozen prefix: per prefix layer, whether it has a Megatron split, its
    canonical storage (numel: 0 when released), and per parameter (local numel, full numel, has a gradient)."""
    from parity import live_runtime
    from ptplan.executor.runtime.elastic import ElasticRuntime
    from ptplan.executor.runtime.hybrid import tp_plan

    rt = live_runtime()
    assert isinstance(rt, ElasticRuntime), type(rt)
    mod = rt.module
    if rt.groups.place.stage != 0 or not len(mod.prefix):
        return None
    from torch.distributed.tensor import DTensor, Replicate

    def sharded_on(p, dim: str) -> bool:  # FSDP's dp placement on a 2-D mesh is a _StridedShard
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        return dim in names and not isinstance(p.placements[names.index(dim)], Replicate)

    out = []
    for i, layer in enumerate(mod.prefix):
        canon = rt.model.layers[i]
        out.append({"split": tp_plan(canon, 2) is not None,
                    "canonical": sum(p.numel() for p in canon.parameters()),
                    "params": [(getattr(p, "_local_tensor", p).numel(), p.numel(), p.shape[0], sharded_on(p, "tp"),
                                sharded_on(p, "dp"), p.grad is not None) for p in layer.parameters()]})
    return {"tp": rt.phase.tp, "D": rt.phase.D, "fsdp0": bool(rt.phase.fsdp_at(0)), "layers": out}


_COUNTED = ("all_gather_single", "reduce_scatter_single")


def _count_collectives() -> dict[str, int]:
    """In a child process: count FSDP2's ``_COUNTED`` collectives from now on (the returned dict, by name)."""
    import torch.distributed as dist

    calls = {k: 0 for k in _COUNTED}
    for k in _COUNTED:
        real = getattr(dist, k)

        def counted(*a, _k=k, _real=real, **kw):
            calls[_k] += 1
            return _real(*a, **kw)
        setattr(dist, k, counted)
    return calls


def _run(name, optimizer, data, tmp, plan, model):
    """The parity run (``testing.recorded_run``), recording per rank after each step its prefix (``_prefix_report``)."""
    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.data.dataset import TensorDataset
    from parity import recorded_run

    o = OPT[optimizer]
    cfg = RunConfig(plan="(test)", model=name, optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                    weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=SEED,
                    freeze_every=STEPS_PER_PHASE, steps_per_epoch=len(COUNTS), epochs=1, progress=False,
                    timeout_s=60, log=os.path.join(tmp, "run.jsonl"), cache="off")
    snaps, reports = recorded_run(cfg, plan, model, TensorDataset(*data), world=4, tmpdir=tmp,
                                  record=lambda step, r: [step, _prefix_report(r)])
    return snaps, cfg.log, reports


def _check_shards(plan, reports) -> int:
    """Every prefix parameter on every stage-0 rank is split (/ tp) and/or sharded (/ D) as the phase says;
    none has a gradient; a split or sharded layer's canonical storage is released. Returns the reports checked."""
    checked = 0
    for r, rows in reports.items():
        assert [x[0] for x in rows] == list(range(1, 7))
        for step, rep in rows:
            ph = plan.phases[COUNTS[step - 1]]
            if rep is None:
                continue
            checked += 1
            tp, D = ph.tp, (ph.D if ph.fsdp_at(0) else 1)
            assert len(rep["layers"]) == ph.frozen_layers
            for lay in rep["layers"]:
                split = tp > 1 and lay["split"]
                total = sum(full for _, full, *_ in lay["params"])
                assert lay["canonical"] == (0 if split or D > 1 else total), (r, step, lay)  # released while split
                n_split = 0
                for loc, full, dim0, on_tp, on_dp, grad in lay["params"]:
                    assert not grad, (r, step, lay)  # frozen: no gradient, so nothing to reduce-scatter
                    assert on_tp == (split and on_tp) and on_dp == (D > 1), (r, step, lay)
                    whole = full // tp if on_tp else full  # the tp rank's part
                    assert not on_tp or whole * tp == full
                    n_split += on_tp
                    if D == 1:
                        assert loc == whole, (r, step, loc, full)
                    else:  # FSDP shards dim 0 over D (padded: the last shard may be short)
                        assert loc * D <= whole + D * (full // dim0) and loc < whole, (r, step, loc, whole)
                assert (n_split > 0) == split, (r, step, lay)  # every split layer's projections are split
    return checked


def _check_prefix_bytes(name, plan, reports) -> int:
    """The prefix's bytes each stage-0 rank holds (fp32: 4 per element) against the stage model's prefix weights
    term (``StageModel.stage0_static`` under the phase's tp and stage 0's FSDP, the profile measured here): equal,
    up to the one approximation ``strategy_table`` makes for every split layer, active or frozen -- it divides a
    split layer's whole weight by tp, while its norms and row-parallel biases stay whole on each tp rank."""
    from functools import lru_cache

    from ptplan.executor.profiling.profiler import profile_model
    from ptplan.planner.cluster import cpu_cluster
    from ptplan.planner.costs import CostTable
    from ptplan.planner.schedule import peak_inflight
    from ptplan.planner.stage import PhaseShape, StageModel, links_for
    from ptplan.planner.strategy import tp_allreduce_coeffs

    @lru_cache(maxsize=None)
    def table() -> CostTable:
        return CostTable(profile_model(_build(name), device="cpu", batch_sizes=(1, 2), warmup=0, repeats=1,
                                       progress=False))

    checked = 0
    for rows in reports.values():
        for step, rep in rows:
            ph = plan.phases[COUNTS[step - 1]]
            if rep is None or not (ph.tp > 1 or ph.fsdp_at(0) and ph.D > 1):
                continue
            D = ph.D if ph.fsdp_at(0) else 1
            shape = PhaseShape(K=ph.K, M=ph.M, b=ph.micro_batch_size, D=ph.D, frozen=ph.frozen_layers, cache=False,
                               inflight=peak_inflight(ph.schedule, ph.K, ph.M), optimizer="adamw",
                               device_is_host=True, tp=ph.tp, fsdp=bool(ph.fsdp_at(0)),
                               tp_ar=tp_allreduce_coeffs(cpu_cluster(4), ph.tp))
            predicted = StageModel(table(), shape, links_for(cpu_cluster(ph.world), ph.K)).stage0_static
            held = 4 * sum(loc for lay in rep["layers"] for loc, *_ in lay["params"])
            whole = 4 * sum(full for lay in rep["layers"] for _, full, *_ in lay["params"])
            replicated = 4 * sum(full for lay in rep["layers"] if ph.tp > 1 and lay["split"]
                                 for _, full, _, on_tp, *_ in lay["params"] if not on_tp)
            assert held == predicted + replicated * (1 - 1 / ph.tp) / D, (step, held, predicted, replicated)
            assert held < whole and float(table().cum_param[ph.frozen_layers]) == whole
            checked += 1
    return checked


PLANS = ["tp", "fsdp", "tp-fsdp"]


@pytest.mark.multiproc
@pytest.mark.parametrize("kind,name,optimizer", [(k, n, o) for k in PLANS for n, o in
                                                 (("bert-tiny", "sgd"), ("bert-tiny", "adamw"),
                                                  ("gpt2-tiny", "sgd"), ("gpt2-tiny", "adamw"))])
def test_split_and_sharded_prefix_matches_reference(kind, name, optimizer, tmp_path):
    model = _build(name)  # the ranks train forked copies; this one stays as built
    data = _data(model)
    plan = _plan(kind)(model)
    assert plan.phases[1].frozen_layers > 0 and not plan.phases[1].cache
    snaps, log, reports = _run(name, optimizer, data, str(tmp_path), plan, model)
    # every step with a frozen prefix, on each of its stage-0 ranks (D pipelines x tp)
    want = sum(plan.phases[f].D * plan.phases[f].tp for f in COUNTS if plan.phases[f].frozen_layers)
    assert _check_shards(plan, reports) == want
    assert _check_prefix_bytes(name, plan, reports) == sum(plan.phases[1].D * plan.phases[1].tp for f in COUNTS if f == 1)
    ref, ref_losses = once(("reference", name, optimizer), lambda: reference(name, optimizer, data))
    assert sorted(snaps) == [0, 2, 4, 6], sorted(snaps)
    worst = assert_parity(snaps, ref, (2, 4, 6), TOL[optimizer])
    print(f"parity frozen prefix {kind} {name} {optimizer}: max relative difference {worst:.1e}")
    steps = [x for x in read_records(log) if x["type"] == "step"]
    for x, want_loss in zip(steps, ref_losses):
        assert math.isclose(x["loss"], want_loss, rel_tol=1e-5), (x["step"], x["loss"], want_loss)


@pytest.mark.multiproc
def test_a_frozen_fsdp_layer_all_gathers_under_no_grad_and_never_reduce_scatters(tmp_path):
    """A frozen layer (requires_grad off) ``fully_shard``-ed over 2 ranks, run under ``no_grad`` before a
    trainable layer whose backward runs: its output equals the whole layer's, it is all-gathered in the
    forward (FSDP2's ``all_gather_single``) and nothing is reduce-scattered (``reduce_scatter_single``)."""
    from ptplan.executor.launch.local import run_world

    def worker(rank: int, world: int) -> None:
        import copy

        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        calls = _count_collectives()
        model = _build("bert-tiny")
        x, _, mask = model.make_batch(4, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            h = model.layers[0](x, attention_mask=mask)
            want = model.layers[1](h, attention_mask=mask)
        frozen = copy.deepcopy(model.layers[1]).requires_grad_(False).eval()
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh=[0, 1], mesh_dim_names=("dp",))
        fully_shard(frozen, mesh=mesh, reshard_after_forward=True)  # as ``hybrid.ShardedStage`` shards the prefix
        local = sum(p.to_local().numel() for p in frozen.parameters())
        full = sum(p.numel() for p in frozen.parameters())
        with torch.no_grad():
            got = frozen(h, attention_mask=mask)
        torch.testing.assert_close(got, want)
        # sharded again after the forward (the gathered weights freed), not kept whole
        assert sum(getattr(p, "_local_tensor", p).numel() for p in frozen.parameters()) == local
        model.layers[2](got, attention_mask=mask).float().pow(2).mean().backward()
        assert all(p.grad is None for p in frozen.parameters())
        with open(os.path.join(str(tmp_path), f"calls-{rank}.json"), "w") as fh:
            json.dump([calls, local, full], fh)

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    for r in range(2):
        calls, local, full = json.load(open(tmp_path / f"calls-{r}.json"))
        assert calls["all_gather_single"] >= 1 and calls["reduce_scatter_single"] == 0, calls
        assert local * 2 <= full + 2 * 16, (local, full)  # each rank holds about half (dim 0 padded per tensor)


@pytest.mark.multiproc
def test_an_active_fsdp_layer_is_resharded_between_its_forward_and_backward(tmp_path):
    """``hybrid.shard_layer`` as the runtime shards a trainable layer over 2 ranks: after each micro-batch's
    forward the layer holds only its shard (FSDP2 would keep a root layer's gathered weights until the
    backward, so a stage with micro-batches in flight would hold its layers whole, against the stage
    model's weights / D); each backward all-gathers again and reduce-scatters once: 2 all-gathers and 1
    reduce-scatter per micro-batch, as ``planner/strategy.py`` prices it; gradients equal the whole layer's."""
    from ptplan.executor.runtime.hybrid import shard_layer
    from ptplan.executor.launch.local import run_world

    def worker(rank: int, world: int) -> None:
        import copy

        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        calls = _count_collectives()
        model = _build("bert-tiny")
        x, _, mask = model.make_batch(6, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            h = model.layers[0](x, attention_mask=mask)
        whole = copy.deepcopy(model.layers[1]).train()
        layer = copy.deepcopy(model.layers[1]).train()
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh=[0, 1], mesh_dim_names=("dp",))
        shard_layer(layer, mesh)
        local = sum(p.to_local().numel() for p in layer.parameters())
        full = sum(p.numel() for p in layer.parameters())
        M, held = 3, []
        mbs = h.chunk(M)
        outs = []
        for m in range(M):  # every micro-batch's forward first (GPipe), each sharded again after it
            outs.append(layer(mbs[m], attention_mask=mask.chunk(M)[m]))
            held.append(sum(getattr(p, "_local_tensor", p).numel() for p in layer.parameters()))
        gathers_fwd = calls["all_gather_single"]
        for o in outs:
            o.float().pow(2).mean().backward()
        for m in range(M):
            whole(mbs[m], attention_mask=mask.chunk(M)[m]).float().pow(2).mean().backward()
        # FSDP averages the gradients over the 2 ranks, which ran the same data here
        for (n, p), q in zip(layer.named_parameters(), whole.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7, msg=n)
        with open(os.path.join(str(tmp_path), f"active-{rank}.json"), "w") as fh:
            json.dump([calls, gathers_fwd, held, local, full], fh)

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    for r in range(2):
        calls, gathers_fwd, held, local, full = json.load(open(tmp_path / f"active-{r}.json"))
        assert held == [local] * 3 and local * 2 <= full + 2 * 16, (held, local, full)
        assert gathers_fwd == 3 and calls["all_gather_single"] == 6 and calls["reduce_scatter_single"] == 3, calls
