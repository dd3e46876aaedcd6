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
from maxlite.models.layout import layer_kinds

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
    """Lazy HF tensors: each is built from its (sliced) maxlite leaves only when written."""
    def producer(t: TensorMap, i: int | None):
        def produce():
            leaves = [np.asarray(P.get(pure, p) if i is None else P.layer_leaf(pure, cfg, i, p))
                      for p in t.paths]
            leaves = leaves if t.expert is None else [leaf[t.expert] for leaf in leaves]
            return np.ascontiguousarray(t.to_hf(*leaves), dtype=dtype)  # the one copy
        return produce

    return [Entry(name, t.hf_shape, np.dtype(dtype), producer(t, i))
            for name, t, i in expand(cfg, maps)]


def import_params(cfg, maps: list[TensorMap], source: SafetensorsDir, dtype,
                  ignore: Callable[[str], bool] = lambda name: False,
                  progress: Callable[[str], None] | None = None) -> P.Tree:
    """HF tensors → maxlite nested numpy dict, filling preallocated arrays one tensor at a time. A
    checkpoint whose tensors do not match its config.json is the user's input: one line, exit 2."""
    names = set(source.names())
    kinds = layer_kinds(cfg)

    def shapes_of(i: int) -> dict:
        return {p: (cfg.num_experts, *s) if t.expert is not None else s for t in maps
                if t.layer and _in_layer(t, kinds[i]) for p, s in zip(t.paths, t.ml_shapes)}

    pure: P.Tree = P.empty_layers(cfg, shapes_of, dtype)
    for name, t, i in expand(cfg, maps):
        if name not in names:
            hint = " but tie_word_embeddings is false" if name == "lm_head.weight" else \
                " (does config.json match the weights?)"
            raise ConfigError(f"{source.path}: tensor {name} missing{hint}")
        raw = source.get(name)
        if tuple(raw.shape) != t.hf_shape:
            raise ConfigError(f"{source.path}: {name} has shape {tuple(raw.shape)}, config.json implies {t.hf_shape}")
        names.discard(name)
        for path, value in zip(t.paths, t.from_hf(raw)):
            if i is None and t.expert is not None:  # one expert's slice of a leaf outside the layers (MTP's)
                if t.expert == 0:
                    P.put(pure, path, np.empty((cfg.num_experts, *value.shape), dtype))
                P.get(pure, path)[t.expert] = value
            elif i is None:
                P.put(pure, path, np.array(value, dtype=dtype, order="C"))  # own copy, not the mmap
            else:  # straight into the preallocated layer slot (numpy casts on assignment)
                P.set_layer_leaf(pure, cfg, i, path, value, t.expert)
        if progress:
            progress(name)
    if cfg.logits_via_embedding:
        names.discard("lm_head.weight")  # tied: some writers store the shared matrix twice
    unused = sorted(n for n in names if not ignore(n))
    if unused:
        raise ConfigError(f"{source.path}: {len(unused)} tensors not mapped, e.g. {unused[0]}")
    return pure
