"""Architecture-independent HF ↔ maxlite conversion: tensor tables, streaming export, import.

An adapter module (maxlite/families/NAME/hf.py, over hf_llama.py's table) describes every HF tensor as a `TensorMap`: the maxlite
leaves it is made of and the two pure functions between them. Everything else — slicing one layer
out of stacked [L, ...] arrays, casting, streaming into safetensors, filling preallocated layers
on import, checking nothing is missing or left over — lives here once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np

from maxlite.bridge import params as P
from maxlite.schema import ConfigError
from maxlite.bridge.safetensors_io import Entry, SafetensorsDir
from maxlite.models.layout import layer_kinds, layer_place, layer_stacks

Array = np.ndarray


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One HF tensor ↔ one or more maxlite leaves (`layer` maps repeat per layer: `{i}` in `hf`)."""
    hf: str
    paths: tuple[tuple[str, ...], ...]
    hf_shape: tuple[int, ...]
    ml_shapes: tuple[tuple[int, ...], ...]
    to_hf: Callable[..., Array]                     # leaves → HF tensor
    from_hf: Callable[[Array], tuple[Array, ...]]   # HF tensor → leaves
    layer: bool = True
    mlp: str | None = None     # only in layers whose MLP is this ("dense" | "moe"; families.layer_mlps)
    expert: int | None = None  # the HF tensor is this expert's slice of the (stacked [E, ...]) leaves
    mixer: str | None = None   # only in layers whose mixer is this (a family whose layers differ in shape)
    stacked: tuple[int, int] | None = None  # (k, n): the HF tensor is slice k of leaves stacked [n, ...] (not a
                                            # decoder layer's: a vision tower's scanned layer k of n)
    alt_hf_shape: tuple[int, ...] | None = None  # the same tensor as another writer lays it out (transformers 5
                                                 # saves Qwen3-VL-MoE's experts transposed): from_hf reads both


def of_expert(t: TensorMap, j: int) -> TensorMap:
    """`t` (a map of one expert's tensor: `{j}` in its name, ml_shapes without E) as expert j's
    slice of leaves stacked over `num_experts` experts."""
    return dataclasses.replace(t, hf=t.hf.replace("{j}", str(j)), expert=j, mlp="moe")


def linear(hf: str, path: tuple[str, ...], in_shape: tuple[int, ...], out_shape: tuple[int, ...],
           layer: bool = True) -> TensorMap:
    """A maxlite kernel [*in, *out] ↔ a torch nn.Linear weight [prod(out), prod(in)]."""
    n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
    return TensorMap(hf, (path,), (n_out, n_in), ((*in_shape, *out_shape),),
                     lambda w: w.reshape(n_in, n_out).T,
                     lambda t: (t.T.reshape(*in_shape, *out_shape),), layer)


def same(hf: str, path: tuple[str, ...], shape: tuple[int, ...], hf_shape: tuple[int, ...] | None = None,
         layer: bool = True) -> TensorMap:
    """Same values, possibly flattened or reshaped."""
    hf_shape = hf_shape or shape
    return TensorMap(hf, (path,), hf_shape, (shape,), lambda w: w.reshape(hf_shape),
                     lambda t: (t.reshape(shape),), layer)


