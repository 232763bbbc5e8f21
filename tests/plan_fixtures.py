"""Plans for the report tests, made by the product (``make_plan``) from shipped or synthetic profiles.

Each takes well under a second. Nothing here models or simulates anything itself: what the report
draws is exactly what ``ptplan plan`` would write.
"""
from __future__ import annotations

from dataclasses import replace

from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.plan import Plan
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import Profile, load_profile
from ptplan.planner.synthetic import synthetic_profile
from ptplan.profiles import shipped


def _shipped(name: str) -> Profile:
    return load_profile(shipped(name))


def vit_paper_plan(schedule: str = "1f1b") -> Plan:
    """ViT-B/16 (shipped CPU profile, 27 layers) on the paper's 2 x 8 Quadro RTX 5000, α = 1/3 over 10
    epochs of 50,000 samples, global batch 512, K pinned to 8 (phases with fewer active layers choose
    freely and say so): K falls from 8 to 1 and D rises from 2 to 16; AutoCache fills; warnings."""
    return make_plan(_shipped("vit-base_cpu_fp32"), get_preset("paper"),
                     TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512, pin_K=8, schedule=schedule),
                     FreezePolicy(alpha=1 / 3))


def large_plan() -> Plan:
    """1,024 GPUs (128 DGX-H100-like nodes x 8) training a synthetic 12-block GPT."""
    return make_plan(synthetic_profile(num_blocks=12), Cluster.uniform(nodes=128, gpus_per_node=8),
                     TrainingConfig(epochs=10, samples_per_epoch=1_281_167, batch=16 * 1024 * 8),
                     FreezePolicy(alpha=1 / 3))


def many_microbatch_plan() -> Plan:
    """M = 64 micro-batches on K = 4 stages (one DGX H100, synthetic GPT): the timeline's hard case."""
    return make_plan(synthetic_profile(num_blocks=12), get_preset("dgx-h100"),
                     TrainingConfig(epochs=2, samples_per_epoch=8192, batch=512, pin_K=4, pin_M=64),
                     FreezePolicy(policy="manual", manual=(0, 4)))


def step_freeze_plan() -> Plan:
    """A freeze decision every 10 optimizer steps (several trajectory runs per epoch), with AutoCache fills."""
    return make_plan(synthetic_profile(num_blocks=12), get_preset("dgx-h100"),
                     TrainingConfig(epochs=3, samples_per_epoch=8192, batch=256),
                     FreezePolicy(alpha=1 / 3, every=10))


def cpu_plan(procs: int = 4, memory_bytes: int | None = None) -> Plan:
    """A tiny synthetic GPT (4 blocks of width 64: a few MiB per stage) on ``cpu:N`` processes of this
    machine, K pinned to 2; ``memory_bytes`` overrides the per-process memory (to put the peak on the
    capacity's scale)."""
    cluster = get_preset(f"cpu:{procs}")
    if memory_bytes is not None:
        cluster = replace(cluster, gpu_memory_bytes=memory_bytes)
    return make_plan(synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512, flops_per_s=1e9), cluster,
                     TrainingConfig(epochs=3, samples_per_epoch=512, batch=32, pin_K=2), FreezePolicy(alpha=1 / 3))


def no_freeze_plan() -> Plan:
    """Nothing ever freezes (policy none): the trajectory stays in phase 0; bert-tiny on two CPU processes."""
    return make_plan(_shipped("bert-tiny_cpu_fp32"), get_preset("cpu:2"),
                     TrainingConfig(epochs=3, samples_per_epoch=256, batch=16), FreezePolicy(policy="none"))


def wide_node_plan() -> Plan:
    """One node of 32 GPUs (wider than the grid's 16 columns)."""
    return make_plan(synthetic_profile(num_blocks=12), Cluster.uniform(nodes=1, gpus_per_node=32),
                     TrainingConfig(epochs=2, samples_per_epoch=8192, batch=1024),
                     FreezePolicy(policy="manual", manual=(0, 6)))


def deep_plan() -> Plan:
    """A synthetic 24-block GPT on one DGX H100: 25 phases, more than a slider holds (a dropdown instead)."""
    return make_plan(synthetic_profile(num_blocks=24), get_preset("dgx-h100"),
                     TrainingConfig(epochs=2, samples_per_epoch=8192, batch=512),
                     FreezePolicy(policy="manual", manual=(0, 12)))
