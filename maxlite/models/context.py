"""One sequence across the context mesh axis: how many shards, which tokens each holds, and attention
run on every shard against the keys of all of them.

The shards are the devices of the mesh axes the logical-axis rules map `activation_length` to
(`context`; maxlite/mesh.py): n of them, each holding T/n tokens of every row. Without load balance
shard s holds tokens [s·T/n, (s+1)·T/n); causal attention then gives the last shard n times the
first one's work. With `context_parallel_load_balance` the sequence is cut into 2n chunks of
L = T/2n tokens and shard s holds chunks s and 2n−1−s (the "balanced layout"): every shard does the
same causal work. The train and eval steps put every [B, T] array of a batch (inputs, targets,
positions, segment ids, weights) into that layout once, after the batch fingerprint
(maxlite/step.py): RoPE reads the positions that travel with the tokens, the loss is a sum over
tokens, so nothing outside the step sees the order.

Attention (`across_shards`) runs an implementation's shard-local function inside a shard_map
whose specs come from the active logical-axis rules: each shard's queries against the keys and
values of the whole sequence, all-gathered over the context axes and put back into sequence order
(the backward pass reduce-scatters dK and dV). Keys are K heads, not N: under GQA the gathered
K/V are a fraction of the queries' size. Nothing here names a mesh axis.
Legend as in layers.py; n shards, L chunk length.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def length_axes() -> tuple[str, ...]:
    """The mesh axes the sequence is split over under the active rules (() outside a rules context)."""
    from flax import linen as nn

    axes = nn.logical_to_mesh_axes(("activation_length",))[0]
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def shards() -> int:
    """How many devices share one sequence: the size of `length_axes` in the active mesh (1 without)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return int(np.prod([mesh.shape[a] for a in length_axes() if a in mesh.shape], dtype=np.int64))


def balanced(cfg) -> bool:
    """Whether a sequence in a step under the active mesh is in the balanced layout."""
    return bool(cfg.context_parallel_load_balance) and shards() > 1


def balanced_order(T: int, n: int) -> np.ndarray:
    """The sequence position of each token of the balanced layout, [T] (the layout's permutation)."""
    L = T // (2 * n)
    chunks = np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)
    return (chunks[:, None] * L + np.arange(L)[None, :]).reshape(-1)


def to_balanced(x_BT, n: int):
    """[B, T, ...] in sequence order → the balanced layout (chunk s, then chunk 2n−1−s, per shard)."""
    B, T = x_BT.shape[:2]
    c = x_BT.reshape(B, 2 * n, T // (2 * n), *x_BT.shape[2:])
    return jnp.stack([c[:, :n], c[:, n:][:, ::-1]], axis=2).reshape(x_BT.shape)


def from_balanced(x_BT, n: int):
    """The inverse of `to_balanced`: the balanced layout → sequence order."""
    B, T = x_BT.shape[:2]
    c = x_BT.reshape(B, n, 2, T // (2 * n), *x_BT.shape[2:])
    return jnp.concatenate([c[:, :, 0], c[:, ::-1, 1]], axis=1).reshape(x_BT.shape)


def balance_batch(batch: dict, n: int) -> dict:
    """Every [B, T] array of a batch in the balanced layout (the step calls this once)."""
    return {k: to_balanced(v, n) if v.ndim >= 2 else v for k, v in batch.items()}


class Chunk(NamedTuple):
    """A contiguous run of a shard's queries: rows [start, start + length) of the shard hold the
    sequence positions [first, first + length) (`first` is traced: it depends on the shard)."""
    start: int
    length: int
    first: jax.Array


def shard_chunks(T_local: int, n: int, is_balanced: bool, index) -> list[Chunk]:
    """The query chunks of shard `index` (traced) of n."""
    if not is_balanced:
        return [Chunk(0, T_local, index * T_local)]
    L = T_local // 2
    return [Chunk(0, L, index * L), Chunk(L, L, (2 * n - 1 - index) * L)]


def query_positions(chunks: list[Chunk]):
    """Sequence position of each of a shard's query rows [T_local] (traced)."""
    return jnp.concatenate([c.first + jnp.arange(c.length) for c in chunks])


def _spec(*logical):
    from flax import linen as nn

    return nn.logical_to_mesh_axes(logical)


# the shard-local attention: (q_BTNH, k_BSKH, v_BSKH of the whole sequence in sequence order,
# query segment ids [B, T_local], key segment ids [B, S], the shard's query chunks) → out_BTNH
Local = Callable[..., jax.Array]


def across_shards(local: Local, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, is_balanced: bool,
                  extra=None, extra_spec=None):
    """`local` on every shard with the whole sequence's keys (all-gathered over the context axes,
    in sequence order); batch and heads stay split as the rules say. `extra` (with its shard_map
    spec `extra_spec`) is passed on as local's last argument (the splash kernel's mask info)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes, n = length_axes(), shards()
    q_spec = _spec("activation_batch", "activation_length", "activation_heads", None)
    kv_spec = _spec("activation_batch", "activation_length", "activation_kv_heads", None)
    seg_spec = _spec("activation_batch", "activation_length")

    def gather(x_BT):
        whole = jax.lax.all_gather(x_BT, axes, axis=1, tiled=True)
        return from_balanced(whole, n) if is_balanced else whole

    def body(q, k, v, seg, *rest):
        chunks = shard_chunks(q.shape[1], n, is_balanced, jax.lax.axis_index(axes))
        return local(q, gather(k), gather(v), seg, gather(seg), chunks, *rest)

    specs = (q_spec, kv_spec, kv_spec, seg_spec) + (() if extra is None else (extra_spec,))
    args = (q_BTNH, k_BSKH, v_BSKH, segment_ids_BT) + (() if extra is None else (extra,))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)
