"""Weights: building a model's layers with every parameter on the meta device, then giving the layers a stage
needs their storage -- initialised per Hugging Face submodule from its own seed, or read tensor by tensor
from a folder's weight files -- and streaming layers kept in host memory through a device.

Initialisation is per Hugging Face submodule, each from its own seed (``module_seed``), so the same ``seed``
gives the same weights whichever layers are built, at either granularity -- but not the weights
``model_cls(config)`` gives after ``torch.manual_seed(seed)``. Missing head weights (a base-model checkpoint:
the family's ``head_keys``) are initialised from ``seed``; any other missing or mismatched weight is an error.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

if TYPE_CHECKING:
    from ptplan.executor.families.base import LayeredModel


@contextlib.contextmanager
def streamed(module: nn.Module, device: torch.device, *, what: str = "module") -> Iterator[None]:
    """Run ``module`` on ``device`` for the duration of the block, one module's weights at a time.

    Parameters and buffers stored elsewhere (host memory, while ``device`` is a GPU) get a copy on
    ``device`` for the block and their own storage back after it, so the copy is freed as soon as
    the block ends: how the AutoCache's fill streams a frozen prefix kept in host memory through a
    GPU one layer at a time. Nothing to do (the common case, and always on a CPU) when every
    tensor is on ``device`` already. Only under ``torch.no_grad()``: autograd would keep the copies
    and send gradients to them. A parameter without storage (a layer another rank holds; see
    ``executor/runtime/elastic.py``) is an error that names the layer.
    """
    tensors = [*module.parameters(), *module.buffers()]
    if any(p.numel() == 0 for p in module.parameters()):
        raise RuntimeError(f"{what} has no weights on this process (another rank's stage holds it)")
    away = [t for t in tensors if t.device != device]
    if not away:
        yield
        return
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} lives on {away[0].device}, not {device}; streaming it is only for no-grad "
                           f"forwards (the frozen prefix)")
    kept = [t.data for t in away]
    try:
        for t, home in zip(away, kept):
            t.data = home.to(device, non_blocking=True)
        yield
    finally:
        for t, home in zip(away, kept):
            t.data = home


def weight_files(d: Path) -> list[Path]:
    """The weight files of a Hugging Face model folder (``*.safetensors``, ``pytorch_model*.bin``)."""
    return sorted([*d.glob("*.safetensors"), *d.glob("pytorch_model*.bin")])


def module_seed(seed: int, name: str) -> int:
    """The seed that initialises the Hugging Face submodule ``name`` (e.g. ``bert.encoder.layer.3.output.dense``)
    of a model built with ``seed`` (``build_model``): the same whichever layers, granularity or process build it."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=7).digest(), "little")


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Build Hugging Face modules with every parameter on the meta device and every buffer real (what
    accelerate's ``init_empty_weights(include_buffers=False)`` does): each registered parameter is moved
    to meta as it is registered, torch's and transformers' initialisation are switched off
    (``no_init_weights``: the CPU tensors a module creates are never written, so never paged in), and so
    is transformers' weight tying (it runs in ``init_weights``). Buffers (BERT's position_ids and
    token_type_ids, the rotary ``inv_freq``) are computed by the modules' own ``__init__``, as always."""
    from transformers.initialization import no_init_weights

    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            p = self._parameters[name]
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _give_storage(p: nn.Parameter, value: Tensor) -> None:
    """Give meta parameter ``p`` the storage ``value`` (same Python object: ``swap_tensors``)."""
    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))


