"""Grouped-query attention's decode cache (the `attention` mixer kind's; maxlite/models/decode.py
drives it for every layer of the kind).

Shape legend as in layers.py, plus S cache slots and L the layers of one variant. The cache holds the
K/V heads only (GQA: K of them, not N) in the compute dtype: a global layer keeps every position
(S = prompt + new tokens), a sliding-window layer only its last W (S = min(W, prompt + new tokens))
as a ring: position p lives in slot p mod S (a chunked layer's ring is its chunk C: its keys lie less
than C back, and a query sees only those of its own chunk, j // C = p // C), and the layers of one
variant share the record of the position in every slot (-1: empty). A step's queries attend to the
cache as it was plus the step's own keys, under one rule: key position j is visible to query
position p iff 0 ≤ j ≤ p (and p − j < W in a window); padding past len_b is never written. The prefill runs the training
attention (maxlite.models.attention.attend: blockwise, splash, cuDNN, and with context parallelism
the prompt split over the context axis), so a long prompt never builds its [P, P] scores; new keys
go into their slots by a scatter, never a [T, S] one-hot.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlite.models import attention, cache_read
from maxlite.models.cache_bits import load, store, stored
from maxlite.models.layers import constrain
from maxlite.models.layout import chunk, window

# the cache's logical axes: K/V heads split like the attention's (tensor), layers and batch not split
CACHE_AXES = ("layers", "activation_batch", "activation_length", "activation_kv_heads", "head_dim")
# the batch axis of every leaf of (the per-layer cache [L, B, ...], the shared slot record [B, S]): where
# one sequence's cache is cut out and written into another batch (maxlite/rollout/slots.py)
BATCH_AXES = (1, 0)


class KV(NamedTuple):
    """K and V of the layers of one variant [L, B, S, K, H]."""
    k_LBSKH: jax.Array
    v_LBSKH: jax.Array


def slots(w: int, length: int) -> int:
    return min(w, length) if w else length


def empty(cfg, variant: str, layers: int, batch: int, length: int) -> tuple[KV, jax.Array]:
    """(K/V of `layers` layers, the slots' positions [B, S] they share), empty; held as
    maxlite/models/cache_bits.py says (a CPU's 16-bit floats as their bits)."""
    shape = (layers, batch, slots(window(cfg, variant), length), cfg.base_num_kv_heads, cfg.head_dim)
    zeros = lambda: constrain(jnp.zeros(shape, stored(cfg.dtype)), CACHE_AXES)  # noqa: E731
    return KV(zeros(), zeros()), jnp.full(shape[1:3], -1, jnp.int32)


def _slots(positions_BT, lengths_B, size: int):
    """The slot each new token goes to [B, T]: its position mod S, for the last S real tokens
    (position < len_b) only, so no two of them collide; `size` (past the end: dropped) for the rest,
    so padding is never written."""
    valid_BT = (positions_BT < lengths_B[:, None]) & (positions_BT >= lengths_B[:, None] - size)
    return jnp.where(valid_BT, positions_BT % size, size)


def _write(cache_BS, new_BT, slots_BT):
    """cache[b, slots[b, t]] = new[b, t] (slots past the end dropped)."""
    rows_B1 = jnp.arange(cache_BS.shape[0])[:, None]
    return cache_BS.at[rows_B1, slots_BT].set(new_BT.astype(cache_BS.dtype), mode="drop")


def _attend(q_BTNH, k_BSKH, v_BSKH, kpos_BS, qpos_BT, w: int, scale: float, sinks_N=None, c: int = 0):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH).astype(jnp.float32) * scale
    kpos, qpos = kpos_BS[:, None, :], qpos_BT[:, :, None]
    visible_BTS = (kpos >= 0) & (kpos <= qpos)
    if w:
        visible_BTS &= qpos - kpos < w
    if c:  # a chunked layer: its own chunk only
        visible_BTS &= qpos // c == kpos // c
    scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = attention.softmax_with_sinks(scores_BKGTS, sinks_N).astype(v_BSKH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH).reshape(B, T, N, H)


def step(attn, x_BTD, positions_BT, lengths_B, kv: KV, pos_BS, variant: str, prefill_cfg=None, rope_BT=None,
         blocks_BT=None):
    """One layer's attention over T new tokens (`kv` this layer's [B, S, K, H]): to (cache, new
    keys) — in the prefill, to the new keys alone (the cache is empty) through the training
    attention —, then the new keys written. Returns (the attention's output x_BTD, the new KV).
    `rope_BT`: the positions RoPE turns by where they are not the slots' (multimodal RoPE's
    [B, T, 3]; decode.forward). `blocks_BT`: the prompt's image blocks, seen both ways in the prefill
    (later tokens are text: causal, as transformers' generate drops token_type_ids after the prefill)."""
    w, c = window(attn.cfg, variant), chunk(attn.cfg, variant)
    q_BTNH, k_new, v_new = attn.qkv(x_BTD, positions_BT if rope_BT is None else rope_BT, local=bool(w))
    scale = attn.query_scale or 1.0 / math.sqrt(q_BTNH.shape[-1])
    if prefill_cfg is not None:
        # right-padded rows: padding sits after every real token, so no real query sees it
        segment_ids_BT = jnp.ones(positions_BT.shape, jnp.int32)
        out_BTNH = attention.attend(prefill_cfg, q_BTNH, k_new, v_new, segment_ids_BT, window=w,
                                    scale=attn.query_scale, sinks_N=attn.sinks_N(), blocks_BT=blocks_BT, chunk=c,
                                    positions_BT=positions_BT)
    else:
        keys, values = (jnp.concatenate([c, new.astype(c.dtype)], axis=1)
                        for c, new in ((kv.k_LBSKH, k_new), (kv.v_LBSKH, v_new)))
        kpos_BS = jnp.concatenate([pos_BS, positions_BT], axis=1)
        out_BTNH = _attend(q_BTNH, keys, values, kpos_BS, positions_BT, w, scale, attn.sinks_N(), c)
    slots_BT = _slots(positions_BT, lengths_B, pos_BS.shape[1])
    new = KV(*(constrain(_write(c, n, slots_BT), CACHE_AXES[1:]) for c, n in
               ((kv.k_LBSKH, k_new), (kv.v_LBSKH, v_new))))
    return attn.out(attn.gated(out_BTNH, x_BTD)), new


def _write_at(stack_LBS, j, new_BT, slots_BT, dtype):
    """stack[j, b, slots[b, t]] = new[b, t] (slots past the end dropped; the stack keeps `dtype` values,
    held as cache_bits says): in place on the loop's buffer."""
    rows_B1 = jnp.arange(stack_LBS.shape[1])[:, None]
    return stack_LBS.at[j, rows_B1, slots_BT].set(store(new_BT, stack_LBS.dtype, dtype), mode="drop")


def step_in_stack(attn, x_BTD, positions_BT, lengths_B, kv: KV, j, pos_BS, variant: str, prefill_cfg=None,
                  rope_BT=None, blocks_BT=None):
    """`step` on layer j of the variant's stack `kv` [L, B, S, K, H], updated where it lies: the new
    keys are written first, then the queries read the filled slots block by block
    (maxlite/models/cache_read.py), so a step copies no slot of the cache. Returns (x_BTD, the stack)."""
    w, c = window(attn.cfg, variant), chunk(attn.cfg, variant)
    T, S, dtype = x_BTD.shape[1], pos_BS.shape[1], jnp.dtype(attn.cfg.dtype)
    if prefill_cfg is None and w and T > 1:
        # a ring's multi-token step could overwrite keys its own earlier queries still see: read first
        out_BTD, layer = step(attn, x_BTD, positions_BT, lengths_B, KV(*(load(a[j], dtype) for a in kv)), pos_BS,
                              variant, rope_BT=rope_BT)
        return out_BTD, KV(*(constrain(a.at[j].set(store(n, a.dtype, dtype)), CACHE_AXES) for a, n in zip(kv, layer)))
    q_BTNH, k_new, v_new = attn.qkv(x_BTD, positions_BT if rope_BT is None else rope_BT, local=bool(w))
    slots_BT = _slots(positions_BT, lengths_B, S)
    kv = KV(*(constrain(_write_at(c, j, n, slots_BT, dtype), CACHE_AXES) for c, n in zip(kv, (k_new, v_new))))
    if prefill_cfg is not None:
        segment_ids_BT = jnp.ones(positions_BT.shape, jnp.int32)  # right-padded rows: no real query sees padding
        out_BTNH = attention.attend(prefill_cfg, q_BTNH, k_new, v_new, segment_ids_BT, window=w,
                                    scale=attn.query_scale, sinks_N=attn.sinks_N(), blocks_BT=blocks_BT, chunk=c,
                                    positions_BT=positions_BT)
    else:
        scale = attn.query_scale or 1.0 / math.sqrt(q_BTNH.shape[-1])
        filled = jnp.minimum(jnp.max(lengths_B), S)  # slots [0, filled) are all that was ever written
        out_BTNH = cache_read.attend(q_BTNH, kv.k_LBSKH, kv.v_LBSKH, j, pos_BS, positions_BT, slots_BT, filled, w,
                                     scale, attn.sinks_N(), chunk=c)
    return attn.out(attn.gated(out_BTNH, x_BTD)), kv


def advance(pos_BS, positions_BT, lengths_B):
    """The shared record of slot positions once these tokens are written."""
    return _write(pos_BS, positions_BT, _slots(positions_BT, lengths_B, pos_BS.shape[1]))
