"""Cluster model: presets, graph, communication costs, JSON files, and the CLI resolver."""
from __future__ import annotations

import json

import pytest

from ptplan.planner.cluster import (PRESETS, Cluster, cluster_from_json, cpu_cluster, get_preset, load_cluster,
                                    resolve_cluster)
from ptplan.planner.errors import PtplanError, SchemaError

GiB = 2**30


def test_presets_have_the_documented_shape():
    paper = get_preset("paper")
    assert (paper.nodes, paper.gpus_per_node, paper.world_size) == (2, 8, 16)
    assert paper.gpu_memory_bytes == 16 * GiB
    assert paper.intra_bandwidth == 15.75e9 and paper.inter_bandwidth == 5e9
    dgx = get_preset("dgx-h100")
    assert (dgx.world_size, dgx.intra_bandwidth, dgx.inter_bandwidth, dgx.nics_per_node) == (8, 450e9, 50e9, 8)
    assert get_preset("h100-4node").world_size == 32
    cpu = get_preset("cpu")
    assert (cpu.nodes, cpu.gpus_per_node) == (1, 2) and "MEASURED" in cpu.notes and "comm_bench" in cpu.notes
    assert get_preset("cpu:4").gpus_per_node == 4
    assert cpu_cluster(4).gpu_memory_bytes * 4 <= cpu_cluster(4).host_memory_bytes
    for c in PRESETS.values():
        assert c.notes


def test_unknown_preset_lists_presets():
    with pytest.raises(PtplanError, match=r"unknown cluster preset 'tpu'; presets: paper, dgx-h100, h100-4node, dgx-a100, p3.16xlarge, dgx2-v100, cpu"):
        get_preset("tpu")
    with pytest.raises(PtplanError, match="process count"):
        get_preset("cpu:zero")


