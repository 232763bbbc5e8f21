"""AutoCache: cached frozen-prefix outputs equal recomputation, are shared across processes, refresh
incrementally, spill past the budget, evict old counts, refuse nondeterministic prefixes, and clean up."""
from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
import torch
from torch import nn

from ptplan.executor.cache.autocache import ActivationCache, default_root, prefix_forward, prefix_sample_shape
from ptplan.executor.data.dataset import SyntheticDataset
from ptplan.executor.families.models import build_model
from ptplan.planner.errors import PtplanError

TOL = 1e-6


def _job() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _cache(model, root, n, *, budget=1 << 30, shard_rows=4, **kw) -> ActivationCache:
    return ActivationCache(root, job_id=kw.pop("job_id", _job()), create=True, sample_shape=prefix_sample_shape(model),
                           dtype=torch.float32, num_samples=n, budget_bytes=budget, shard_rows=shard_rows, **kw)


def _batch(model, n, seed=0):
    ds = SyntheticDataset(model, n, seed=seed)
    ids = torch.arange(n)
    x, _, mask = ds.batch(ids)
    return ids, x, mask


def _slabs(cache: ActivationCache) -> list[str]:
    out = []
    for d in (cache.dir, cache.spill_dir):
        if d and os.path.isdir(d):
            out += [n for n in os.listdir(d) if n.endswith(".slab")]
    return sorted(out)


# ---- correctness against recomputation ----------------------------------------------------------

@pytest.mark.parametrize("name", ["bert-tiny", "vit-tiny"])
def test_cached_prefix_equals_recomputation(tmp_path, name):
    model = build_model(name)
    ids, x, mask = _batch(model, 8)
    f = 5  # embedding + blocks 0-1 (half granularity)
    ref = prefix_forward(model, x, mask, ids, f)
    with _cache(model, tmp_path, 8) as cache:
        first = prefix_forward(model, x, mask, ids, f, cache)  # misses: computed and stored
        second = prefix_forward(model, x, mask, ids, f, cache)  # hits
        assert torch.equal(first, ref)
        assert torch.equal(second, ref)
        s = cache.stats()
        assert (s.misses, s.hits, s.refreshes, s.rows_written) == (8, 8, 0, 8)
        # the rest of the model on the cached prefix gives the model's own output
        full = model(x, mask)
        with torch.no_grad():
            rest = model.run_layers(second, f, len(model.layers), mask)
        assert torch.allclose(rest, full, atol=TOL, rtol=0)


def test_get_is_all_or_nothing_and_batches_across_shards(tmp_path):
    model = build_model("bert-tiny")
    ids, x, mask = _batch(model, 10)
    with _cache(model, tmp_path, 10, shard_rows=3) as cache:
        h = prefix_forward(model, x[:7], mask[:7], ids[:7], 3)
        assert cache.put(ids[:7], 3, h) == 7
        assert cache.put(ids[:7], 3, h) == 0  # already cached: left alone
        order = torch.tensor([6, 0, 4, 2])
        assert torch.equal(cache.get(order, 3), h[order])
        assert cache.get(torch.tensor([0, 8]), 3) is None  # 8 not cached -> whole batch misses
        assert cache.get(ids[:2], 5) is None  # other frozen count
        assert cache.lookup_partial(torch.tensor([1, 5]), 7) == 3
        assert cache.lookup_partial(torch.tensor([1, 9]), 7) is None
        assert cache.lookup_rows(torch.tensor([9, 1]), 7).tolist() == [-1, 3]


def test_rows_put_in_any_order_and_in_short_writes_read_back_exactly(tmp_path, monkeypatch):
    """``Slab.write`` sorts the rows into runs of consecutive slots and writes each through the descriptor until
    all of it is written: rows given out of order, with gaps, across shards, and a kernel that writes at most
    1,000 bytes per call, all read back bit for bit, and the slots never written stay unflagged."""
    import ptplan.executor.cache.store as store

    real = os.pwritev
    calls = []

    def short(fd, bufs, offset):  # at most 1,000 bytes of the first buffer per call, as pwritev may do
        calls.append(offset)
        return real(fd, [memoryview(bufs[0])[:1000]], offset)

    monkeypatch.setattr(store.os, "pwritev", short)
    n, shape = 12, (5, 64)  # 1,280-byte float32 rows: every row needs two calls
    with ActivationCache(tmp_path, job_id=_job(), create=True, sample_shape=shape, dtype=torch.float32,
                         num_samples=n, budget_bytes=1 << 20, shard_rows=5) as cache:
        ids = torch.tensor([7, 2, 3, 11, 0, 4, 9])  # shard 0: 2, 3, 0, 4 (a run 2-4 and 0); shard 1: 7, 9; shard 2: 11
        rows = torch.randn(ids.numel(), *shape)
        assert cache.put(ids, 2, rows) == ids.numel()
        assert len(calls) >= 2 * 5  # short writes were resumed (5 runs, each over 1,000 bytes)
        assert torch.equal(cache.get(ids, 2), rows)
        back = torch.tensor([4, 0, 11, 2])
        assert torch.equal(cache.get(back, 2), rows[[5, 4, 3, 1]])
        assert cache.lookup_rows(torch.arange(n), 2).tolist() == [2 if i in ids.tolist() else -1 for i in range(n)]


