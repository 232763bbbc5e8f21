"""What ``ptplan plan --data`` reads from a training file: its sample count and sequence length (a ``.pt`` file
needs torch, installed with the executor; an ``.npz`` file needs only numpy)."""
from __future__ import annotations

import os

from ptplan.planner.errors import PtplanError


def data_shape(path: str) -> tuple[int, int | None]:
    """(samples, tokens per sample) of a ``ptplan data`` file (``.pt``) or an ``.npz`` of the same arrays; the
    length is None for images."""
    if not os.path.isfile(path):
        raise PtplanError(f"--data {path}: no such file; give the .pt file `ptplan data` wrote")
    try:  # with the executor installed: the reader and checks ptplan run uses, so plan refuses what run refuses
        from ptplan.executor.data.dataset import load_dataset
        executor = True
    except ImportError:
        executor = False
    if executor:
        try:
            ds = load_dataset(path)
        except PtplanError as e:
            raise PtplanError(f"--data {path}: {e}") from None
        shape = tuple(ds.inputs.shape)
    elif path.endswith(".npz"):
        import numpy as np

        with np.load(path) as z:
            if "inputs" not in z:
                raise PtplanError(f"--data {path} has no 'inputs' array; write it with `ptplan data`")
            shape = z["inputs"].shape
    else:
        try:
            import torch
        except ImportError:
            raise PtplanError(f"--data {path}: reading a .pt file needs torch (pip install torch, then "
                              f"pip install -e '.[executor]'); or pass --samples-per-epoch N instead") from None
        try:
            d = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 -- any unreadable file is one message
            raise PtplanError(f"--data {path} is not a file `ptplan data` wrote ({type(e).__name__}); "
                              f"write it with `ptplan data`") from None
        if not isinstance(d, dict) or not isinstance(d.get("inputs"), torch.Tensor):
            raise PtplanError(f"--data {path} holds no 'inputs' tensor; write it with `ptplan data`")
        shape = tuple(d["inputs"].shape)
    if len(shape) < 1 or shape[0] < 1:
        raise PtplanError(f"--data {path} holds no samples")
    return int(shape[0]), (int(shape[1]) if len(shape) == 2 else None)
