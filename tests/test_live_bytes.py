"""The backward's working set (``executor/profiling/live_bytes.py``), by hand on linear layers.

A linear layer y = x Wᵀ + b on a batch of B samples, float32 (4 bytes an element), its backward seeded with a
gradient made for it: the first time (no ``.grad`` yet) the backward makes that gradient (B·out·4 bytes) and, where
the input needs one, the input's gradient (B·in·4); the weight and bias gradients it makes become ``.grad`` without a
copy (the plan's gradients, not working memory). The second time it also makes them apart before adding them into
``.grad``: out·in·4 + out·4 bytes more, the layer's gradient bytes."""
from __future__ import annotations

import torch
from torch import nn

from ptplan.executor.profiling.live_bytes import LiveCount, NewStorages, memory_pass

B, IN, HID, OUT = 8, 64, 32, 4


class _Layer(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.lin = nn.Linear(i, o)

    def forward(self, x, attention_mask=None):
        return self.lin(x)


class _Model(nn.Module):
    """What ``memory_pass`` needs of a ``LayeredModel``: its layers and its loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([_Layer(IN, HID), _Layer(HID, HID), _Layer(HID, OUT)])

    def loss(self, y, labels):
        return (y - labels).pow(2).mean()


def test_linear_layers_by_hand():
    m = _Model()
    x, labels = torch.randn(B, IN), torch.randn(B, OUT)
    mem = memory_pass(m, x, labels, None, B)
    assert mem.output == [HID * 4, HID * 4, OUT * 4]
    # layer 0's input needs no gradient: its backward makes only the gradient it is seeded with
    assert mem.working[0] * B == B * HID * 4
    # layer 1: the seed and its input's gradient
    assert mem.working[1] * B == B * HID * 4 + B * HID * 4
    # adding into .grad the second time: the weight and bias gradients made apart first
    assert mem.accumulate[:2] == [HID * IN * 4 + HID * 4, HID * HID * 4 + HID * 4]
    assert all(p.grad is None for p in m.parameters())  # left as found
    assert memory_pass(m, x, labels, None, B) == mem  # the same count every time (storages told apart by object)


def test_the_split_backwards_stash_by_hand():
    """ZB's B (the input gradient alone, ``torch_adapter.backward_input``) keeps, for its W, the gradient of each
    weight operation's output: a linear layer's B·out·4 bytes (the seed it is given in the middle, the loss's
    gradient on the last); its input's gradient is sent on, not kept. 0 on the first layer, whose whole backward
    the runtime runs in W. Measured with W run after, so the layer ends as after a whole backward."""
    m = _Model()
    x, labels = torch.randn(B, IN), torch.randn(B, OUT)
    mem = memory_pass(m, x, labels, None, B)
    assert mem.stash == [0, HID * 4, OUT * 4]
    assert all(p.grad is None for p in m.parameters())


def test_the_count_frees_what_dies_and_ignores_views_and_in_place_results():
    count = LiveCount()
    keep = torch.zeros(16)
    with NewStorages(count, "working", ignore=[keep]):
        a = torch.ones(256)  # 1 KiB made
        a.add_(1)  # in place: not new
        v = a.view(16, 16)  # a view: not new
        keep.add_(1)  # ignored
        c = a * 2  # 1 KiB more
        del a, v  # a's storage dies with its last view
        d = c + 1  # 1 KiB while c lives
        del c, d
    rise, by_kind = count.peaks()  # a and c, then c and d: 2 KiB (3 if a view counted or a's death were missed)
    assert rise == 2 * 1024 and by_kind == {"working": 2 * 1024}
    assert sum(n for _, n, _ in count.log) == 0  # everything made has died
