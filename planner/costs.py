"""Vectorised per-layer cost tables from a profile: seconds and bytes at any micro-batch size.

Legend: n = number of flat layers; b = micro-batch size (samples). Every method returns a numpy
array of length n (one value per layer) so that stage sums are prefix-sum differences.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .profile import Profile, interp_rows


@dataclass
class CostTable:
    """Per-layer costs of one profile, with per-micro-batch-size results memoised."""

    profile: Profile
    time_scale: float = 1.0
    """Factor on every time (the cluster's ``concurrency_slowdown`` when its processes share a CPU)."""
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        p = self.profile
        self.n = p.num_layers
        self.batch_sizes = np.asarray(p.batch_sizes, dtype=float)
        k = float(self.time_scale)
        self._fwd = k * np.array([r.forward_s for r in p.layers], dtype=float)
        self._bwd = k * np.array([r.backward_s for r in p.layers], dtype=float)
        self._nog = k * np.array([r.nograd_forward_s for r in p.layers], dtype=float)
        self.param_bytes = np.array([r.param_bytes for r in p.layers], dtype=float)
        self.train_state_bytes = np.array([r.param_bytes + r.grad_bytes + r.optimizer_bytes for r in p.layers],
                                          dtype=float)
        self.grad_bytes = np.array([r.grad_bytes for r in p.layers], dtype=float)
        self.saved_per_sample = np.array([r.saved_bytes_per_sample for r in p.layers], dtype=float)
        self.out_per_sample = np.array([r.output_bytes_per_sample for r in p.layers], dtype=float)
        self.optimizer_s = k * np.array([r.optimizer_s or 0.0 for r in p.layers], dtype=float)
        """Seconds of one optimizer step over each layer's parameters (independent of b)."""

    def at(self, b: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward, backward, no-grad forward) seconds per layer at micro-batch size b."""
        key = float(b)
        hit = self._cache.get(key)
        if hit is None:
            hit = (interp_rows(self.batch_sizes, self._fwd, key), interp_rows(self.batch_sizes, self._bwd, key),
                   interp_rows(self.batch_sizes, self._nog, key))
            self._cache[key] = hit
        return hit

    def prefix_nograd_s(self, frozen_layers: int, b: float) -> float:
        """Seconds of the frozen prefix's no-grad forward for one micro-batch."""
        return float(self.at(b)[2][:frozen_layers].sum())