def test_node_of_and_ranks_of_node():
    c = get_preset("paper")
    assert [c.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert list(c.ranks_of_node(1)) == list(range(8, 16))
    with pytest.raises(PtplanError, match="rank 16 is outside 0..15"):
        c.node_of(16)


def test_p2p_seconds():
    c = get_preset("paper")
    assert c.p2p_seconds(3, 3, 1e9) == 0.0
    assert c.p2p_seconds(0, 1, 15.75e9) == pytest.approx(10e-6 + 1.0)
    assert c.p2p_seconds(7, 8, 5e9) == pytest.approx(20e-6 + 1.0)


def test_allreduce_seconds_ring_model():
    c = get_preset("paper")
    assert c.allreduce_seconds([5], 1e9) == 0.0
    # inside a node: 2(n-1)/n * bytes / bw + 2(n-1) * latency
    n = 8
    assert c.allreduce_seconds(range(8), 1e9) == pytest.approx(2 * (n - 1) / n * 1e9 / 15.75e9 + 2 * (n - 1) * 10e-6)
    # across the two nodes: the single 5 GB/s NIC is the bottleneck
    assert c.allreduce_seconds([0, 8], 1e9) == pytest.approx(1e9 / 5e9 + 2 * 20e-6)
    # the 8 DP groups of a K=8 phase share that NIC
    assert c.allreduce_seconds([0, 8], 1e9, concurrent=8) == pytest.approx(8 * 1e9 / 5e9 + 2 * 20e-6)
    # a DGX node has a NIC per GPU: 8 concurrent pairs each get one; one 16-GPU ring gets all 8
    d = Cluster.uniform(nodes=2, gpus_per_node=8)
    assert d.allreduce_seconds([0, 8], 1e9, concurrent=8) == pytest.approx(1e9 / 50e9 + 2 * 10e-6)
    assert d.allreduce_seconds(range(16), 1e9) == pytest.approx(2 * 15 / 16 * 1e9 / 400e9 + 30 * 10e-6)
    with pytest.raises(PtplanError, match="repeats a rank"):
        c.allreduce_seconds([1, 1], 10)


def test_graph():
    c = get_preset("paper")
    g = c.graph()
    gpus = [v for v, a in g.nodes(data=True) if a["kind"] == "gpu"]
    assert sorted(gpus) == list(range(16))
    assert g.nodes[9]["node"] == 1 and g.nodes[9]["memory"] == 16 * GiB
    intra = [(a, b) for a, b, d in g.edges(data=True) if d["kind"] == "intra"]
    assert len(intra) == 2 * 8 * 7 // 2                      # complete graph inside each node
    assert g.edges[0, 1]["bandwidth"] == c.intra_bandwidth
    inter = [d for _, _, d in g.edges(data=True) if d["kind"] == "inter"]
    assert len(inter) == 1 and inter[0]["bandwidth"] == 5e9 and inter[0]["latency"] == c.inter_latency_s
    assert not g.has_edge(0, 8)                              # cross-node traffic goes through the node link


def test_uniform_synthetic_cluster():
    big = Cluster.uniform(nodes=128, gpus_per_node=8)
    assert big.world_size == 1024 and big.gpu_name == get_preset("dgx-h100").gpu_name
    assert big.node_of(1023) == 127
    assert Cluster.uniform(nodes=3, gpus_per_node=4, like="paper").nics_per_node == 1


def test_validation_messages():
    base = get_preset("paper").to_json()
    base.pop("schema")
    with pytest.raises(PtplanError, match="nodes is 0"):
        Cluster(**{**base, "nodes": 0})
    with pytest.raises(PtplanError, match="intra_bandwidth is -1"):
        Cluster(**{**base, "intra_bandwidth": -1})
    with pytest.raises(PtplanError, match="inter_latency_s is nan"):
        Cluster(**{**base, "inter_latency_s": float("nan")})


def test_json_round_trip(tmp_path):
    for c in PRESETS.values():
        path = tmp_path / f"{c.name.replace(':', '_')}.json"
        path.write_text(json.dumps(c.to_json()))
        assert load_cluster(path) == c
        assert resolve_cluster(str(path)) == c


def test_json_unknown_key_names_it_and_lists_valid_ones(tmp_path):
    obj = get_preset("paper").to_json()
    obj["gpus"] = 16
    p = tmp_path / "c.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(SchemaError, match=r"field 'gpus': unknown key.*allowed keys: .*gpus_per_node.*inter_bandwidth"):
        load_cluster(p)


def test_json_missing_and_bad_fields():
    obj = get_preset("paper").to_json()
    del obj["nodes"]
    with pytest.raises(SchemaError, match="field 'nodes': missing"):
        cluster_from_json(obj)
    obj = {**get_preset("paper").to_json(), "inter_bandwidth": 0}
    with pytest.raises(PtplanError, match="inter_bandwidth is 0.0 bytes/s"):
        cluster_from_json(obj)
    minimal = {k: v for k, v in get_preset("paper").to_json().items()
               if k not in ("schema", "nics_per_node", "host_memory_bytes", "notes")}
    assert cluster_from_json(minimal).nics_per_node == 1


def test_resolve_cluster(tmp_path):
    assert resolve_cluster("paper") is PRESETS["paper"]
    assert resolve_cluster("cpu:3").gpus_per_node == 3
    with pytest.raises(PtplanError, match="unknown cluster preset 'papr'"):
        resolve_cluster("papr")
    with pytest.raises(PtplanError, match="cluster file not found"):
        resolve_cluster(str(tmp_path / "missing.json"))


def test_framework_overheads_are_optional_checked_and_round_trip():
    obj = get_preset("paper").to_json()
    assert obj["action_overhead_s"] == 0.0 and obj["step_overhead_s"] == 0.0  # not measured on GPUs
    old = {k: v for k, v in obj.items() if k not in ("action_overhead_s", "step_overhead_s", "concurrency_slowdown")}
    assert cluster_from_json(old) == get_preset("paper")  # cluster files written before still load
    cpu = get_preset("cpu:2")
    assert cpu.action_overhead_s > 0 and cpu.step_overhead_s >= 0 and "overhead_bench" in cpu.notes
    assert cluster_from_json(cpu.to_json()) == cpu
    with pytest.raises(PtplanError, match="action_overhead_s.*-1 is below the minimum 0"):
        cluster_from_json({**obj, "action_overhead_s": -1})
    with pytest.raises(PtplanError, match="concurrency_slowdown.*below the minimum 1"):
        cluster_from_json({**obj, "concurrency_slowdown": 0.5})
    with pytest.raises(PtplanError, match="concurrency_slowdown is 0.9; it must be a number in 1..100"):
        Cluster(**{**{k: v for k, v in obj.items() if k != "schema"}, "concurrency_slowdown": 0.9})