def config_tail(dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """The keys every architecture's config.json ends with (4.x reads `torch_dtype`, 5.x `dtype`)."""
    return {"use_cache": True, "bos_token_id": bos_id, "eos_token_id": eos_id,
            "torch_dtype": dtype, "dtype": dtype}


def expand(cfg, maps: list[TensorMap]) -> Iterator[tuple[str, TensorMap, int | None]]:
    """(HF name, map, layer index or None): globals first, then layer by layer (each layer the
    maps of its MLP kind)."""
    num_layers, kinds = cfg.base_num_decoder_layers, layer_kinds(cfg)
    for t in maps:
        if not t.layer:
            yield t.hf, t, None
    for i in range(num_layers):
        for t in maps:
            if t.layer and _in_layer(t, kinds[i]):
                yield t.hf.format(i=i), t, i


def _in_layer(t: TensorMap, kind) -> bool:
    """A layer map of this layer's kinds."""
    return t.mlp in (None, kind.ffn) and t.mixer in (None, kind.mixer)


def export_entries(cfg, maps: list[TensorMap], pure: P.Tree, dtype) -> list[Entry]:
    """Lazy HF tensors: each is built from its (sliced) maxlite leaves only when written. The leaves
    are numpy arrays or lazy ones (checkpoints.streamed.LazyLeaf: a slice is read when asked for)."""
    def producer(t: TensorMap, i: int | None):
        def produce():
            leaves = []
            for p in t.paths:  # only this layer's (and expert's) slice is read: a lazy leaf reads no more
                where, index = _place(cfg, p, t, i)
                leaf = P.get(pure, where)
                leaves.append(np.asarray(leaf[index] if index else leaf))
            return np.asarray(t.to_hf(*leaves), dtype=dtype, order="C")  # the one copy (a scalar stays 0-D)
        return produce

    return [Entry(name, t.hf_shape, np.dtype(dtype), producer(t, i))
            for name, t, i in expand(cfg, maps)]


def _place(cfg, path: tuple, t: TensorMap, i: int | None) -> tuple[tuple, tuple[int, ...]]:
    """(the leaf's path in the whole tree, the leading indices of this HF tensor's slice of it)."""
    expert = (() if t.expert is None else (t.expert,)) + (() if t.stacked is None else (t.stacked[0],))
    if i is None:
        return path, expert
    block, index = layer_place(cfg, i)
    return (*block, *path), (() if index is None else (index,)) + expert


def leaf_shapes(cfg, maps: list[TensorMap]) -> dict[tuple, tuple[tuple[int, ...], int]]:
    """{leaf path: (its shape, how many leading axes its HF tensors are slices of)} of every leaf
    the maps fill: a stacked layer leaf [n, ...] is filled one layer (and expert) at a time."""
    counts = {stack.name: stack.count for stack in layer_stacks(cfg)}
    out: dict = {}
    for _, t, i in expand(cfg, maps):
        for path, shape in zip(t.paths, t.ml_shapes):
            where, index = _place(cfg, path, t, i)
            if where in out:
                continue
            stacked = i is not None and layer_place(cfg, i)[1] is not None
            lead = ([counts[where[0]]] if stacked else []) + ([cfg.num_experts] if t.expert is not None else []) \
                + ([t.stacked[1]] if t.stacked is not None else [])
            out[where] = ((*lead, *shape), len(lead))
    return out


def check_tensors(cfg, maps: list[TensorMap], source, ignore: Callable[[str], bool] = lambda name: False) -> None:
    """Before anything is written: every tensor the model needs is there, in the shape config.json
    implies (where the source knows shapes without reading), and no tensor is left over. A checkpoint
    that does not match its config.json is the user's input: one line, exit 2."""
    names = set(source.names())
    shape_of = getattr(source, "shape", None)
    for name, t, _ in expand(cfg, maps):
        if name not in names:
            hint = " but tie_word_embeddings is false" if name == "lm_head.weight" else \
                " (does config.json match the weights?)"
            raise ConfigError(f"{source.path}: tensor {name} missing{hint}")
        if shape_of is not None and shape_of(name) not in (t.hf_shape, t.alt_hf_shape):
            raise ConfigError(f"{source.path}: {name} has shape {shape_of(name)}, config.json implies {t.hf_shape}")
        names.discard(name)
    if cfg.logits_via_embedding:
        names.discard("lm_head.weight")  # tied: some writers store the shared matrix twice
    unused = sorted(n for n in names if not ignore(n))
    if unused:
        raise ConfigError(f"{source.path}: {len(unused)} tensors not mapped, e.g. {unused[0]} (a tensor this "
                          f"model has no place for: is config.json this checkpoint's?)")


def pieces(cfg, maps: list[TensorMap], source, dtype, share: tuple[int, int] = (0, 1),
           progress: Callable[[str], None] | None = None) -> Iterator[tuple[tuple, tuple[int, ...], Array]]:
    """(leaf path, leading indices, values in `dtype`) of every slice the HF tensors fill, one HF
    tensor read at a time, in file order; `share` = (k, n): only every n-th tensor from the k-th
    (a process's part of a multi-process import)."""
    k, n = share
    for number, (name, t, i) in enumerate(expand(cfg, maps)):
        if number % n != k:
            continue
        raw = source.get(name)
        if tuple(raw.shape) not in (t.hf_shape, t.alt_hf_shape):
            raise ConfigError(f"{source.path}: {name} has shape {tuple(raw.shape)}, config.json implies {t.hf_shape}")
        for path, value in zip(t.paths, t.from_hf(raw)):
            where, index = _place(cfg, path, t, i)
            # own copy, not the mmap (np.array: ascontiguousarray would make a scalar 1-D)
            yield where, index, np.array(value, dtype=dtype, order="C")
        del raw
        if progress:
            progress(name)


def import_params(cfg, maps: list[TensorMap], source: SafetensorsDir, dtype,
                  ignore: Callable[[str], bool] = lambda name: False,
                  progress: Callable[[str], None] | None = None) -> P.Tree:
    """HF tensors → maxlite nested numpy dict in memory (the streaming import to a checkpoint is
    hf.import_to_checkpoint), filling preallocated arrays one tensor at a time."""
    check_tensors(cfg, maps, source, ignore)
    pure: P.Tree = {}
    for path, (shape, _) in leaf_shapes(cfg, maps).items():
        P.put(pure, path, np.empty(shape, dtype))
    for path, index, value in pieces(cfg, maps, source, dtype, progress=progress):
        P.get(pure, path)[index if index else ...] = value
    return pure
