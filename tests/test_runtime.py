"""Runtime pieces in one process: layouts, transfer planning, data sharding, validation errors, config."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import (SyntheticDataset, TensorDataset, epoch_order, global_batch_ids, iterate,
                                  load_dataset, shard)
from ptplan.executor.runtime.groups import locate
from ptplan.executor.families.models import build_model
from ptplan.executor.runtime.optim import ensure_state, make_optimizer
from ptplan.executor.handplan import even_partition, make_plan, spec
from ptplan.executor.runtime.transition import DEVICE, HOST, holdings, needs, owned_layers, plan_transfers, sources
from ptplan.executor.training.validate import check_plan, frozen_boundary, model_fingerprint
from ptplan.planner.errors import PtplanError



@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield

@pytest.fixture(scope="module")
def bert():
    return build_model("bert-tiny", seq_len=8, dropout=0.0)


@pytest.fixture(scope="module")
def plan(bert):
    return make_plan(bert, [spec(0, K=4, D=1, M=4, b=2), spec(1, K=2, D=2, M=2, b=2, ranks=((2, 0), (3, 1))),
                            spec(2, K=1, D=4, M=2, b=1)], trajectory=[0, 1, 2])


# ---- layout and transfers ---------------------------------------------------------------------

def test_locate_and_owned_layers(plan):
    ph = plan.phases[1]
    assert locate(ph, 2).pipeline == 0 and locate(ph, 2).stage == 0
    assert locate(ph, 1).pipeline == 1 and locate(ph, 1).stage == 1
    lo, hi = ph.partition[1]
    assert owned_layers(ph, 0, 11) == list(range(lo, hi))


def test_even_partition():
    assert even_partition(3, 11, 2) == ((3, 7), (7, 11))
    assert even_partition(0, 11, 4) == ((0, 2), (2, 5), (5, 8), (8, 11))
    with pytest.raises(ValueError):
        even_partition(9, 11, 4)


def test_frozen_layers_are_needed_by_stage_0_and_kept_active_ones_by_their_dp_group(plan):
    ph = plan.phases[1]  # 1 frozen block = 3 frozen layers; stage 0 on ranks 2 and 3
    need = needs(ph, 11)
    assert need[0] == need[2] == need[3] == frozenset({2, 3})
    assert need[10] == frozenset(ph.dp_groups()[1]) == frozenset({0, 1})


def test_a_rank_holds_its_stage_and_on_stage_0_the_prefix_where_the_phase_keeps_it(plan):
    ph = plan.phases[1]  # stage 0 = [3, 7) on ranks 2 and 3, stage 1 = [7, 11) on ranks 0 and 1
    assert holdings(ph, 2, 11, cached_prefix=False) == {i: DEVICE for i in range(7)}
    assert holdings(ph, 3, 11, cached_prefix=True) == {**{i: HOST for i in range(3)}, **{i: DEVICE for i in range(3, 7)}}
    assert holdings(ph, 0, 11, cached_prefix=True) == {i: DEVICE for i in range(7, 11)}
    for rank in range(4):  # holdings and needs say the same thing
        held = holdings(ph, rank, 11, cached_prefix=False)
        assert {i for i in range(11) if rank in needs(ph, 11)[i]} == set(held)
    ts = plan_transfers([frozenset({0})] * 11, needs(ph, 11), [1] * 11)
    assert sources(ts, 0) == set(range(11)) and sources(ts, 1) == set()


def test_plan_transfers_covers_needs_and_spreads_sources():
    have = [frozenset({0, 1}), frozenset({0, 1}), frozenset({2})]
    need = [frozenset({0, 1, 2, 3})] * 3
    ts = plan_transfers(have, need, [10, 10, 10])
    got = {(t.dst, layer) for t in ts for layer in t.layers}
    assert got == {(2, 0), (3, 0), (2, 1), (3, 1), (0, 2), (1, 2), (3, 2)}
    srcs_of_layer0 = {t.src for t in ts if 0 in t.layers}
    assert srcs_of_layer0 == {0, 1}  # both replicas of the old stage send
    assert all(t.src in have[layer] for t in ts for layer in t.layers)


def test_plan_transfers_nothing_to_do_and_missing_holder():
    assert plan_transfers([frozenset({0})], [frozenset({0})], [1]) == []
    with pytest.raises(ValueError, match="no rank holds it"):
        plan_transfers([frozenset()], [frozenset({1})], [1])


def test_frozen_boundary_and_fingerprint(bert):
    assert [frozen_boundary(bert, f) for f in range(5)] == [0, 3, 5, 7, 9]
    assert model_fingerprint(bert) == model_fingerprint(build_model("bert-tiny", seq_len=8, dropout=0.0))
    assert model_fingerprint(bert) != model_fingerprint(build_model("bert-tiny", seq_len=8, num_labels=3))


def test_fingerprint_matches_the_profile_contract(bert):
    from ptplan.planner.profile import LayerRecord, Profile

    recs = [LayerRecord(index=i, name=s.name, kind=s.kind, block=s.block,
                        params=sum(p.numel() for p in layer.parameters()), param_bytes=0, grad_bytes=0,
                        optimizer_bytes=0, output_bytes_per_sample=0, saved_bytes_per_sample=0, forward_s=(0.0,),
                        backward_s=(0.0,), nograd_forward_s=(0.0,))
            for i, (layer, s) in enumerate(zip(bert.layers, bert.specs))]
    prof = Profile.__new__(Profile)
    object.__setattr__(prof, "layers", tuple(recs))
    assert Profile.fingerprint(prof) == model_fingerprint(bert)


# ---- data ---------------------------------------------------------------------------------------

def test_shards_union_is_the_global_batch():
    order = epoch_order(48, seed=0, epoch=3)
    assert sorted(order.tolist()) == list(range(48))
    assert torch.equal(order, epoch_order(48, seed=0, epoch=3))
    assert not torch.equal(order, epoch_order(48, seed=0, epoch=4))
    ids = global_batch_ids(order, 16, 8)
    assert torch.equal(torch.cat([shard(ids, 4, p) for p in range(4)]), ids)
    with pytest.raises(ValueError):
        shard(ids, 3, 0)
    with pytest.raises(ValueError):
        global_batch_ids(order, 44, 8)


def test_synthetic_data_is_deterministic_per_sample_id(bert):
    a = SyntheticDataset(bert, 20, seed=5)
    b = SyntheticDataset(bert, 20, seed=5)
    xa, ya, ma = a.batch(torch.tensor([7, 3, 11]))
    xb, yb, mb = b.batch(torch.tensor([3]))
    assert torch.equal(xa[1:2], xb) and torch.equal(ya[1:2], yb) and torch.equal(ma[1:2], mb)
    assert xa.shape == (3, 8) and ya.shape == (3,)
    first = next(iterate(a))
    assert first[0] == 0 and first[1].shape == (1, 8)
    vit = build_model("vit-tiny")
    x, y, m = SyntheticDataset(vit, 4).batch(torch.arange(4))
    assert x.shape == (4, 3, 32, 32) and m is None


def test_load_dataset_pt_and_npz(tmp_path):
    x, y, m = torch.randint(0, 9, (6, 4)), torch.arange(6), torch.ones(6, 4, dtype=torch.long)
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, tmp_path / "d.pt")
    ds = load_dataset(tmp_path / "d.pt")
    assert len(ds) == 6 and torch.equal(ds.batch(torch.tensor([2]))[0], x[2:3])
    np.savez(tmp_path / "d.npz", inputs=x.numpy(), labels=y.numpy())
    ds = load_dataset(tmp_path / "d.npz")
    assert ds.batch(torch.tensor([1, 2]))[2] is None
    np.savez(tmp_path / "bad.npz", inputs=x.numpy())
    with pytest.raises(PtplanError, match="lacks"):
        load_dataset(tmp_path / "bad.npz")
    with pytest.raises(PtplanError, match="disagree"):
        TensorDataset(x, y[:3])


# ---- optimizer state -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_eager_state_equals_lazy_state(kind):
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    v = w.detach().clone().requires_grad_(True)
    a, b = make_optimizer([w], kind, lr=0.1), make_optimizer([v], kind, lr=0.1)
    ensure_state(b, v)  # created eagerly, as a transition receiver would
    for _ in range(3):
        for p in (w, v):
            p.grad = torch.sin(p.detach() * 3)
        a.step()
        b.step()
    assert torch.equal(w, v)


# ---- validation before training -----------------------------------------------------------------

def test_world_size_mismatch_is_refused(plan, bert):
    with pytest.raises(PtplanError, match=r"the plan needs K\*D = 4\*1 = 4 processes but this job has 2"):
        check_plan(plan, bert, 2)


def test_model_mismatch_is_refused(plan):
    vit = build_model("vit-tiny")
    with pytest.raises(PtplanError, match="the plan is for bert-tiny .* but the model is vit-tiny"):
        check_plan(plan, vit, 4)
    other = build_model("bert-tiny", seq_len=8, num_labels=3)
    with pytest.raises(PtplanError, match="fingerprint"):
        check_plan(plan, other, 4)
    blocks = build_model("bert-tiny", seq_len=8, granularity="block")
    with pytest.raises(PtplanError, match="granularity|num_layers"):
        check_plan(plan, blocks, 4)


def test_batch_that_does_not_split_is_refused(bert):
    p = make_plan(bert, [spec(0, K=2, D=2, M=2, b=2), spec(1, K=1, D=4, M=1, b=2)])  # 8 vs 8: ok
    check_plan(p, bert, 4)
    bad = [spec(0, K=2, D=2, M=2, b=2), spec(1, K=1, D=4, M=3, b=1)]  # 12 samples
    with pytest.raises(PtplanError, match=r"phases\[1\]\.M.*D\*M\*b = 4\*3\*1 = 12 samples per step but the plan's "
                                          r"global batch is 8"):
        make_plan(bert, bad)  # the plan reader refuses it (every command that reads plans)
    with pytest.raises(PtplanError, match=r"cannot split the global batch of 8 samples into D\*M = 4\*3 = 12"):
        check_plan(make_plan(bert, bad, check=False), bert, 4)  # and so does the executor's own check


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused(bert):
    with pytest.raises(PtplanError, match=r"phases\[0\]\.M.*1F1B needs at least as many micro-batches as stages: M=2 < K=4"):
        make_plan(bert, [spec(0, K=4, D=1, M=2, b=4)], schedule="1f1b")  # the plan reader
    p = make_plan(bert, [spec(0, K=4, D=1, M=2, b=4)], schedule="1f1b", check=False)
    with pytest.raises(PtplanError, match=r"plan phase 0 .*1F1B needs at least as many micro-batches as stages: M=2 < K=4"):
        check_plan(p, bert, 4)  # the executor's own check


def test_run_config_checks():
    with pytest.raises(PtplanError, match="optimizer"):
        RunConfig(plan="p", model="m", optimizer="lamb")
    with pytest.raises(PtplanError, match="--resume needs --checkpoint-dir"):
        RunConfig(plan="p", model="m", resume=True)
    cfg = RunConfig(plan="p", model="m", freeze="adaptive", alpha=0.5)
    assert RunConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(PtplanError, match="unknown keys"):
        RunConfig.from_json('{"plan": "p", "model": "m", "bogus": 1}')
