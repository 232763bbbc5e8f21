"""The cluster model: GPUs, links, presets, and point-to-point and all-reduce cost functions.

Legend: a *rank* is a global GPU index 0..world_size-1; ranks are numbered node by node, so node n
holds ranks [n*G, (n+1)*G) with G = gpus_per_node. Bandwidths are bytes per second in one
direction; 1 GB/s = 1e9 B/s (decimal, as vendors quote links).

Communication model (alpha-beta, no contention unless stated):

- point-to-point ``p2p_seconds``: latency + bytes / bandwidth of the link between the two ranks:
  the intra-node link when both sit on one node, else one inter-node link (one NIC). 0 for a rank
  sending to itself.
- ring all-reduce ``allreduce_seconds`` of n ranks: each rank sends and receives 2(n-1)/n of the
  bytes in 2(n-1) steps, so 2(n-1)/n * bytes / bw + 2(n-1) * latency, where bw and latency are
  those of the slowest link the ring uses. Inside one node that is the intra-node link. A group
  that spans nodes is bottlenecked by the inter-node links: a node with m members of the group
  drives min(m, nics_per_node / concurrent) NICs in parallel (NCCL spreads a ring's channels over
  the NICs), where ``concurrent`` is how many equal groups all-reduce at the same time and share
  the node's NICs (e.g. the K data-parallel groups of one phase). The slowest node sets the pace.
  0 for a group of one rank.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import networkx as nx  # optional: only Cluster.graph() needs it

from .errors import PtplanError, SchemaError
from .jsonio import Fields, read_json
from .profile import HOST_IO_RATES

SCHEMA = "ptplan.cluster/1"
GiB = 2**30
DEVICE_KINDS = ("gpu", "cpu")
MAX_BANDWIDTH = 1e15
"""Bytes/s; no link moves a petabyte per second. Bounds keep every derived time finite."""
MIN_BANDWIDTH = 1e3
MAX_LATENCY_S = 60.0
MAX_MEMORY_BYTES = 2**60
MAX_DEVICES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster: ``nodes`` machines of ``gpus_per_node`` identical GPUs each."""

    name: str
    """Short name shown in plans and reports, e.g. ``paper`` or ``dgx-h100``."""
    nodes: int
    """Number of machines."""
    gpus_per_node: int
    """G, GPUs (or processes, on CPU) per machine."""
    gpu_memory_bytes: int
    """Device memory of one GPU, bytes (what the device reports, before any framework reserve)."""
    gpu_name: str
    """Device model, e.g. ``NVIDIA H100 80GB HBM3``."""
    intra_bandwidth: float
    """Bytes/s, one direction, between two GPUs of one node (PCIe, NVLink, loopback)."""
    intra_latency_s: float
    """Seconds of fixed cost per intra-node message."""
    inter_bandwidth: float
    """Bytes/s, one direction, of one inter-node link (one NIC port)."""
    inter_latency_s: float
    """Seconds of fixed cost per inter-node message."""
    nics_per_node: int = 1
    """Inter-node links per node that can carry traffic in parallel (e.g. 8 on a DGX H100)."""
    host_memory_bytes: int | None = None
    """Host RAM per node, bytes (bounds the AutoCache); None if unknown."""
    action_overhead_s: float = 0.0
    """Framework seconds per pipelined compute action (one micro-batch's forward or backward on a
    stage of a pipeline with K > 1): the schedule's bookkeeping and posting its sends and receives,
    on the rank's host thread. 0 where not measured."""
    step_overhead_s: float = 0.0
    """Framework seconds per training step, paid once per iteration: clearing gradients, the loss
    all-reduce over the world, the schedule's set-up. 0 where not measured."""
    concurrency_slowdown: float = 1.0
    """Factor (>= 1) on every compute time when all GPUs (processes) of a node compute at once,
    against the profile's device computing alone: 1 for GPUs, which have their own memory; above 1
    for CPU processes that share caches and memory bandwidth and whose synchronous steps wait for
    the slowest. 1 where not measured."""
    device_kind: str = "gpu"
    """``gpu`` (device memory apart from the host's) or ``cpu`` (processes on one machine: the
    "device" memory is host memory, so nothing is streamed between them)."""
    notes: str = ""
    """Where the numbers come from, and which are assumptions."""

    @property
    def device_is_host(self) -> bool:
        return self.device_kind == "cpu"

    @property
    def device_noun(self) -> str:
        """What one rank is, for messages: ``GPU`` or ``CPU process``."""
        return "CPU process" if self.device_is_host else "GPU"

    @property
    def device_noun_plural(self) -> str:
        """``GPUs`` or ``CPU processes``."""
        return "CPU processes" if self.device_is_host else "GPUs"

    def __post_init__(self) -> None:
        if self.device_kind not in DEVICE_KINDS:
            raise PtplanError(f"cluster {self.name!r}: device_kind is {self.device_kind!r}; use one of "
                              f"{', '.join(DEVICE_KINDS)}")
        for key in ("nodes", "gpus_per_node", "nics_per_node"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DEVICES:
                raise PtplanError(f"cluster {self.name!r}: {key} is {v!r}; it must be an integer in 1..{MAX_DEVICES}")
        if self.nodes * self.gpus_per_node > MAX_DEVICES:
            raise PtplanError(f"cluster {self.name!r}: {self.nodes} x {self.gpus_per_node} = "
                              f"{self.nodes * self.gpus_per_node:,} devices; ptplan plans up to {MAX_DEVICES:,}")
        if isinstance(self.gpu_memory_bytes, bool) or not isinstance(self.gpu_memory_bytes, int) \
                or not 0 < self.gpu_memory_bytes <= MAX_MEMORY_BYTES:
            raise PtplanError(f"cluster {self.name!r}: gpu_memory_bytes is {self.gpu_memory_bytes!r}; "
                              "it must be a positive integer of bytes (e.g. 85899345920 for 80 GiB)")
        for key in ("intra_bandwidth", "inter_bandwidth"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                    or not MIN_BANDWIDTH <= v <= MAX_BANDWIDTH:
                raise PtplanError(f"cluster {self.name!r}: {key} is {v!r} bytes/s; give a number between "
                                  f"{MIN_BANDWIDTH:.0e} and {MAX_BANDWIDTH:.0e} (e.g. 15.75e9 for PCIe 3.0 x16)")
        for key in ("intra_latency_s", "inter_latency_s", "action_overhead_s", "step_overhead_s"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                    or not 0 <= v <= MAX_LATENCY_S:
                raise PtplanError(f"cluster {self.name!r}: {key} is {v!r} s; give a number of seconds in "
                                  f"0..{MAX_LATENCY_S:g} (e.g. 1e-5)")
        c = self.concurrency_slowdown
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or not 1 <= c <= 100:
            raise PtplanError(f"cluster {self.name!r}: concurrency_slowdown is {c!r}; it must be a number in "
                              "1..100 (1 = no slowdown)")
        if self.host_memory_bytes is not None and (isinstance(self.host_memory_bytes, bool) or not isinstance(
                self.host_memory_bytes, int) or not 0 < self.host_memory_bytes <= MAX_MEMORY_BYTES):
            raise PtplanError(f"cluster {self.name!r}: host_memory_bytes is {self.host_memory_bytes!r}; "
                              "it must be a positive integer or null")

    # ---- topology ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Total number of GPUs (ranks)."""
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank``."""
        if not 0 <= rank < self.world_size:
            raise PtplanError(f"rank {rank} is outside 0..{self.world_size - 1} for cluster {self.name!r}")
        return rank // self.gpus_per_node

    def ranks_of_node(self, node: int) -> range:
        """The ranks on ``node``."""
        if not 0 <= node < self.nodes:
            raise PtplanError(f"node {node} is outside 0..{self.nodes - 1} for cluster {self.name!r}")
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def link(self, src_rank: int, dst_rank: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the link a message from src to dst uses."""
        if self.node_of(src_rank) == self.node_of(dst_rank):
            return self.intra_bandwidth, self.intra_latency_s
        return self.inter_bandwidth, self.inter_latency_s

    def graph(self) -> nx.Graph:
        """The cluster as a graph.

        Vertices: every rank (an int) with ``kind="gpu"``, ``node`` and ``memory`` (bytes), plus one
        vertex ``("node", n)`` per machine with ``kind="node"`` and ``host_memory``. Edges carry
        ``kind``, ``bandwidth`` (bytes/s) and ``latency`` (s): ``"intra"`` between every two GPUs of
        a node (complete graph); ``"inter"`` between every two node vertices (bandwidth of all the
        node's NICs together); ``"member"`` from each GPU to its node vertex (no cost: membership,
        not a link). A message between GPUs of two nodes crosses the ``inter`` edge of their nodes.
        """
        try:
            import networkx as nx
        except ImportError:
            raise PtplanError("Cluster.graph() needs networkx, which ptplan does not require for planning; "
                              "install it: pip install 'networkx>=3.0'") from None
        g = nx.Graph(name=self.name, world_size=self.world_size, nics_per_node=self.nics_per_node,
                     inter_link_bandwidth=self.inter_bandwidth)
        G = self.gpus_per_node
        for n in range(self.nodes):
            g.add_node(("node", n), kind="node", host_memory=self.host_memory_bytes)
            ranks = self.ranks_of_node(n)
            for r in ranks:
                g.add_node(r, kind="gpu", node=n, memory=self.gpu_memory_bytes, gpu_name=self.gpu_name)
                g.add_edge(r, ("node", n), kind="member", bandwidth=math.inf, latency=0.0)
            for i in range(G):
                for j in range(i + 1, G):
                    g.add_edge(ranks[i], ranks[j], kind="intra", bandwidth=self.intra_bandwidth,
                               latency=self.intra_latency_s)
        for a in range(self.nodes):
            for b in range(a + 1, self.nodes):
                g.add_edge(("node", a), ("node", b), kind="inter",
                           bandwidth=self.inter_bandwidth * self.nics_per_node, latency=self.inter_latency_s)
        return g

    # ---- communication costs -------------------------------------------------------------
    def p2p_seconds(self, src_rank: int, dst_rank: int, nbytes: float) -> float:
        """Seconds to send ``nbytes`` from src to dst: latency + bytes / bandwidth (0 to itself)."""
        if nbytes < 0:
            raise PtplanError(f"cannot send a negative number of bytes ({nbytes})")
        if src_rank == dst_rank:
            self.node_of(src_rank)
            return 0.0
        bw, lat = self.link(src_rank, dst_rank)
        return lat + nbytes / bw

    def allreduce_seconds(self, ranks: Sequence[int], nbytes: float, *, concurrent: int = 1) -> float:
        """Seconds for a ring all-reduce of ``nbytes`` over ``ranks`` (see the module docstring).

        ``concurrent``: number of equal groups all-reducing at the same time and sharing each node's
        inter-node links (1 = this group alone).
        """
        if nbytes < 0:
            raise PtplanError(f"cannot all-reduce a negative number of bytes ({nbytes})")
        if concurrent < 1:
            raise PtplanError(f"concurrent is {concurrent}; it must be >= 1")
        n = len(ranks)
        if n == 0:
            raise PtplanError("all-reduce over an empty group of ranks")
        if len(set(ranks)) != n:
            raise PtplanError(f"all-reduce group {list(ranks)} repeats a rank")
        per_node: dict[int, int] = {}
        for r in ranks:
            nd = self.node_of(r)
            per_node[nd] = per_node.get(nd, 0) + 1
        if n == 1:
            return 0.0
        if len(per_node) == 1:
            bw, lat = self.intra_bandwidth, self.intra_latency_s
        else:
            links = min(min(m, self.nics_per_node / concurrent) for m in per_node.values())
            bw = min(self.inter_bandwidth * links, self.intra_bandwidth)
            lat = max(self.inter_latency_s, self.intra_latency_s)
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    # ---- construction and files ----------------------------------------------------------
    @classmethod
    def uniform(cls, *, nodes: int, gpus_per_node: int = 8, like: str = "dgx-h100",
                name: str | None = None) -> "Cluster":
        """A synthetic cluster with the GPUs and links of preset ``like`` and any size (benchmarks)."""
        base = get_preset(like)
        return replace(base, name=name or f"{like}-{nodes}x{gpus_per_node}", nodes=nodes,
                       gpus_per_node=gpus_per_node,
                       nics_per_node=min(base.nics_per_node, gpus_per_node),
                       notes=f"synthetic: {nodes} nodes x {gpus_per_node} GPUs with the links of preset "
                             f"{like!r}. {base.notes}")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict that ``cluster_from_json`` reads back."""
        return {"schema": SCHEMA, **asdict(self)}


_KEYS = tuple(f.name for f in fields(Cluster))
_REQUIRED = ("name", "nodes", "gpus_per_node", "gpu_memory_bytes", "gpu_name", "intra_bandwidth",
             "intra_latency_s", "inter_bandwidth", "inter_latency_s")


def cluster_from_json(obj: Any, source: str = "cluster") -> Cluster:
    """Validate a decoded JSON object and build a Cluster; unknown keys are rejected by name."""
    f = Fields(obj, source, allowed=("schema",) + _KEYS)
    schema = f.str("schema", SCHEMA)
    if schema != SCHEMA:
        raise SchemaError(source, "schema", f"is {schema!r}, expected {SCHEMA!r}")
    host = f.raw("host_memory_bytes", None)
    if host is not None:
        host = f.int("host_memory_bytes", min=1)
    try:
        return Cluster(
            name=f.str("name"), nodes=f.int("nodes", min=1), gpus_per_node=f.int("gpus_per_node", min=1),
            gpu_memory_bytes=f.int("gpu_memory_bytes", min=1), gpu_name=f.str("gpu_name"),
            intra_bandwidth=f.float("intra_bandwidth", min=0), intra_latency_s=f.float("intra_latency_s", min=0),
            inter_bandwidth=f.float("inter_bandwidth", min=0), inter_latency_s=f.float("inter_latency_s", min=0),
            nics_per_node=f.int("nics_per_node", 1, min=1), host_memory_bytes=host,
            action_overhead_s=f.float("action_overhead_s", 0.0, min=0),
            step_overhead_s=f.float("step_overhead_s", 0.0, min=0),
            concurrency_slowdown=f.float("concurrency_slowdown", 1.0, min=1),
            device_kind=f.str("device_kind", "gpu", choices=DEVICE_KINDS), notes=f.str("notes", ""))
    except SchemaError:
        raise
    except PtplanError as e:
        raise PtplanError(f"{source}: {e}") from None


def load_cluster(path: str | os.PathLike) -> Cluster:
    """Load and validate a cluster JSON file (the keys of ``Cluster``; see ``to_json``)."""
    return cluster_from_json(read_json(path, "cluster"), source=f"cluster {os.fspath(path)}")


# ---- presets ---------------------------------------------------------------------------------
def _host_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GiB


def cpu_cluster(procs: int = 2) -> Cluster:
    """This machine as a one-node cluster of ``procs`` CPU processes sharing its RAM.

    Links and framework overheads were measured on the 2-core development box (torch 2.13 CPU, gloo
    over loopback TCP, one thread per process); see the preset's notes for the commands.
    """
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise PtplanError(f"cpu cluster needs at least 1 process, got {procs!r} (use e.g. cpu:2)")
    ram = _host_ram_bytes()
    return Cluster(
        name="cpu" if procs == 2 else f"cpu:{procs}", nodes=1, gpus_per_node=procs,
        gpu_memory_bytes=ram // procs, gpu_name="CPU process", intra_bandwidth=0.52e9, intra_latency_s=200e-6,
        inter_bandwidth=0.52e9, inter_latency_s=200e-6, host_memory_bytes=ram, action_overhead_s=153e-6,
        step_overhead_s=114e-6, concurrency_slowdown=1.026 if procs > 1 else 1.0, device_kind="cpu",
        notes="MEASURED on the 2-core dev box (torch 2.13 CPU, gloo over loopback TCP, 1 thread per process). "
              "Links, `python bench/comm_bench.py`: the gradient all-reduce of 2 processes as the runtime does it "
              "(flatten, all-reduce, divide, copy back) fits 1 ms + bytes / 0.52 GB/s (16 MiB in 33 ms; a bare "
              "dist.all_reduce reaches 0.9 GB/s), point-to-point 0.17-0.24 ms one way up to 256 KiB and 1.6 GB/s "
              "for large messages; one link of 0.52 GB/s (the all-reduce carries the most bytes) and 200 us per "
              "message. Framework, `python bench/overhead_bench.py` (2026-11-27, load ~3), with the executor's own step "
              "interpreter (what every training step runs): a 1F1B step with no compute costs 153 us of host CPU "
              "per forward or backward action (action_overhead_s; torch.distributed.pipelining's runtime, which it "
              "replaced, cost 0.29-0.38 ms); the training loop adds 114 us per step over forward + backward + AdamW "
              "(step_overhead_s); the slowest of 2 processes stepping together is 2.6 % slower than one alone "
              "(concurrency_slowdown 1.026; 1 for one process). `python bench/calibrate.py` with these: median "
              "iteration-time error 4.1 % over 18 phases, against 7.3 % with the previous 330 us / 0.8 ms / 1.06 on "
              "the same profiles. This VM's speed drifts by 10-20 % over seconds, so every figure is a median. "
              "Memory = host RAM / processes.")


PRESETS: dict[str, Cluster] = {
    "paper": Cluster(
        name="paper", nodes=2, gpus_per_node=8, gpu_memory_bytes=16 * GiB, gpu_name="Quadro RTX 5000",
        intra_bandwidth=15.75e9, intra_latency_s=10e-6, inter_bandwidth=5e9, inter_latency_s=20e-6,
        nics_per_node=1, host_memory_bytes=None,
        notes="PipeTransformer (ICML 2021) testbed as the PyTorch blog states it: 2 nodes x 8 Quadro RTX 5000 "
              "(16 GB), PCIe 3.0 x16 15.754 GB/s between GPUs of a node, InfiniBand CX353A 5 GB/s between "
              "nodes (one NIC per node). ASSUMED: latencies 10 us (PCIe) and 20 us (IB), typical NCCL "
              "per-message costs; host RAM unknown."),
    "dgx-h100": Cluster(
        name="dgx-h100", nodes=1, gpus_per_node=8, gpu_memory_bytes=80 * GiB, gpu_name="NVIDIA H100 80GB HBM3",
        intra_bandwidth=450e9, intra_latency_s=5e-6, inter_bandwidth=50e9, inter_latency_s=10e-6,
        nics_per_node=8, host_memory_bytes=2 * 1024 * GiB,
        notes="One NVIDIA DGX H100: NVLink 4 900 GB/s per GPU total = 450 GB/s per direction; 8 x 400 Gb/s "
              "(50 GB/s) ConnectX-7 InfiniBand ports, one per GPU; 2 TB host RAM (datasheet). ASSUMED: "
              "latencies 5 us (NVLink) and 10 us (IB); 80 GiB nominal memory (the device reports slightly less)."),
}
PRESETS["h100-4node"] = replace(
    PRESETS["dgx-h100"], name="h100-4node", nodes=4,
    notes="4 x DGX H100 on InfiniBand. " + PRESETS["dgx-h100"].notes)
PRESETS["dgx-a100"] = Cluster(
    name="dgx-a100", nodes=1, gpus_per_node=8, gpu_memory_bytes=80 * GiB, gpu_name="NVIDIA A100-SXM4-80GB",
    intra_bandwidth=300e9, intra_latency_s=5e-6, inter_bandwidth=25e9, inter_latency_s=10e-6, nics_per_node=8,
    host_memory_bytes=2 * 1024 * GiB,
    notes="One NVIDIA DGX A100 640GB, a node of Selene (Megatron-LM's SC'21 cluster): NVLink 3 600 GB/s per GPU "
          "total = 300 GB/s per direction; 8 x 200 Gb/s (25 GB/s) HDR InfiniBand ports, one per GPU; 2 TB host RAM "
          "(datasheet). ASSUMED: latencies 5 us (NVLink) and 10 us (IB). Any size: Cluster.uniform(like='dgx-a100').")
PRESETS["p3.16xlarge"] = Cluster(
    name="p3.16xlarge", nodes=1, gpus_per_node=8, gpu_memory_bytes=16 * GiB, gpu_name="Tesla V100-SXM2-16GB",
    intra_bandwidth=150e9, intra_latency_s=10e-6, inter_bandwidth=25e9 / 8, inter_latency_s=30e-6, nics_per_node=1,
    host_memory_bytes=488 * GiB,
    notes="AWS p3.16xlarge (TeraPipe's and PipeDream-2BW's testbed): 8 x V100 SXM2 16 GB, NVLink 2 300 GB/s per GPU "
          "total = 150 GB/s per direction (hybrid cube mesh: a ring uses it), 25 Gb/s Ethernet (3.125 GB/s) between "
          "instances, 488 GiB host RAM (AWS instance page). ASSUMED: latencies 10 us (NVLink) and 30 us (TCP). Any "
          "size: Cluster.uniform(like='p3.16xlarge').")
PRESETS["dgx2-v100"] = Cluster(
    name="dgx2-v100", nodes=1, gpus_per_node=16, gpu_memory_bytes=32 * GiB, gpu_name="Tesla V100-SXM3-32GB",
    intra_bandwidth=150e9, intra_latency_s=5e-6, inter_bandwidth=12.5e9, inter_latency_s=10e-6, nics_per_node=8,
    host_memory_bytes=1536 * GiB,
    notes="One NVIDIA DGX-2H (Megatron-LM v1's server): 16 x V100 SXM3 32 GB on NVSwitch, 300 GB/s per GPU total = "
          "150 GB/s per direction; 8 x 100 Gb/s (12.5 GB/s) EDR InfiniBand; 1.5 TB host RAM (datasheet). ASSUMED: "
          "latencies 5 us (NVSwitch) and 10 us (IB).")
PRESETS["cpu"] = cpu_cluster(2)


def _measured_on(profile: Any, cluster: Cluster) -> bool:
    """Whether the profile was measured on the cluster's kind of device (a CPU's numbers say nothing of a GPU's)."""
    kind = {"cuda": "gpu", "cpu": "cpu"}.get(getattr(getattr(profile, "device", None), "kind", None) or "")
    return kind == cluster.device_kind


def charged_overheads(cluster: Cluster, profile: Any) -> Cluster:
    """The cluster whose per-action overhead the planner charges with this profile: the larger of the cluster's
    ``action_overhead_s`` (two processes, point-to-point posting included, where ``bench/overhead_bench.py``
    measured it) and the profile's ``measurement["action_overhead_s"]`` (the profiler's one-process measurement on
    its device: ``executor/profiling/overhead.py``), the latter only when the profile was measured on this kind of
    device (a CPU profile's Python overhead says nothing of a GPU cluster's). So every extra action -- 2BW's,
    token slices', more micro-batches -- is priced where the profiler measured it. Unchanged when the profile did
    not measure it."""
    meas = getattr(profile, "measurement", None) or {}
    o = meas.get("action_overhead_s")
    if not isinstance(o, (int, float)) or isinstance(o, bool) or not 0 <= o < MAX_LATENCY_S \
            or not _measured_on(profile, cluster):
        return cluster
    return cluster if o <= cluster.action_overhead_s else replace(cluster, action_overhead_s=float(o))


@dataclass(frozen=True)
class HostIO:
    """Bytes/s of the AutoCache's host traffic on stage 0 (``stage.cache_setup_s``): ``read``, a cached row from the
    cache's host memory to the device; ``write``, a computed row from the device into the cache (the copy to the
    host and the write into the slab); ``weights``, a frozen layer kept in host memory to the device (the fill
    streams the prefix through the device; on a CUDA rank the executor keeps it in page-locked memory)."""

    read: float = 10e9
    write: float = 10e9
    weights: float = 10e9
    measured: tuple[str, ...] = field(default=(), compare=False)
    """The fields the profile measured (``measured_host_io``); the others are assumed."""

    @classmethod
    def uniform(cls, bandwidth: float) -> "HostIO":
        return cls(bandwidth, bandwidth, bandwidth)


HOST_IO_KEYS = dict(zip(("read", "write", "weights"), HOST_IO_RATES))
"""``HostIO`` field -> the key of the profile's ``measurement["host_io"]`` (``executor/profiling/host_io.py``;
``load_profile`` checks the values)."""


def measured_host_io(cluster: Cluster, profile: Any, default: float) -> HostIO:
    """The AutoCache's host bandwidths the planner charges with this profile: each one the profiler measured on its
    device and host (``measurement["host_io"]``), where the profile was measured on this kind of device, as
    ``charged_overheads``; ``default`` (the training config's ``host_read_bandwidth``) for the others and for a
    profile that measured none (projected files, files written before the profiler measured it)."""
    meas = getattr(profile, "measurement", None) or {}
    io = meas.get("host_io") if isinstance(meas, dict) else None
    got: dict[str, float] = {}
    if isinstance(io, dict) and _measured_on(profile, cluster):
        got = {name: float(io[key]) for name, key in HOST_IO_KEYS.items() if io.get(key) is not None}
    return HostIO(**{name: got.get(name, float(default)) for name in HOST_IO_KEYS}, measured=tuple(got))


def get_preset(name: str) -> Cluster:
    """A named preset; ``cpu:N`` is this machine with N processes. Unknown -> PtplanError listing them."""
    if name in PRESETS:
        return PRESETS[name]
    if name.startswith("cpu:"):
        try:
            procs = int(name[4:])
        except ValueError:
            procs = -1
        if procs < 1:
            raise PtplanError(f"cluster {name!r}: the number after 'cpu:' must be a process count >= 1, e.g. cpu:4")
        return cpu_cluster(procs)
    raise PtplanError(f"unknown cluster preset {name!r}; presets: {', '.join(PRESETS)} (or cpu:N), "
                      "or give the path of a cluster JSON file")


def resolve_cluster(name_or_path: str | os.PathLike) -> Cluster:
    """For the CLI: a preset name (or ``cpu:N``), else the path of a cluster JSON file."""
    s = os.fspath(name_or_path)
    if s in PRESETS or s.startswith("cpu:"):
        return get_preset(s)
    if os.path.exists(s) or s.endswith(".json") or os.sep in s:
        return load_cluster(s)
    return get_preset(s)
