"""maxlite parameters as nested dicts of numpy arrays, and per-layer access to them.

A "pure" tree is `nnx.to_pure_dict(params)`: {'embedding': [V,D], 'layers': {...}, ...}. With
scan_layers=true each leaf under 'layers' is stacked on a leading axis L; with false 'layers' is
{0: {...}, 1: {...}}. Converters work one layer at a time so both layouts look the same to them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from maxlite.models.layout import layer_place, layer_stacks

Tree = dict[str, Any]


def to_pure(params) -> Tree:
    """nnx.State or nested dict (of jax or numpy arrays) → nested dict of numpy arrays; lazy leaves
    (checkpoints.streamed.LazyLeaf, read a slice at a time) stay lazy."""
    if hasattr(params, "to_pure_dict"):  # an nnx.State
        from flax import nnx
        params = nnx.to_pure_dict(params)
    return _map(params, lambda x: x if getattr(x, "lazy", False) else np.asarray(x))


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return fn(tree)


def leaves(tree: Tree, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def get(tree: Tree, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def put(tree: Tree, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def layer_leaf(pure: Tree, cfg, i: int, path: tuple) -> np.ndarray:
    """One leaf of layer i, e.g. path ('attn', 'q') → [D,N,H] (a view; no copy); wherever the
    layer lives (families.layer_place: a MoE model's dense layers may be stored apart)."""
    block, index = layer_place(cfg, i)
    leaf = get(get(pure, block), path)
    return np.asarray(leaf if index is None else leaf[index])


def empty_layers(cfg, shapes_of: Callable[[int], dict[tuple, tuple]], dtype) -> Tree:
    """Layer storage to fill one layer at a time (stacked [n, ...] arrays or a dict of layers),
    the top-level keys included ("layers", and a MoE model's "dense_layers"); `shapes_of(i)` is
    layer i's {path: shape} (a MoE layer's MLP leaves differ from a dense one's)."""
    counts = {stack.name: stack.count for stack in layer_stacks(cfg)}
    out: Tree = {}
    for i in range(cfg.base_num_decoder_layers):
        block, index = layer_place(cfg, i)
        for path, shape in shapes_of(i).items():
            if index is None:
                put(out, (*block, *path), np.empty(shape, dtype))
            elif index == 0:
                put(out, (*block, *path), np.empty((counts[block[0]], *shape), dtype))
    return out


def set_layer_leaf(pure: Tree, cfg, i: int, path: tuple, value: np.ndarray, expert: int | None = None) -> None:
    """Write layer i's leaf (or, with `expert`, that expert's slice of it) in place."""
    block, index = layer_place(cfg, i)
    target = get(get(pure, block), path)
    where = (() if index is None else (index,)) + (() if expert is None else (expert,))
    target[where if where else ...] = value


def to_state(cfg, pure: Tree):
    """Nested numpy dict → nnx.State with maxlite's structure (for `save_params`)."""
    from flax import nnx

    from maxlite.state import abstract_params

    _, abstract = abstract_params(cfg)
    nnx.replace_by_pure_dict(abstract, pure)
    return abstract




def random_params(cfg, seed: int = 0, std: float = 0.02) -> Tree:
    """Random params of cfg's shapes in numpy (no JAX compute): normal(std) matrices, norm scales
    near 1 and small non-zero biases, so that a swapped or dropped tensor shows in the logits."""
    from flax import nnx

    from maxlite.state import abstract_params

    rng = np.random.default_rng(seed)
    out: Tree = {}
    for path, a in leaves(nnx.to_pure_dict(abstract_params(cfg)[1])):
        name = str(path[-1])
        noise = rng.standard_normal(a.shape, dtype=np.float32)
        value = 1 + 0.2 * noise if name == "scale" else (0.2 if name.endswith("bias") else std) * noise
        put(out, path, value.astype(a.dtype))
    return out


def to_jax_inplace(pure: Tree) -> Tree:
    """Leaf by leaf numpy → jax arrays, dropping each numpy leaf as it goes. Orbax saves jax arrays
    with one host copy less than numpy ones (measured: peak 1.4 GB instead of 2.0 GB for 0.6 GB)."""
    import jax

    for path, _ in list(leaves(pure)):
        put(pure, path, jax.device_put(get(pure, path)))
    return pure
