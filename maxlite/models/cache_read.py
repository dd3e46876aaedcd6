"""A decode step's attention read of a stacked K/V cache, block by block over the filled slots only.

A decode step writes its keys into the cache first (in place: the cache is the loop's carried
buffer) and then reads it here, so it never builds the cache plus its new keys (a concatenation
copies every slot each step) nor slices a layer out of the stack (a copy as large as the read).
Each block of `block` slots is cut out of the stack where it lies ([L, B, S, K, H] at layer j: a
copy small enough to stay in the processor's cache until the dot reads it) and folded into an
online softmax, as blockwise attention does; blocks past the longest row's filled slots are not
read at all, so a cache allocated for more tokens than written costs nothing per step.

Shape legend as in layers.py, plus L the layers of one stack, S cache slots, C slots per block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxlite.models.attention_mask import visible
from maxlite.models.cache_bits import load

BLOCK = 1024  # slots per block: K and V of a block (2 × C × K × H numbers) stay in L2 between copy and dot
_NEG = float(jnp.finfo(jnp.float32).min)


def attend(q_BTNH, k_LBSKH, v_LBSKH, j, kpos_BS, qpos_BT, slots_BT, filled, window: int, scale: float,
           sinks_N=None, block: int | None = None, chunk: int = 0):
    """Queries at qpos_BT, whose own keys were just written to slots_BT (S: not written), against
    layer j's cache slots [0, filled); kpos_BS is each slot's position before this step (−1 empty),
    so the stack's shared record is advanced once per forward, not copied per layer. Key position p'
    is visible to query position p iff 0 ≤ p' ≤ p (and p − p' < window; with `chunk` C, p' // C = p // C).
    Returns out_BTNH."""
    _, B, S, K, H = k_LBSKH.shape
    T, N = q_BTNH.shape[1:3]
    G = N // K
    C = min(block or BLOCK, S)
    q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
    qpos_BT1 = qpos_BT[:, :, None]

    def body(c, carry):
        m, l, acc = carry  # [B, K, G, T] (acc: ..., H), float32
        # the last block is shifted back to fit (dynamic_slice clamps): slots before c·C were read already
        start = jnp.minimum(c * C, S - C)
        # (a stack held as its bits: maxlite/models/cache_bits.py; the keys were the queries' dtype)
        k_BCKH, v_BCKH = (load(jax.lax.dynamic_slice(x, (j, 0, start, 0, 0), (1, B, C, K, H))[0], q_BTNH.dtype)
                          for x in (k_LBSKH, v_LBSKH))
        slot_C = start + jnp.arange(C)
        mine_BCT = slot_C[None, :, None] == slots_BT[:, None, :]  # the slots this step wrote
        kpos_BC = jnp.where(mine_BCT.any(-1), jnp.max(jnp.where(mine_BCT, qpos_BT[:, None, :], -1), axis=-1),
                            jax.lax.dynamic_slice(kpos_BS, (0, start), (B, C)))
        kpos_B1C = kpos_BC[:, None, :]
        fresh_C = slot_C >= c * C
        visible_BTC = fresh_C & (kpos_B1C >= 0) & visible(qpos_BT1, kpos_B1C, window, chunk)
        s = jnp.einsum("btkgh,bckh->bkgtc", q_BTKGH, k_BCKH.astype(q_BTKGH.dtype)).astype(jnp.float32) * scale
        s = jnp.where(visible_BTC[:, None, None], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(visible_BTC[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgtc,bckh->bkgth", p.astype(v_BCKH.dtype), v_BCKH).astype(jnp.float32)
        return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

    init = (jnp.full((B, K, G, T), _NEG, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, (filled + C - 1) // C, body, init)
    if sinks_N is not None:  # the sink joins the denominator only (its column's probability is dropped)
        sink = sinks_N.astype(jnp.float32).reshape(1, K, G, 1)
        m_sink = jnp.maximum(m, sink)
        correction = jnp.exp(m - m_sink)
        l, acc = l * correction + jnp.exp(sink - m_sink), acc * correction[..., None]
    out_BKGTH = acc / l[..., None]
    return jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q_BTNH.dtype)