# ---- incremental refresh -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
def test_incremental_refresh_equals_full_recomputation(tmp_path, name):
    model = build_model(name)
    ids, x, mask = _batch(model, 8)
    c, f = 3, 7
    full = prefix_forward(model, x, mask, ids, f)
    with _cache(model, tmp_path, 8) as cache:
        prefix_forward(model, x, mask, ids, c, cache)
        assert _slabs(cache) == ["f0003-s000000.slab", "f0003-s000001.slab"]
        refreshed = prefix_forward(model, x, mask, ids, f, cache)
        assert (refreshed - full).abs().max().item() <= TOL
        s = cache.stats()
        assert (s.misses, s.refreshes, s.hits) == (8, 8, 0)
        # every shard was fully refreshed at f, so its slabs at c were dropped
        assert _slabs(cache) == ["f0007-s000000.slab", "f0007-s000001.slab"]
        assert s.slabs_evicted == 2
        again = prefix_forward(model, x, mask, ids, f, cache)
        assert torch.equal(again, refreshed)
        assert cache.stats().hits == 8


def test_mixed_batch_hit_refresh_and_miss(tmp_path):
    model = build_model("bert-tiny")
    ids, x, mask = _batch(model, 12)
    full = prefix_forward(model, x, mask, ids, 7)
    with _cache(model, tmp_path, 12, shard_rows=12) as cache:
        prefix_forward(model, x[:4], mask[:4], ids[:4], 7, cache)   # 0-3 at f
        prefix_forward(model, x[4:8], mask[4:8], ids[4:8], 3, cache)  # 4-7 at c
        out = prefix_forward(model, x, mask, ids, 7, cache)  # 8-11 missing
        assert (out - full).abs().max().item() <= TOL
        s = cache.stats()
        assert (s.hits, s.refreshes, s.misses) == (4, 4, 4 + 4 + 4)
        # shard complete at 7 -> its slab at 3 is gone
        assert _slabs(cache) == ["f0007-s000000.slab"]


# ---- sharing across processes ------------------------------------------------------------------

def _child_writer(root, job, out_path, q):
    torch.set_num_threads(1)
    try:
        model = build_model("bert-tiny")
        ids, x, mask = _batch(model, 8)
        cache = ActivationCache(root, job_id=job, create=False)
        h = prefix_forward(model, x, mask, ids, 5, cache)
        torch.save(h, out_path)
        cache.close()
        q.put("ok")
    except BaseException as e:  # report, don't hang the parent
        q.put(f"{type(e).__name__}: {e}")


def _child_reader(root, job, ref_path, q):
    torch.set_num_threads(1)
    try:
        cache = ActivationCache(root, job_id=job, create=False)
        got = cache.get(torch.arange(8), 5)
        ref = torch.load(ref_path)
        cache.close()
        q.put("ok" if got is not None and torch.equal(got, ref) else "mismatch")
    except BaseException as e:
        q.put(f"{type(e).__name__}: {e}")


def _run_child(target, *args) -> str:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        pytest.fail("child process hung")
    return q.get(timeout=5)


def test_two_processes_share_one_cache(tmp_path):
    model = build_model("bert-tiny")
    job = _job()
    with _cache(model, tmp_path, 8, job_id=job) as cache:
        # the child writes, the parent reads exactly what it computed
        assert _run_child(_child_writer, str(tmp_path), job, str(tmp_path / "child.pt")) == "ok"
        got = cache.get(torch.arange(8), 5)
        assert got is not None and torch.equal(got, torch.load(tmp_path / "child.pt"))
        ids, x, mask = _batch(model, 8)
        assert torch.equal(prefix_forward(model, x, mask, ids, 5, cache), got)
        assert cache.stats().hits == 8 and cache.stats().misses == 0
        # the parent writes at another count, the child reads it
        h = prefix_forward(model, x, mask, ids, 3)
        cache.put(ids, 3, h)
        # the child reads count 5 (its own rows) against the parent's saved copy
        torch.save(got, tmp_path / "parent.pt")
        assert _run_child(_child_reader, str(tmp_path), job, str(tmp_path / "parent.pt")) == "ok"


