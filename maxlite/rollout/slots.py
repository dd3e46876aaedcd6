"""One sequence's decode cache written into a slot of the batch cache, for every mixer kind.

A decode cache (maxlite/models/decode.py `Cache`) holds, per (mixer, variant), a per-layer part and
a part its layers share; each kind's cache module declares the batch axis of the leaves of each
(`BATCH_AXES`: K/V [L, B, S, K, H], MLA's latents [L, B, S, ·], the delta-net's state [L, B, ...],
the slot records [B, S]). A row is cut out along that axis and written in place along the same
axis of the slots' cache: the whole row, so a refilled slot keeps nothing of its last sequence
(its slot record says which positions it holds: -1 past the prompt). `take_rows` cuts a smaller
batch out along the same axes (the engine's narrower step once few sequences are left).
"""

from __future__ import annotations

import jax

from maxlite.models.decode import Cache
from maxlite.models.kinds import MIXERS


def _copy(dst, src, row, slot, axis: int):
    return jax.lax.dynamic_update_slice_in_dim(dst, jax.lax.dynamic_slice_in_dim(src, row, 1, axis), slot, axis)


def copy_row(dst: Cache, src: Cache, row, slot) -> Cache:
    """`dst` with slot `slot` set to row `row` of `src` (same kinds, same cache length)."""
    stacks = {}
    for key, (per_layer, shared) in dst.stacks.items():
        layer_axis, shared_axis = MIXERS[key[0]].cache().BATCH_AXES
        src_layer, src_shared = src.stacks[key]
        stacks[key] = (jax.tree.map(lambda d, s: _copy(d, s, row, slot, layer_axis), per_layer, src_layer),
                       jax.tree.map(lambda d, s: _copy(d, s, row, slot, shared_axis), shared, src_shared))
    return Cache(stacks)


def take_rows(cache: Cache, rows) -> Cache:
    """The cache of rows `rows` of `cache`, in that order: a batch of len(rows)."""
    stacks = {}
    for key, (per_layer, shared) in cache.stacks.items():
        layer_axis, shared_axis = MIXERS[key[0]].cache().BATCH_AXES
        stacks[key] = (jax.tree.map(lambda a: a.take(rows, axis=layer_axis), per_layer),
                       jax.tree.map(lambda a: a.take(rows, axis=shared_axis), shared))
    return Cache(stacks)
