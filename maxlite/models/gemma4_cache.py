"""Gemma 4's decode caches (maxlite/models/gemma4.py's mixer kinds; maxlite/models/decode.py drives them).

A layer with its own keys and values keeps grouped-query attention's ring (maxlite/models/gqa_cache.py)
over its own shape (a global layer's head dim and kv heads may differ) and leaves, in the forward's
`context`, what its queries attended to: the prompt's keys and values (prefill) or the cache plus the
step's keys with their positions. A key/value-sharing layer keeps no cache (its group's arrays are
empty): it attends with what the last earlier layer of its kind left there, exactly as training does.
"""

from __future__ import annotations

import jax.numpy as jnp

from maxlite.models import attention
from maxlite.models.cache_bits import stored
from maxlite.models.gqa_cache import BATCH_AXES, CACHE_AXES, KV, _attend, _slots, _write, advance, slots  # noqa: F401
from maxlite.models.layers import constrain
from maxlite.models.layout import attention_shape, window

CONTEXT = True  # step reads and writes the forward's context (decode.py passes it)


def empty(cfg, variant: str, layers: int, batch: int, length: int, shared: bool = False):
    """(K/V of `layers` layers over the variant's own shape, the slots' positions [B, S]); a sharing
    layer's group: no slot at all."""
    K, H = attention_shape(cfg, variant == "global")
    S = 0 if shared else slots(window(cfg, variant), length)
    zeros = lambda: constrain(jnp.zeros((layers, batch, S, K, H), stored(cfg.dtype)), CACHE_AXES)  # noqa: E731
    return KV(zeros(), zeros()), jnp.full((batch, S), -1, jnp.int32)


def empty_shared(cfg, variant: str, layers: int, batch: int, length: int):
    return empty(cfg, variant, layers, batch, length, shared=True)


def _attend_with(attn, q_BTNH, seen, positions_BT, w: int, prefill_cfg, blocks_BT=None):
    """The layer's queries over what its kind's producer attended to (`seen`); a prompt's image
    blocks (`blocks_BT`, prefill only) are seen both ways by the sliding-window layers alone."""
    if prefill_cfg is not None:
        k_BSKH, v_BSKH = seen
        segment_ids_BT = jnp.ones(positions_BT.shape, jnp.int32)  # right-padded rows: padding is never seen
        return attention.attend(prefill_cfg, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window=w, scale=attn.query_scale,
                                blocks_BT=blocks_BT if attn.variant == "local" else None)
    keys, values, kpos_BS = seen
    return _attend(q_BTNH, keys, values, kpos_BS, positions_BT, w, attn.query_scale)


def step(attn, x_BTD, positions_BT, lengths_B, kv: KV, pos_BS, variant: str, prefill_cfg=None, context=None,
         blocks_BT=None):
    """A layer with its own keys and values: attend (as gqa_cache.step), leave what it saw in
    `context[variant]`, write the new keys into its ring."""
    w = window(attn.cfg, variant)
    q_BTNH, k_new, v_new = attn.qkv(x_BTD, positions_BT, local=bool(w))
    if prefill_cfg is not None:
        seen = (k_new, v_new)
    else:
        seen = (*(jnp.concatenate([c, new.astype(c.dtype)], axis=1) for c, new in
                  ((kv.k_LBSKH, k_new), (kv.v_LBSKH, v_new))), jnp.concatenate([pos_BS, positions_BT], axis=1))
    context[variant] = seen
    out_BTNH = _attend_with(attn, q_BTNH, seen, positions_BT, w, prefill_cfg, blocks_BT)
    slots_BT = _slots(positions_BT, lengths_B, pos_BS.shape[1])
    new = KV(*(constrain(_write(c, n, slots_BT), CACHE_AXES[1:]) for c, n in
               ((kv.k_LBSKH, k_new), (kv.v_LBSKH, v_new))))
    return attn.out(out_BTNH), new


def step_shared(attn, x_BTD, positions_BT, lengths_B, kv: KV, pos_BS, variant: str, prefill_cfg=None,
                context=None, blocks_BT=None):
    """A key/value-sharing layer: its queries over what its kind's last producer saw; no cache."""
    w = window(attn.cfg, variant)
    q_BTNH, _, _ = attn.qkv(x_BTD, positions_BT, local=bool(w))
    return attn.out(_attend_with(attn, q_BTNH, context[variant], positions_BT, w, prefill_cfg, blocks_BT)), kv
