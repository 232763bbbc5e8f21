"""Device models: datasheet peaks of accelerators nobody here has, for projected profiles (``ptplan profile --project``).

Every number in ``DEVICES`` is a vendor datasheet's (dense, i.e. without structured sparsity; the
source of each device is in its ``source`` field). The *efficiency* parameters that turn peaks into
the time an operation really takes are not datasheet numbers: they are assumptions, stated in
``Efficiency``, and a projected profile says so in its provenance and in every plan made from it.

Legend: FLOP/s are per device; ``matmul`` peaks are the tensor-core rates a matrix multiply of that
dtype reaches (torch's default for float32 matmuls is full fp32, not TF32, so the fp32 matmul peak is
the CUDA-core fp32 rate); ``vector`` peaks are the non-tensor rates elementwise work could reach
(elementwise work is bound by memory bandwidth long before that).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import PtplanError

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """How far below its peaks a device runs an operation (ASSUMED, not measured: no GPU was available to
    calibrate them; ``bench/`` and the README say how far projections were from measurements where a
    GPU was lent).

    A matrix multiply of F FLOPs reaches ``matmul_max * F / (F + F_half)`` of the matmul peak P, with
    F_half = P * ``matmul_half_s`` (small GEMMs cannot fill the device: one that would take
    ``matmul_half_s`` at peak gets half); any operation moves its bytes at ``memory`` of the datasheet
    bandwidth; every kernel pays ``launch_s``."""

    matmul_max: float = 0.75
    """Share of the tensor-core peak a large GEMM reaches (cuBLAS on large bf16 GEMMs: 70-80 %)."""
    matmul_half_s: float = 5e-6
    """A GEMM that would take this long at peak reaches half of ``matmul_max``."""
    memory: float = 0.8
    """Share of the datasheet memory bandwidth a streaming kernel reaches."""
    launch_s: float = 4e-6
    """Seconds of launch and scheduling overhead per kernel."""


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """One accelerator: datasheet peaks and capacity, and the efficiency assumptions."""

    key: str
    """Short name used on the command line, e.g. ``h100``."""
    name: str
    matmul_flops: dict[str, float]
    """Dense tensor-core FLOP/s of a matrix multiply per dtype (fp32: what torch uses by default)."""
    vector_flops: float
    """Non-tensor fp32 FLOP/s."""
    memory_bandwidth: float
    """Bytes/s of device memory."""
    memory_bytes: int
    source: str
    """Where the numbers come from."""
    efficiency: Efficiency = field(default_factory=Efficiency)

    def efficiency_at(self, flops: float, dtype: str, *, matmul: bool = True) -> float:
        """Share of the peak an operation of ``flops`` FLOPs reaches: the falling-for-small-matrices curve
        ``matmul_max · F / (F + F_half)``, F_half = peak · ``matmul_half_s`` (``Efficiency``). A GEMM that would take
        ``matmul_half_s`` at peak reaches half of ``matmul_max``; one 100 times larger 99 % of it."""
        e = self.efficiency
        peak = self.matmul_peak(dtype) if matmul else self.vector_flops
        return e.matmul_max * flops / (flops + peak * e.matmul_half_s) if flops > 0 else 0.0

    def op_seconds(self, flops: float, nbytes: float, dtype: str, *, matmul: bool = True) -> float:
        """The roofline with that curve: launch + max(bytes / (``memory`` · bandwidth), FLOPs / (efficiency · peak))
        seconds (the projection's per-operation time, ``executor/profiling/project.op_seconds``)."""
        e = self.efficiency
        t_mem = nbytes / (self.memory_bandwidth * e.memory)
        t_math = 0.0
        if flops > 0:
            peak = self.matmul_peak(dtype) if matmul else self.vector_flops
            t_math = flops / (peak * self.efficiency_at(flops, dtype, matmul=matmul))
        return e.launch_s + max(t_mem, t_math)

    def matmul_peak(self, dtype: str) -> float:
        if dtype not in self.matmul_flops:
            raise PtplanError(f"{self.name} has no {dtype} matrix-multiply rate in its datasheet "
                              f"(it supports {', '.join(self.matmul_flops)}); project another dtype")
        return self.matmul_flops[dtype]


GB = 10**9
GiB = 2**30
DEVICES: dict[str, DeviceModel] = {d.key: d for d in (
    DeviceModel(key="h100", name="NVIDIA H100 SXM5 80GB",
                matmul_flops={"float32": 66.9e12, "bfloat16": 989.4e12, "float16": 989.4e12},
                vector_flops=66.9e12, memory_bandwidth=3350 * GB, memory_bytes=80 * GiB,
                source="NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TFLOPS, BF16/FP16 Tensor Core "
                       "1,979 TFLOPS with sparsity = 989 dense, 80 GB HBM3 at 3.35 TB/s"),
    DeviceModel(key="h200", name="NVIDIA H200 SXM 141GB",
                matmul_flops={"float32": 66.9e12, "bfloat16": 989.4e12, "float16": 989.4e12},
                vector_flops=66.9e12, memory_bandwidth=4800 * GB, memory_bytes=141 * GB,
                source="NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, BF16/FP16 Tensor Core "
                       "1,979 TFLOPS with sparsity = 989 dense, 141 GB HBM3e at 4.8 TB/s"),
    DeviceModel(key="a100", name="NVIDIA A100 SXM4 80GB",
                matmul_flops={"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12},
                vector_flops=19.5e12, memory_bandwidth=2039 * GB, memory_bytes=80 * GiB,
                source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): FP32 19.5 TFLOPS, BF16/FP16 Tensor "
                       "Core 312 TFLOPS dense, 80 GB HBM2e at 2,039 GB/s"),
    DeviceModel(key="v100", name="NVIDIA V100 SXM2 32GB",
                matmul_flops={"float32": 15.7e12, "float16": 125e12},
                vector_flops=15.7e12, memory_bandwidth=900 * GB, memory_bytes=32 * GiB,
                source="NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7 TFLOPS, Tensor Core (FP16) 125 TFLOPS, "
                       "32 GB HBM2 at 900 GB/s; no bfloat16"),
    DeviceModel(key="rtx5000", name="NVIDIA Quadro RTX 5000",
                matmul_flops={"float32": 11.2e12, "float16": 89.2e12},
                vector_flops=11.2e12, memory_bandwidth=448 * GB, memory_bytes=16 * GiB,
                source="NVIDIA Quadro RTX 5000 datasheet: FP32 11.2 TFLOPS, Tensor (FP16) 89.2 TFLOPS, 16 GB "
                       "GDDR6 at 448 GB/s; no bfloat16 (Turing). PipeTransformer's testbed GPU"),
    DeviceModel(key="l4", name="NVIDIA L4 24GB",
                matmul_flops={"float32": 30.3e12, "bfloat16": 121e12, "float16": 121e12},
                vector_flops=30.3e12, memory_bandwidth=300 * GB, memory_bytes=24 * GB,
                source="NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, BF16/FP16 Tensor Core 242 "
                       "TFLOPS with sparsity = 121 dense, 24 GB GDDR6 at 300 GB/s"),
)}


def get_device(key: str) -> DeviceModel:
    """A device model by key; PtplanError listing the known ones."""
    k = key.lower()
    if k not in DEVICES:
        raise PtplanError(f"unknown device model {key!r}; known: {', '.join(DEVICES)}")
    return DEVICES[k]
