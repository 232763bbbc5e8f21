"""The AutoCache's host traffic (issue 22 item 2): rows read at ``read``, rows written at ``write``, frozen weights
streamed at ``weights`` bytes/s (``planner.stage.cache_setup_s``), each from the profile's measured
``measurement.host_io`` where the profile was measured on the cluster's kind of device, else the config's
``host_read_bandwidth``; a corrupt measurement is refused when the profile is read."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from ptplan.executor.profiling.host_io import STEP_BYTES, measure_host_io
from ptplan.planner.cluster import HostIO, cpu_cluster, get_preset, measured_host_io
from ptplan.planner.costs import CostTable
from ptplan.planner.errors import SchemaError
from ptplan.planner.profile import load_profile, profile_from_json
from ptplan.planner.stage import cache_setup_s

PROFILE = "profiles/bert-base_cuda_bf16.json"


def _with_io(prof, io):
    d = copy.deepcopy(prof.to_json())
    d["measurement"]["host_io"] = io
    return profile_from_json(d)


def test_setup_charges_each_kind_of_bytes_at_its_own_rate():
    """By hand: a steady step reads M·b rows at n0; a fill from 0 runs the prefix, writes the rows and streams the
    prefix's weights; a refresh from c reads the rows at c, runs [c, n0), writes and streams [c, n0)."""
    t = CostTable(load_profile(PROFILE))
    io = HostIO(read=2e9, write=1e9, weights=50e9)
    M, b, n0, c = 2, 8, 9, 5
    out, param = t.out_per_sample, t.cum_param
    nog = t.at(b).cum_nograd
    row_n0, row_c = float(out[n0 - 1]), float(out[c - 1])
    assert cache_setup_s(t, n0, M, b, io, device_is_host=False) == pytest.approx(M * b * row_n0 / 2e9, rel=1e-12)
    fill = M * float(nog[n0]) + M * b * row_n0 / 1e9 + float(param[n0]) / 50e9
    assert cache_setup_s(t, n0, M, b, io, device_is_host=False, fill_from=0) == pytest.approx(fill, rel=1e-12)
    refresh = (M * float(nog[n0] - nog[c]) + M * b * row_c / 2e9 + M * b * row_n0 / 1e9
               + float(param[n0] - param[c]) / 50e9)
    assert cache_setup_s(t, n0, M, b, io, device_is_host=False, fill_from=c) == pytest.approx(refresh, rel=1e-12)
    # a CPU "cluster" streams nothing: the weights' rate no longer matters
    slow = HostIO(read=2e9, write=1e9, weights=1.0)
    assert cache_setup_s(t, n0, M, b, slow, device_is_host=True, fill_from=c) == \
        pytest.approx(refresh - float(param[n0] - param[c]) / 50e9, rel=1e-12)


def test_measured_rates_apply_on_the_profiles_kind_of_device_only():
    prof = load_profile(PROFILE)
    gpu, cpu = get_preset("dgx-h100"), cpu_cluster(2)
    assert measured_host_io(gpu, _with_io(prof, None), 7e9) == HostIO.uniform(7e9)  # not measured: the config's
    io = {"rows_read_bytes_per_s": 3e9, "rows_write_bytes_per_s": 2e9, "weights_to_device_bytes_per_s": 50e9}
    assert measured_host_io(gpu, _with_io(prof, io), 7e9) == HostIO(read=3e9, write=2e9, weights=50e9)
    assert measured_host_io(cpu, _with_io(prof, io), 7e9) == HostIO.uniform(7e9)  # a GPU host says nothing of a CPU
    part = {**io, "weights_to_device_bytes_per_s": None}
    assert measured_host_io(gpu, _with_io(prof, part), 7e9) == HostIO(read=3e9, write=2e9, weights=7e9)


@pytest.mark.parametrize("bad", [{"rows_read_bytes_per_s": -1.0}, {"rows_write_bytes_per_s": "fast"},
                                 {"weights_to_device_bytes_per_s": float("inf")}, [1, 2]])
def test_a_corrupt_measurement_is_refused_with_its_field(tmp_path, bad):
    d = json.loads(open(PROFILE).read())
    d["measurement"]["host_io"] = bad
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(SchemaError, match=r"measurement\.host_io"):
        load_profile(path)


