"""DeepSeek-V4's decode cache (the `v4_*` mixer kinds'; maxlite/models/decode.py drives it).

Per layer and sequence, one slot per position (S = the decode length): the one key=value head of
each token [S, H] (held as cache_bits says), and in a compressed layer its compressor's kv and gate
projections [S, C] (float32), in a sparse one also its indexer's [S, 2J]. A step writes the new
tokens' into their positions' slots (padding never), then pools the compressed entries of every
whole window from the projections (maxlite/models/v4_attention.py `Compressor.pool`: an entry is
only visible once its window has ended, so a window still filling is never read), and attends as
training does: the sliding window's slots, then the entries (a sparse layer's: its indexer's
choice). The prefill is the same step on an empty cache. Each step pools every window again: work
that grows with the context, not with the entries a step adds (a running record of the entries
would not); the slots keep every position, not the window's last W.

Shape legend as in v4_attention.py, plus L the layers of one variant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxlite.models.attention_mask import visible
from maxlite.models.cache_bits import stored
from maxlite.models.gqa_cache import _slots, _write

BATCH_AXES = (1, 0)  # of (every per-layer leaf [L, B, S, ·], the shared part: none)


def empty(cfg, variant: str, layers: int, batch: int, length: int) -> tuple[dict, tuple]:
    """(the slots of `layers` layers of the variant, nothing shared), empty."""
    zeros = lambda width, dtype: jnp.zeros((layers, batch, length, width), dtype)  # noqa: E731
    cache = {"kv": zeros(cfg.head_dim, stored(cfg.dtype))}
    if variant in ("hca", "csa"):
        width = cfg.head_dim * (2 if variant == "csa" else 1)
        cache.update(kv_c=zeros(width, jnp.float32), gate_c=zeros(width, jnp.float32))
    if variant == "csa":
        cache.update(kv_i=zeros(2 * cfg.index_head_dim, jnp.float32), gate_i=zeros(2 * cfg.index_head_dim, jnp.float32))
    return cache, ()


def step(attn, x_BTD, positions_BT, lengths_B, cache: dict, shared, variant: str, prefill_cfg=None):
    """One layer's attention over T new tokens (`cache` this layer's [B, S, ·]): the new tokens'
    slots written, then their queries against every filled slot and the entries. Returns (the
    attention's output x_BTD, the new cache)."""
    B, S = cache["kv"].shape[:2]
    slots_BT = _slots(positions_BT, lengths_B, S)
    q_BTNH, q_BTQ = attn.queries(x_BTD, positions_BT)
    new = {"kv": _write(cache["kv"], attn.keys(x_BTD, positions_BT), slots_BT)}
    kv_BSH = new["kv"].astype(x_BTD.dtype)
    seen_BTS = visible(positions_BT[:, :, None], jnp.arange(S)[None, None, :], attn.cfg.sliding_window)
    entries_BEH = seen_BTE = None
    if variant in ("hca", "csa"):
        kv_c, gate_c = attn.compressor.projections(x_BTD)
        new.update(kv_c=_write(cache["kv_c"], kv_c, slots_BT), gate_c=_write(cache["gate_c"], gate_c, slots_BT))
        index = None
        if variant == "csa":
            kv_i, gate_i = attn.indexer.projections(x_BTD)
            new.update(kv_i=_write(cache["kv_i"], kv_i, slots_BT), gate_i=_write(cache["gate_i"], gate_i, slots_BT))
            index = (new["kv_i"], new["gate_i"])
        if S >= attn.rate:  # room for a whole window; the slots as one sequence from position 0, so a
            # window still filling is seen by no query
            slots_BS, one_BS = jnp.broadcast_to(jnp.arange(S), (B, S)), jnp.ones((B, S), jnp.int32)
            entries_BEH, seen_BTE, _ = attn.entries((new["kv_c"], new["gate_c"]), index, slots_BS, one_BS, q_BTQ,
                                                    positions_BT, jnp.ones_like(positions_BT), x_BTD)
    out_BTNH, _ = attn.attend_dense(q_BTNH, kv_BSH, seen_BTS, entries_BEH, seen_BTE)
    return attn.finish(out_BTNH, None, None, positions_BT), new


def advance(shared, positions_BT, lengths_B):
    return shared

