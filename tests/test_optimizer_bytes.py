"""One function gives optimizer-state bytes (issue 21): ``costs.optimizer_state_bytes`` against what torch's
optimizers really allocate, and the profiler, the projection, the synthetic profiles and the stage model
agreeing with it for fp32 and bf16."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ptplan.planner.cluster import get_preset
from ptplan.planner.costs import CostTable, optimizer_state_bytes
from ptplan.planner.errors import PtplanError
from ptplan.planner.stage import PhaseShape, StageModel, links_for
from ptplan.planner.synthetic import synthetic_profile


def _torch_state_bytes(opt_name: str, dtype: torch.dtype, n: int = 1000) -> int:
    p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    opt = torch.optim.AdamW([p]) if opt_name == "adamw" else torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    opt.step()
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v) and v.numel() == n)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize("dtype,name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_matches_what_torch_allocates(opt_name, dtype, name):
    # fp32 AdamW: 2 moments x 4 B = 8 B per parameter; bf16: 2 x 2 = 4; SGD momentum: one buffer
    assert optimizer_state_bytes(1000, name, opt_name) == _torch_state_bytes(opt_name, dtype)


def test_unknown_inputs_are_refused():
    with pytest.raises(PtplanError, match="unknown optimizer"):
        optimizer_state_bytes(10, "float32", "lion")
    with pytest.raises(PtplanError, match="unknown dtype"):
        optimizer_state_bytes(10, "int8")


@pytest.mark.parametrize("dtype_bytes,name", [(4, "float32"), (2, "bfloat16")])
def test_synthetic_profile_and_stage_model_agree(dtype_bytes, name):
    prof = synthetic_profile(num_blocks=2, hidden=64, seq_len=16, vocab=100, dtype_bytes=dtype_bytes)
    for r in prof.layers:
        assert r.optimizer_bytes == optimizer_state_bytes(r.params, name)
    t = CostTable(prof)
    shape = PhaseShape(K=1, M=1, b=1, D=1, frozen=0, cache=False, inflight=(1,))
    m = StageModel(t, shape, links_for(get_preset("cpu:1"), 1))
    mem = m.stage_memory([(0, prof.num_layers)])[0]
    assert mem.optimizer == sum(r.optimizer_bytes for r in prof.layers)
    sgd = StageModel(t, PhaseShape(K=1, M=1, b=1, D=1, frozen=0, cache=False, inflight=(1,), optimizer="sgd"),
                     links_for(get_preset("cpu:1"), 1))
    assert sgd.stage_memory([(0, prof.num_layers)])[0].optimizer * 2 == mem.optimizer
    assert np.isclose(m.cum_opt_state[-1], 2 * dtype_bytes * t.params.sum())