def _child_stream_writer(root, job, n, q):
    torch.set_num_threads(1)
    try:
        cache = ActivationCache(root, job_id=job, create=False)
        shape = cache.sample_shape
        for i in range(n):
            cache.put(torch.tensor([i]), 1, torch.full((1, *shape), float(i)))
        cache.close()
        q.put("ok")
    except BaseException as e:
        q.put(f"{type(e).__name__}: {e}")


def test_concurrent_reader_never_sees_torn_rows(tmp_path):
    n, shape = 48, (256, 1024)  # 1 MiB rows: a copy takes long enough to be caught mid-way
    job = _job()
    cache = ActivationCache(tmp_path, job_id=job, create=True, sample_shape=shape, dtype=torch.float32,
                            num_samples=n, budget_bytes=1 << 30, shard_rows=16)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_stream_writer, args=(str(tmp_path), job, n, q))
    p.start()
    seen = set()
    try:
        while True:
            alive = p.is_alive()  # one more full pass after the writer is done
            best = cache.lookup_rows(torch.arange(n), 1)
            ready = (best == 1).nonzero().reshape(-1)
            if ready.numel():
                rows = cache.get(ready, 1)
                assert rows is not None
                for i, r in zip(ready.tolist(), rows):
                    assert bool((r == float(i)).all()), f"row {i} torn"
                seen.update(ready.tolist())
            if not alive:
                break
        p.join(60)
        assert q.get(timeout=5) == "ok"
        assert seen == set(range(n))
    finally:
        if p.is_alive():
            p.kill()
        cache.cleanup()


# ---- budget, spill, eviction -------------------------------------------------------------------

def test_budget_spills_to_disk_and_data_stays_correct(tmp_path):
    model = build_model("bert-tiny")
    ids, x, mask = _batch(model, 12)
    ref = prefix_forward(model, x, mask, ids, 5)
    ram, spill = tmp_path / "ram", tmp_path / "disk"
    ram.mkdir()
    spill.mkdir()
    probe = _cache(model, ram, 12)
    slab_bytes = 4096 + 4096 + 4 * model.seq_len * 64 * 4  # header, flags, 4 rows
    probe.cleanup()
    with _cache(model, ram, 12, budget=slab_bytes, spill_dir=spill) as cache:
        assert torch.equal(prefix_forward(model, x, mask, ids, 5, cache), ref)
        s = cache.stats()
        assert (s.ram_slabs, s.disk_slabs) == (1, 2)
        assert s.ram_bytes <= slab_bytes and s.disk_bytes == 2 * slab_bytes
        assert torch.equal(cache.get(ids, 5), ref)  # read back from both tiers
        assert torch.equal(prefix_forward(model, x, mask, ids, 5, cache), ref)
        assert cache.stats().hits == 12


def test_no_spill_dir_leaves_rows_uncached_but_correct(tmp_path):
    model = build_model("bert-tiny")
    ids, x, mask = _batch(model, 12)
    ref = prefix_forward(model, x, mask, ids, 5)
    with _cache(model, tmp_path, 12, budget=0) as cache:
        assert torch.equal(prefix_forward(model, x, mask, ids, 5, cache), ref)
        s = cache.stats()
        assert s.rows_not_cached == 12 and s.rows_written == 0 and s.ram_bytes == 0
        assert cache.get(ids, 5) is None


