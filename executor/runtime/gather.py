"""Whole-model views of an elastic run: every layer (and optimizer state) brought to rank 0.

``gather`` is ``elastic.ElasticRuntime.gather``'s body, used for checkpoints and exports: it first drains the
step (2BW's outstanding updates) and leaves FSDP/tp, so only plain full tensors move (``transition``), one
source rank's messages at a time; rank 0 holds the whole model in host memory only until it returns.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from ptplan.executor.runtime.optim import drop_state, ensure_state, state_keys
from ptplan.executor.runtime.transition import HOST, Transfer

if TYPE_CHECKING:
    from ptplan.executor.runtime.elastic import ElasticRuntime


def gather(rt: ElasticRuntime, with_state: bool = False) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
    """Bring every layer (and optionally every active layer's optimizer state) to rank 0; collective.

    Rank 0 gets ({name: weights}, {name: {key: state}}), CPU tensors; the others get empty dicts.
    Rank 0 gives the layers it does not hold host storage for the exchange (one source rank at a
    time) and frees it again before returning: the returned tensors are then the only copies.
    """
    rt._drain_2bw()
    rt._unshard()
    ph = rt.phase
    to0 = [frozenset({0})] * rt.n
    weights_t = rt._transfers(rt.current, to0, state=False)
    state_t: list[Transfer] = []
    if with_state:
        active = [i >= ph.frozen_layers for i in range(rt.n)]
        state_t = rt._transfers([h if a else frozenset() for h, a in zip(rt.current, active)],
                                [nd if a else frozenset() for nd, a in zip(to0, active)], state=True)
    if rt.rank == 0:
        for i in range(rt.n):
            if rt.store.where[i] is None:
                rt.store.place(i, HOST, keep_values=False)
    for transfers, of_state in ((weights_t, False), (state_t, True)):
        for src in sorted({t.src for t in transfers}):
            rt._exchange([t for t in transfers if t.src == src], state=of_state)
    if rt.rank != 0:
        rt._reshard()
        return {}, {}

    def out(p: Tensor, t: Tensor) -> Tensor:  # a held layer's tensors stay in use: copy them
        t = t.detach()
        return t.to("cpu", copy=True) if rt.layer_of[id(p)] in rt.held else t.cpu()

    weights = {name: out(p, p) for name, p in rt.model.named_parameters()}
    state: dict[str, dict[str, Tensor]] = {}
    if with_state:
        keys = state_keys(rt.opt)
        for i in range(ph.frozen_layers, rt.n):
            for p in rt.layer_params[i]:
                state[rt.names[id(p)]] = {k: out(p, v) for k, v in zip(keys, ensure_state(rt.opt, p))}
    drop_state(rt.opt, rt._params_of(rt.owned))
    rt._settle(rt.held, also=set(), current=None)
    rt._reshard()
    return weights, state
