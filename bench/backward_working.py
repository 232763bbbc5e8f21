"""Bytes a layer's backward allocates on top of what its forward left alive (the backward working set), per layer.

The lent H100 (``bench/results/gpu_check/run3``) ran gpt2 (bf16, batch 32, K = 1) 0.98-1.14 GiB above its plan's peak
while bert-base and vit-base were within 2.6-8.6 %: the plan's peak is static + in-flight saved activations + the
largest post-drain buffer, and nothing for the temporaries a backward makes (the incoming gradient, the
input-gradient, a weight-gradient accumulated into ``.grad``, and inside a layer whatever its kernels need: GPT-2's
head upcasts 32 x 128 x 50,257 logits to float32 for the loss, and their log-softmax backward makes two more
tensors of that size). This measures that term for each layer, two ways:

- **live bytes**: ``executor/profiling/live_bytes.py``'s count (a dispatch mode that adds the storage bytes of every
  new tensor an operation returns, not a view or an in-place result of an input, and subtracts them when the storage
  dies); the backward working set is the count's peak during the layer's backward minus the count when the backward
  starts. The profiler, the projection (on fake tensors) and the CPU run's memory count use the same;
- **CUDA allocator** (on a GPU): ``max_memory_allocated`` during the backward minus ``memory_allocated`` when it
  starts (``reset_peak_memory_stats`` first), the ground truth the run's peak is measured with.

Parameter gradients exist before the backward (zeros, as after a previous micro-batch's accumulation), so a weight
gradient counts as the temporary it is when accumulated, and the ``.grad`` buffers (the plan's gradients) do not.
The layer's forward runs under the same count, so saved tensors freed during the backward lower it.
Each layer runs through ``live_bytes.layer_step``, the profiler's own step, with the allocator read around its
backward; its saved bytes are the profiler's (a view of a parameter is the parameter: not saved). The file in
``bench/results/`` was written before that, by this script's own copy of the step, whose saved column also counted
parameter views (GPT-2's head: its tied weight); its working and CUDA columns are the same either way. Each model
is built with the classifier ``ptplan profile`` gives it (``head_num_labels``: ViT ImageNet's 1000 classes); the
committed file's vit-base rows had the 2-class default of ``build_model`` (its largest layer is a block's MLP half
either way).

    python bench/backward_working.py [--device cuda] [--dtype bfloat16] [--models bert-base gpt2 vit-base]
        [--batch-sizes 8 32] [--out bench/results/backward_working.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from ptplan.executor.profiling.live_bytes import layer_step


def measure(model: Any, b: int, dev: torch.device) -> list[dict[str, Any]]:
    """Per layer at micro-batch b: output, saved-for-backward and backward-working bytes (live count; CUDA), with
    every parameter's ``.grad`` made beforehand (zeros), so weight gradients count as the temporaries they are."""
    x, labels, mask = model.make_batch(b)
    x, labels = x.to(dev), labels.to(dev)
    mask = None if mask is None else mask.to(dev)
    params = list(model.parameters())
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    own = {id(p.untyped_storage()) for p in params}
    cuda = dev.type == "cuda"
    rises: list[int] = []

    @contextlib.contextmanager
    def allocator_rise() -> Iterator[None]:  # max_memory_allocated's rise over the backward and its seed
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        yield
        torch.cuda.synchronize(dev)
        rises.append(torch.cuda.max_memory_allocated(dev) - base)

    rows, h = [], x
    for i in range(len(model.layers)):
        xin = h if i == 0 else h.detach().requires_grad_(True)
        y, saved, rise = layer_step(model, i, xin, labels, mask, own, params,
                                    probe=allocator_rise if cuda else contextlib.nullcontext)
        rows.append(dict(index=i, name=model.specs[i].name, kind=model.specs[i].kind,
                         output_bytes=y.numel() * y.element_size(), saved_bytes=saved,
                         working_bytes=rise, cuda_working_bytes=rises[-1] if cuda else None))
        h = y.detach()
        del y, xin
    for p in params:
        p.grad = None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--models", nargs="+", default=["bert-base", "gpt2", "vit-base"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--out", default="bench/results/backward_working.json")
    a = ap.parse_args()
    from ptplan.executor.families import build_model
    from ptplan.executor.profiling.profiler import head_num_labels

    dev = torch.device(a.device)
    res: dict[str, Any] = dict(device=a.device, dtype=a.dtype, torch=torch.__version__, host=platform.node(),
                               gpu=torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
                               command="python bench/backward_working.py " + " ".join(
                                   f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                                   for k, v in vars(a).items()), models={})
    for name in a.models:
        t0 = time.perf_counter()
        labels = head_num_labels(name, None)  # the head `ptplan profile` gives it (ViT: ImageNet's 1000 classes)
        model = build_model(name, dtype=getattr(torch, a.dtype),
                            **({} if labels is None else {"num_labels": labels})).to(dev)
        model.train()
        res["models"][name] = {str(b): measure(model, b, dev) for b in a.batch_sizes}
        print(f"{name} ({time.perf_counter() - t0:.1f} s):")
        print(f"  {'layer':<16}{'kind':<10}" + "".join(f"{'b=' + str(b) + ' out/saved/work MiB':>34}"
                                                     + (f"{'cuda MiB':>10}" if dev.type == "cuda" else "")
                                                     for b in a.batch_sizes))
        per_b = [res["models"][name][str(b)] for b in a.batch_sizes]
        for rows in zip(*per_b):
            line = f"  {rows[0]['name'][:15]:<16}{rows[0]['kind'][:9]:<10}"
            for r in rows:
                line += f"{r['output_bytes'] / 2**20:>14.2f}{r['saved_bytes'] / 2**20:>10.2f}" \
                        f"{r['working_bytes'] / 2**20:>10.2f}"
                if dev.type == "cuda":
                    line += f"{r['cuda_working_bytes'] / 2**20:>10.2f}"
            print(line)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