def test_evict_below_drops_old_counts_and_promotes_spilled_slabs(tmp_path):
    model = build_model("bert-tiny")
    ids, x, mask = _batch(model, 8)
    ram, spill = tmp_path / "ram", tmp_path / "disk"
    ram.mkdir()
    spill.mkdir()
    slab_bytes = 4096 + 4096 + 4 * model.seq_len * 64 * 4
    with _cache(model, ram, 8, budget=2 * slab_bytes, spill_dir=spill) as cache:
        prefix_forward(model, x, mask, ids, 3, cache)  # both slabs at 3 fill the RAM budget
        # refresh only half of each shard at 7: the new slabs spill, the old ones stay (still needed)
        half = torch.tensor([0, 1, 4, 5])
        prefix_forward(model, x[half], mask[half], half, 7, cache)
        s = cache.stats()
        assert (s.ram_slabs, s.disk_slabs) == (2, 2)
        assert _slabs(cache) == ["f0003-s000000.slab", "f0003-s000001.slab", "f0007-s000000.slab",
                                 "f0007-s000001.slab"]
        freed = cache.evict_below(7)  # end of the epoch at 7
        assert freed == 2 * slab_bytes
        s = cache.stats()
        assert _slabs(cache) == ["f0007-s000000.slab", "f0007-s000001.slab"]
        assert cache.lookup_rows(ids, 7).tolist() == [7, 7, -1, -1, 7, 7, -1, -1]
        assert s.slabs_promoted == 0  # incomplete slabs are still being written: they stay on disk
        rest = torch.tensor([2, 3, 6, 7])
        prefix_forward(model, x[rest], mask[rest], rest, 7, cache)
        cache.evict_below(7)
        s = cache.stats()
        assert (s.ram_slabs, s.disk_slabs, s.slabs_promoted) == (2, 0, 2)
        assert torch.equal(cache.get(ids, 7), prefix_forward(model, x, mask, ids, 7))


def test_a_slab_evicted_by_two_processes_at_once_is_counted_once(tmp_path):
    """The processes of a node share the cache and may each see a slab superseded and evict it at the same
    time: only the process whose unlink succeeds counts it (``slabs_evicted`` and ``bytes_evicted`` are summed
    over the node's processes in the run log). Two handles on one cache directory, as two ranks hold it: both
    list the slabs at 3, the first evicts them, then the second acts on what it listed."""
    model = build_model("bert-tiny")
    ids, x, mask = _batch(model, 8)
    with _cache(model, tmp_path, 8) as cache:
        other = ActivationCache(tmp_path, job_id=cache.job_id, create=False)
        prefix_forward(model, x, mask, ids, 3, cache)
        stale = other.store.listing()
        keys = sorted(k for k in stale if k[0] == 3)
        assert len(keys) == 2
        cache._evict(keys, promote=[])
        other.store.listing = lambda: stale  # the second rank listed before the first one unlinked
        other._evict(keys, promote=[])
        a, b = cache.stats(), other.stats()
        assert (a.slabs_evicted, b.slabs_evicted) == (2, 0)
        assert a.bytes_evicted > 0 and b.bytes_evicted == 0
        assert _slabs(cache) == []
        other.close()


# ---- refusing nondeterministic prefixes --------------------------------------------------------

def test_active_dropout_in_prefix_is_refused_with_the_layer_and_fix(tmp_path):
    model = build_model("bert-tiny", dropout=0.1)
    model.train()  # frozen layers left in train mode, as PipeTransformer's code does
    ids, x, mask = _batch(model, 4)
    with _cache(model, tmp_path, 4) as cache:
        with pytest.raises(PtplanError) as e:
            prefix_forward(model, x, mask, ids, 3, cache)
        msg = str(e.value)
        assert "layers[1] (block0.attn).attention.self.dropout (Dropout p=0.1)" in msg
        assert "model.layers[:3].eval()" in msg and "dropout=0.0" in msg and "allow_nondeterministic=True" in msg
        assert _slabs(cache) == []
        model.layers[:3].eval()  # the fix ptplan's stage applies
        out = prefix_forward(model, x, mask, ids, 3, cache)
        assert model.layers[3].training  # only the prefix's flags were touched
    with _cache(model, tmp_path, 4, allow_nondeterministic=True) as cache:
        model.train()
        out2 = prefix_forward(model, x, mask, ids, 3, cache)
        assert torch.equal(out, out2)  # eval-mode output, dropout off
        assert model.layers[0].training  # flags restored
        assert any("dropout is active" in n for n in cache.stats().notes)


def test_vit_attention_dropout_attribute_is_found(tmp_path):
    model = build_model("vit-tiny", dropout=0.1)
    model.train()
    ids, x, mask = _batch(model, 2)
    with _cache(model, tmp_path, 2) as cache, pytest.raises(PtplanError, match=r"ViTAttention attention dropout 0.1"):
        prefix_forward(model, x, mask, ids, 3, cache)


