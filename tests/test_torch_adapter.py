"""The torch versions the executor's private-API adapter (``executor/runtime/torch_adapter.py``) supports, pinned,
and what it borrows from torch checked against public autograd on the running torch."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ptplan.executor.runtime import torch_adapter
from ptplan.planner.errors import PtplanError


def test_the_supported_range_is_pinned_and_holds_the_running_torch():
    assert torch_adapter.SUPPORTED == ((2, 8), (2, 14))
    assert torch_adapter.check_torch() == torch_adapter.torch_version()
    assert torch_adapter.torch_version("2.13.0+cpu") == (2, 13)
    assert torch_adapter.torch_version("2.10.0a0+git1234") == (2, 10)


@pytest.mark.parametrize("version", ["2.7.1", "2.14.0", "3.0.0"])
def test_a_torch_outside_the_range_is_refused_with_the_range_and_the_fix(version):
    with pytest.raises(PtplanError, match=rf"torch {version} is outside the range .* \(>= 2\.8, < 2\.14\): install a "
                                          r"torch in that range, or check executor/runtime/torch_adapter\.py"):
        torch_adapter.check_torch(version)


def test_split_backward_equals_one_backward():
    """B (input gradient) then W (weight gradient) through the adapter give autograd's full backward."""
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(6, 4)
    g = torch.randn(6, 3)
    inp = x.clone().requires_grad_(True)
    mod(inp).backward(g)
    want_in = inp.grad.clone()
    want = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    inp = x.clone().requires_grad_(True)
    out = mod(inp)
    dinputs, groups = torch_adapter.backward_input([out], [g], [inp], mod.parameters())
    assert all(p.grad is None for p in mod.parameters())  # B leaves the weights alone
    torch.testing.assert_close(dinputs[0], want_in)
    torch_adapter.backward_weight(mod.parameters(), groups)
    for p, w in zip(mod.parameters(), want):
        torch.testing.assert_close(p.grad, w)


def test_actions_print_in_torchs_ir():
    for tok in ("0F3", "1SEND_F0", "2RECV_B1", "0I2", "1W0", "0REDUCE_GRAD"):
        assert str(torch_adapter.torch_action(tok)) == tok