def test_a_plan_prices_the_cache_at_the_profiles_rates():
    """The same profile on one GPU, with and without a measured host_io: each cached phase's steady set-up is its
    rows at the measured read rate, and its fill set-up the hand formula at the three measured rates."""
    from ptplan.planner.cluster import cluster_from_json
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import make_plan

    prof = load_profile(PROFILE)
    one = cluster_from_json({**get_preset("dgx-h100").to_json(), "name": "one", "gpus_per_node": 1,
                             "nics_per_node": 1})
    cfg = TrainingConfig(epochs=3, samples_per_epoch=3200, batch=32, cache="on")
    io = {"rows_read_bytes_per_s": 3e9, "rows_write_bytes_per_s": 1.5e9, "weights_to_device_bytes_per_s": 50e9}
    rates = HostIO(read=3e9, write=1.5e9, weights=50e9)
    plain, measured = (make_plan(_with_io(prof, x), one, cfg, FreezePolicy()) for x in (None, io))
    t = CostTable(prof)
    cached = [ph for ph in measured.phases if ph.cache]
    assert cached
    for ph in cached:
        n0, M, b = ph.frozen_layers, ph.M, ph.micro_batch_size
        assert ph.predicted.cache_setup_s == pytest.approx(cache_setup_s(t, n0, M, b, rates, device_is_host=False),
                                                           rel=1e-9)
        fills = {cache_setup_s(t, n0, M, b, rates, device_is_host=False, fill_from=c) for c in range(n0)}
        assert min(abs(ph.predicted.fill_cache_setup_s - v) for v in fills) < 1e-12
    before = {ph.frozen_blocks: ph.predicted.cache_setup_s for ph in plain.phases if ph.cache}
    assert any(before.get(ph.frozen_blocks, 0) != ph.predicted.cache_setup_s for ph in cached)


def test_measure_host_io_on_this_machine(monkeypatch):
    io = measure_host_io(torch.device("cpu"), (16, 32), torch.float32, 5, repeats=3)
    assert io["rows_per_step"] == 5 and io["bytes_per_step"] == 5 * 16 * 32 * 4
    assert io["rows_write_bytes_per_s"] > 0 and io["rows_read_bytes_per_s"] > 0
    assert io["weights_to_device_bytes_per_s"] is None and "note" not in io
    big = measure_host_io(torch.device("cpu"), (256, 1024), torch.float32, 64, repeats=1, step_bytes=4 << 20)
    assert big["rows_per_step"] == 4 and np.isfinite(big["rows_write_bytes_per_s"])  # 1 MiB rows, 4 MiB a step
    assert STEP_BYTES == 64 << 20
    # a cache folder without room (a container's 64 MiB /dev/shm, full): no rates, a note, and no exception
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    none = measure_host_io(torch.device("cpu"), (16, 32), torch.float32, 5, repeats=3)
    assert none["rows_per_step"] == 0 and none["rows_write_bytes_per_s"] is none["rows_read_bytes_per_s"] is None
    assert "1000 bytes free" in none["note"]
    prof = _with_io(load_profile(PROFILE), {**none, "weights_to_device_bytes_per_s": 50e9})
    assert measured_host_io(get_preset("dgx-h100"), prof, 7e9) == HostIO(read=7e9, write=7e9, weights=50e9)


def test_a_plan_says_when_the_cache_rates_are_assumed():
    """Warning ``assumed-cache-host-rates`` names the traffic priced at the config's rate: all three for a profile
    that measured none, nothing for one that measured all, only the rows on a CPU cluster (no weights streamed);
    never without a cached phase."""
    from ptplan.planner.cluster import cluster_from_json
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import make_plan

    prof = load_profile(PROFILE)
    one = cluster_from_json({**get_preset("dgx-h100").to_json(), "name": "one", "gpus_per_node": 1,
                             "nics_per_node": 1})
    io = {"rows_read_bytes_per_s": 3e9, "rows_write_bytes_per_s": 1.5e9, "weights_to_device_bytes_per_s": 50e9}

    def warned(p, cluster, cache="on"):
        cfg = TrainingConfig(epochs=3, samples_per_epoch=3200, batch=32, cache=cache)
        return [w.message for w in make_plan(p, cluster, cfg, FreezePolicy()).warnings
                if w.code == "assumed-cache-host-rates"]

    (none,) = warned(_with_io(prof, None), one)
    assert "(rows read, rows written, frozen weights streamed) is priced at an assumed 10 GB/s" in none
    assert warned(_with_io(prof, io), one) == []
    (part,) = warned(_with_io(prof, {**io, "rows_write_bytes_per_s": None}), one)
    assert "(rows written) is priced" in part
    assert warned(_with_io(prof, None), one, cache="off") == []
    cpu = load_profile("profiles/bert-tiny_cpu_fp32.json")
    (rows,) = warned(cpu, cpu_cluster(1))
    assert "(rows read, rows written) is priced" in rows