def _post_order(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module``'s submodules (path, module), children first, as transformers' ``initialize_weights``
    visits them."""
    out: list[tuple[str, nn.Module]] = []

    def visit(path: str, m: nn.Module) -> None:
        for name, c in m.named_children():
            visit(f"{path}.{name}" if path else name, c)
        out.append((path, m))

    visit("", module)
    return out


def _init_layer(hf: nn.Module, layer: nn.Module, seed: int, names: dict[int, str], what: str,
                later: frozenset[str] = frozenset()) -> None:
    """Give every meta parameter of ``layer`` storage and initialise it as transformers does -- the model's
    ``_init_weights`` on each submodule, children first -- each submodule from its own seed
    (``module_seed(seed, its name in hf)``; ``names``: id -> that name). ``later``: the names of parameters
    the caller sets itself (a copied head)."""
    from transformers import initialization as hf_init

    fresh = [p for p in layer.parameters() if p.device.type == "meta"]
    for p in fresh:
        _give_storage(p, torch.full(p.shape, float("nan"), dtype=p.dtype))
    with torch.random.fork_rng(devices=[]), torch.no_grad(), hf_init.guard_torch_init_functions():
        for path, m in _post_order(layer):
            # the CPU generator only (the storage is on the CPU): torch.manual_seed also records CUDA/XPU lazy-seed
            # callbacks with a stack trace each time, 0.2-1 ms a call, 62-90 calls a model build
            torch.random.default_generator.manual_seed(module_seed(seed, names.get(id(m), f"{what}/{path}")))
            hf._init_weights(m)
    left = [n for n, p in layer.named_parameters()
            if n not in later and p.is_floating_point() and bool(torch.isnan(p).any())]
    assert not left, f"{what}: {type(hf).__name__}._init_weights leaves {left} uninitialised"


def _copied_heads(family: str, hf: nn.Module, model: LayeredModel) -> dict[int, tuple[str, str]]:
    """Heads that start as a copy of the token embedding (GPT-2's untied LM head; a tied Llama-family head,
    untied here: ``Family.copied_head``): {head layer index: (its parameter's name in the head, the
    embedding's name in layer 0)}."""
    from ptplan.executor.families.registry import get  # the family files import this module

    copied = get(family).copied_head(hf)
    return {} if copied is None else {len(model.layers) - 1: copied}


def _build_layers(family: str, hf: nn.Module, model: LayeredModel, want: list[int], seed: int,
                  folder: Path | None) -> None:
    """Give layers ``want`` of ``model`` (built by ``_params_on_meta``) their weights: from the weight files
    in ``folder`` (only those layers' tensors are read; missing head weights initialised), else
    initialised, each submodule from ``module_seed(seed, its name)``; a copied head as the embedding."""
    copied = _copied_heads(family, hf, model)
    names = {id(m): n for n, m in hf.named_modules(remove_duplicate=False)}
    if folder is not None:
        _load_layers(family, folder, hf, model, want, seed, names, copied)
        return
    for i in want:
        later = frozenset({copied[i][0]}) if i in copied else frozenset()
        _init_layer(hf, model.layers[i], seed, names, f"layer {i} ({model.specs[i].name})", later)
        if i in copied:
            head, emb = copied[i]
            with torch.no_grad():
                dict(model.layers[i].named_parameters())[head].copy_(_embedding_init(hf, model, seed, names, emb))


def _embedding_init(hf: nn.Module, model: LayeredModel, seed: int, names: dict[int, str], name: str) -> Tensor:
    """The initial value of parameter ``name`` of layer 0 (the embedding), whether or not it is built here."""
    import copy

    emb = model.layers[0]
    p = dict(emb.named_parameters())[name]
    if p.device.type != "meta":
        return p.detach()
    shadow = copy.deepcopy(emb)  # meta parameters: nothing is copied but the module tree
    twin = {id(s): names[id(m)] for (_, m), (_, s) in zip(emb.named_modules(remove_duplicate=False),
                                                            shadow.named_modules(remove_duplicate=False))
            if id(m) in names}
    _init_layer(hf, shadow, seed, twin, f"layer 0 ({model.specs[0].name})")
    return dict(shadow.named_parameters())[name].detach()


class _WeightFiles:
    """The tensors of a folder's weight files by name, read one at a time (safetensors ``safe_open``, or
    a ``pytorch_model*.bin`` mapped with ``torch.load(mmap=True)``); safetensors preferred when both exist."""

    def __init__(self, folder: Path) -> None:
        files = weight_files(folder)
        safe = [f for f in files if f.suffix == ".safetensors"]
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        try:
            if safe:
                from safetensors import safe_open

                for f in safe:
                    h = self._stack.enter_context(safe_open(str(f), framework="pt"))
                    self._where.update(dict.fromkeys(h.keys(), h))
            else:
                for f in files:
                    try:
                        sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                    except RuntimeError:  # a legacy (pre-zip) file cannot be mapped: read whole
                        sd = torch.load(f, map_location="cpu", weights_only=True)
                    self._where.update({k: sd for k in sd})
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> "_WeightFiles":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        h = self._where[key]
        return tuple(h[key].shape) if isinstance(h, dict) else tuple(h.get_slice(key).get_shape())

    def get(self, key: str) -> Tensor:
        h = self._where[key]
        return h[key].clone() if isinstance(h, dict) else h.get_tensor(key)  # never a view of the mapped file


def _file_key(name: str, prefix: str, keys: set[str]) -> str | None:
    """The weight-file key of the task model's parameter ``name``: as is, without or with the base model's
    prefix (a base-model checkpoint: ``encoder...`` for ``bert.encoder...``), or with the legacy
    LayerNorm names (``gamma``/``beta``)."""
    cands = [name]
    if name.startswith(prefix + "."):
        cands.append(name[len(prefix) + 1:])
    else:
        cands.append(f"{prefix}.{name}")
    for c in list(cands):
        if c.endswith(".weight"):
            cands.append(c[:-len("weight")] + "gamma")
        elif c.endswith(".bias"):
            cands.append(c[:-len("bias")] + "beta")
    return next((c for c in cands if c in keys), None)


def _load_layers(family: str, d: Path, hf: nn.Module, model: LayeredModel, want: list[int], seed: int,
                 names: dict[int, str], copied: dict[int, tuple[str, str]]) -> None:
    """Layers ``want`` from the weight files in folder ``d``, each tensor read on its own (see ``_build_layers``).

    Every parameter of the whole model is checked against the files first (names and shapes only), so a
    stage build refuses the same checkpoints as a whole build: a missing weight other than the task head's
    (the family's ``head_keys``: initialised from the seed), or a weight of another shape outside it, is a PtplanError.
    """
    hf_name = {id(p): n for n, p in hf.named_parameters(remove_duplicate=False)}
    from ptplan.executor.families.registry import get  # the family files import this module

    head_keys = get(family).head_keys
    prefix = getattr(hf, "base_model_prefix", "")
    emb_name = {i: f"{prefix}.{emb}" for i, (_, emb) in copied.items()}
    try:
        files = _WeightFiles(d)
    except Exception as e:  # safetensors / torch errors for a damaged file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PtplanError(f"cannot load the {family} weights in {d}: {first}") from None
    with files:
        keys = files.keys()
        source: dict[int, str | None] = {}
        missing, mismatched = [], []
        for i, layer in enumerate(model.layers):
            for pname, p in layer.named_parameters():
                name = hf_name.get(id(p))
                if i in copied and pname == copied[i][0]:
                    name = emb_name[i]  # the embedding's weights, as the tied model has them
                assert name is not None, (i, pname)
                key = _file_key(name, prefix, keys)
                head = name in head_keys
                if key is None:
                    if not head:
                        missing.append(name)
                elif files.shape(key) != tuple(p.shape):
                    if not head:  # e.g. a classifier for another number of labels: re-initialised
                        mismatched.append(f"{name} (checkpoint {files.shape(key)}, config {tuple(p.shape)})")
                    key = None
                source[id(p)] = key
        if missing or mismatched:
            bad = sorted(mismatched) or sorted(missing)
            raise PtplanError(f"weights in {d} do not match the {family} architecture in its config.json: "
                              f"{len(missing)} missing and {len(mismatched)} mismatched weights, "
                              f"e.g. {', '.join(bad[:2])}")
        for i in want:
            layer = model.layers[i]
            params = list(layer.parameters())
            if any(source[id(p)] is None for p in params):  # a head without weights: initialised from the seed
                _init_layer(hf, layer, seed, names, f"layer {i} ({model.specs[i].name})")
            with torch.no_grad():
                for p in params:
                    key = source[id(p)]
                    if key is None:
                        continue
                    t = files.get(key).to(p.dtype).contiguous()
                    if p.device.type == "meta":
                        _give_storage(p, t)
                    else:
                        p.copy_(t)
