"""``transition.exchange``: both sides of a transfer post the same messages whatever each keeps its tensors in.

Found by an audit (2026-11-27): the wire layout was decided per side from the tensor's device and strides, so on a
GPU job ``gather``'s rank 0 (host storage) packed a 1 MiB+ weight that its sender (the layer on the GPU) sent alone:
NCCL would hang or mix the bytes, at every single-file checkpoint and export. The layout is now a function of the
tensors' sizes and dtypes only. On the CPU the same class shows with strides: a receiver whose big tensor is a
non-contiguous view."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ptplan.executor.launch.local import run_world
from ptplan.executor.runtime.transition import BUCKET_BYTES, Transfer, _messages, exchange


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(512, 768, generator=g)  # 1.5 MiB: over BUCKET_BYTES, travels alone
    return [big, torch.randn(768, generator=g), torch.randn(3, 5, generator=g).to(torch.bfloat16)]


def test_the_layout_depends_on_sizes_and_dtypes_only():
    a = _tensors(0)
    b = [a[0].t().contiguous().t(), a[1].clone(), a[2].clone()]  # same shapes, the big one non-contiguous
    assert a[0].numel() * a[0].element_size() >= BUCKET_BYTES and not b[0].is_contiguous()

    def shape(msgs):
        return [(w is not None, [tuple(x.shape) for x in g], [x.dtype for x in g]) for w, g in msgs]

    assert shape(_messages(a)) == shape(_messages(b))
    assert shape(_messages(a))[0][0] and [m[0] for m in shape(_messages(a))] == [True, False, False]


def _worker(rank: int, world: int, receiver_strided: bool) -> None:
    src = _tensors(1)
    if rank == 0:
        exchange([Transfer(src=0, dst=1, layers=(0,))], 0, lambda layers: src, torch.device("cpu"))
    else:
        big = torch.zeros(768, 512).t() if receiver_strided else torch.zeros(512, 768)  # a view with other strides
        mine = [big, torch.zeros(768), torch.zeros(3, 5, dtype=torch.bfloat16)]
        exchange([Transfer(src=0, dst=1, layers=(0,))], 1, lambda layers: mine, torch.device("cpu"))
        for got, want in zip(mine, src):
            assert torch.equal(got, want), "the bytes landed in the wrong tensor"
    dist.barrier()


def test_a_receiver_keeping_a_big_tensor_elsewhere_gets_the_same_bytes(tmp_path):
    """Two processes: rank 0 sends a big contiguous weight and two small tensors; rank 1 keeps the big one as a
    non-contiguous view (in place impossible). Before the fix rank 1 posted one packed receive against rank 0's two
    sends; now every tensor arrives equal to the sender's."""
    for strided in (False, True):
        res = run_world(2, _worker, (strided,), tmpdir=str(tmp_path), timeout_s=30, deadline_s=90)
        assert res.ok, res.explain()
