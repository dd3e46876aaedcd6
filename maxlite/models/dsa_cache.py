"""DeepSeek sparse attention's decode cache (the `dsa` mixer kind's; maxlite/models/decode.py drives it).

Latent attention's cache (maxlite/models/mla_cache.py: the normed latent and the shared RoPE key,
C + R numbers per token) and beside it the indexer's key of every token (J = index_head_dim
numbers), so C + R + J per token and layer. A decode step scores every filled slot's indexer key with
the new tokens' indexer queries, keeps the `index_topk` best visible ones and reads only those slots'
latents (the up-projections absorbed, as mla_cache); the prefill runs the same over the prompt, then
writes the prompt's latents and indexer keys. Slots and the shared record of slot positions are grouped-query
attention's (maxlite/models/gqa_cache.py).

Shape legend as in dsa.py, plus S cache slots and L the layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlite.models.cache_bits import stored
from maxlite.models.dsa import Keys
from maxlite.models.gqa_cache import _slots, _write, advance, slots  # noqa: F401 (advance: this kind's)
from maxlite.models.layers import constrain
from maxlite.models.mla_cache import CACHE_AXES

BATCH_AXES = (1, 0)  # of (every per-layer leaf [L, B, S, ·], the shared slot record [B, S])


class Indexed(NamedTuple):
    """The latents and the indexer's keys of the layers: [L, B, S, C], [L, B, S, R], [L, B, S, J]."""
    c_LBSC: jax.Array
    k_rope_LBSR: jax.Array
    k_index_LBSJ: jax.Array


def empty(cfg, variant: str, layers: int, batch: int, length: int) -> tuple[Indexed, jax.Array]:
    """(the caches of `layers` layers, the slots' positions [B, S] they share), empty."""
    S = slots(0, length)
    zeros = lambda width: constrain(jnp.zeros((layers, batch, S, width), stored(cfg.dtype)),  # noqa: E731
                                    CACHE_AXES)
    return (Indexed(zeros(cfg.kv_lora_rank), zeros(cfg.qk_rope_head_dim), zeros(cfg.index_head_dim)),
            jnp.full((batch, S), -1, jnp.int32))


def step(dsa, x_BTD, positions_BT, lengths_B, cache: Indexed, pos_BS, variant: str, prefill_cfg=None):
    """One layer over T new tokens (`cache` this layer's [B, S, ·]): the prefill attends the new
    tokens among themselves (right-padded rows: padding sits after every real token, so no real query
    sees it), a decode step the filled slots and the new tokens; both read each query's chosen latents
    only (dsa.DSA.sparse). Then the new latents and indexer keys are written. Returns (the attention's
    output x_BTD, the new cache)."""
    c_new, k_rope_new = dsa.latent(x_BTD, positions_BT)
    k_index_new = dsa.index_keys(x_BTD, positions_BT)
    ones_BT = jnp.ones(positions_BT.shape, jnp.int32)
    if prefill_cfg is not None:
        keys = Keys(c_new, k_rope_new, k_index_new, positions_BT, ones_BT)
    else:
        c_BSC, k_rope_BSR, k_index_BSJ = (
            jnp.concatenate([old, new.astype(old.dtype)], axis=1)
            for old, new in ((cache.c_LBSC, c_new), (cache.k_rope_LBSR, k_rope_new), (cache.k_index_LBSJ, k_index_new)))
        kpos_BS = jnp.concatenate([pos_BS, positions_BT], axis=1)
        keys = Keys(c_BSC, k_rope_BSR, k_index_BSJ, kpos_BS, jnp.ones(kpos_BS.shape, jnp.int32))
    out_BTNV = dsa.sparse(x_BTD, positions_BT, ones_BT, keys)
    slots_BT = _slots(positions_BT, lengths_B, pos_BS.shape[1])
    new = Indexed(*(constrain(_write(old, n, slots_BT), CACHE_AXES[1:]) for old, n in
                    ((cache.c_LBSC, c_new), (cache.k_rope_LBSR, k_rope_new), (cache.k_index_LBSJ, k_index_new))))
    return dsa.out(out_BTNV.astype(x_BTD.dtype)), new