class _Noise(nn.Module):
    """A layer that is random even in eval mode."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, attention_mask=None):
        return nn.functional.dropout(self.inner(x, attention_mask=attention_mask), 0.5, training=True)


def test_prefix_random_in_eval_mode_is_caught_by_running_it_twice(tmp_path):
    model = build_model("bert-tiny")
    model.layers[1] = _Noise(model.layers[1])
    ids, x, mask = _batch(model, 2)
    with _cache(model, tmp_path, 2) as cache, pytest.raises(PtplanError, match="two eval-mode runs on the same sample"):
        prefix_forward(model, x, mask, ids, 3, cache)


class _Augmented:
    def __init__(self, base, declare: bool) -> None:
        self.base, self.random_augmentation = base, declare

    def __len__(self) -> int:
        return len(self.base)

    def batch(self, ids):
        x, y, m = self.base.batch(ids)
        return x + torch.randn(x.shape) if x.is_floating_point() else x, y, m


def test_random_augmentation_is_refused(tmp_path):
    model = build_model("vit-tiny")
    base = SyntheticDataset(model, 4)
    with _cache(model, tmp_path, 4) as cache:
        cache.check_dataset(base)  # deterministic: fine
        with pytest.raises(PtplanError, match="declares random_augmentation=True"):
            cache.check_dataset(_Augmented(base, declare=True))
        with pytest.raises(PtplanError, match="different inputs for sample 0 on two reads"):
            cache.check_dataset(_Augmented(base, declare=False))
    with pytest.raises(PtplanError, match="first view"):
        _cache(model, tmp_path, 4, random_augmentation=True)
    with _cache(model, tmp_path, 4, random_augmentation=True, allow_nondeterministic=True) as cache:
        assert cache.stats().notes


# ---- attaching, fingerprints, cleanup ----------------------------------------------------------

def test_attach_errors_name_the_problem(tmp_path):
    model = build_model("bert-tiny")
    with pytest.raises(PtplanError, match="must make it before others attach"):
        ActivationCache(tmp_path, job_id=_job(), create=False)
    job = _job()
    with _cache(model, tmp_path, 4, job_id=job):
        with pytest.raises(PtplanError, match=r"num_samples=4 but this process asked for 5"):
            ActivationCache(tmp_path, job_id=job, create=False, num_samples=5)
    with pytest.raises(PtplanError, match="job id"):
        ActivationCache(tmp_path, job_id="../evil", create=False)


def test_rows_from_other_weights_are_refused(tmp_path):
    a, b = build_model("bert-tiny", seed=0), build_model("bert-tiny", seed=1)
    ids, x, mask = _batch(a, 4)
    job = _job()
    with _cache(a, tmp_path, 4, job_id=job) as cache:
        prefix_forward(a, x, mask, ids, 3, cache)
        other = ActivationCache(tmp_path, job_id=job, create=False)
        with pytest.raises(PtplanError, match="computed by other prefix weights"):
            prefix_forward(b, x, mask, ids, 3, other)
        other.close()


def test_cleanup_leaves_no_files(tmp_path):
    model = build_model("bert-tiny")
    ids, x, mask = _batch(model, 8)
    spill = tmp_path / "disk"
    spill.mkdir()
    cache = ActivationCache(job_id=_job(), create=True, sample_shape=prefix_sample_shape(model), dtype=torch.float32,
                            num_samples=8, budget_bytes=0, spill_dir=spill, shard_rows=4)  # default root
    assert cache.dir.startswith(default_root())
    prefix_forward(model, x, mask, ids, 3, cache)
    assert cache.stats().disk_slabs == 2
    reader = ActivationCache(job_id=cache.job_id, create=False)
    with reader:
        assert reader.get(ids, 3) is not None
    assert os.path.isdir(cache.dir)  # an attached process's exit leaves the files to the others
    with cache:
        pass
    assert not os.path.exists(cache.dir) and os.listdir(spill) == []
    with pytest.raises(PtplanError, match="closed"):
        cache.get(ids, 3)


def test_any_dtype_round_trips_bitwise_and_memory_matches_the_planners_estimate(tmp_path):
    n, shape = 10, (7, 5)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(n, *shape).to(dtype)
        with ActivationCache(tmp_path, job_id=_job(), create=True, sample_shape=shape, dtype=dtype, num_samples=n,
                             budget_bytes=1 << 20, shard_rows=4) as cache:
            perm = torch.randperm(n)
            cache.put(perm, 2, x[perm])
            assert torch.equal(cache.get(torch.arange(n), 2), x)
            s = cache.stats()
            # the planner's cache_host_bytes is samples x output bytes per sample; slabs add a header
            # page and a flag page each, and round the rows up to a page
            row_bytes = 35 * dtype.itemsize
            assert n * row_bytes <= s.ram_bytes <= n * row_bytes + s.ram_slabs * 3 * 4096
