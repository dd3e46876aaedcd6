"""The paged (block) decode cache of grouped-query attention and of MLA's compressed latent, as
vLLM's PagedAttention lays it out: per (mixer, variant) stack a pool of blocks [L, NB, C, ...] (block
0 is never handed out: the null block), and per sequence a block table [B, M] naming the block that
holds positions [m·C, (m+1)·C). Position p lives at (table[b, p // C], p % C) in every layer of every
paged stack, so one table serves them all. The host allocates and frees the blocks
(maxlite/rollout/pages.py); here the decode step writes each new token's keys into its block and
reads a row's keys through its table. A sliding-window layer keeps every position too (no ring): the
window is a mask, its old blocks are freed with the sequence, not as they slide out of the window.

Only the decode step is paged: a prompt is prefilled into the contiguous cache (gqa_cache/mla_cache,
the training attention) and its positions copied into blocks (`write_prompt`). The read gathers the
attention's read gathers READ positions of a row's table at a time into an online softmax, up to
the longest row's length only (as maxlite/models/cache_read.py reads the contiguous cache); MLA's
gathers the row's whole table ([B, M·C] latents) and attends with mla_cache's `_attend_latent`, the
positions past a row's length masked; DeepSeek sparse attention's pools hold the indexer's key beside
the latent, and its read gathers the row's table as MLA's and lets the indexer choose among those
positions (dsa.DSA.sparse: each query reads its index_topk chosen latents only). Shape legend as in gqa_cache.py / mla.py,
plus NB blocks, C positions per block, M table columns.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlite.models import dsa_cache, gqa_cache, mla_cache
from maxlite.models.attention_mask import visible
from maxlite.models.cache_bits import load, store, stored
from maxlite.models.layout import window
from maxlite.models.paged_kinds import PAGED, PER_SLOT, refusal  # noqa: F401 (the engine's)



class Table(NamedTuple):
    """The shared part of a paged stack: each row's block table [B, M] (0: the null block)."""
    table_BM: jax.Array


def empty(cfg, kind: str, variant: str, layers: int, num_blocks: int, block_size: int):
    """An empty pool of `num_blocks` blocks for the layers of one (kind, variant) stack, held as
    maxlite/models/cache_bits.py says (written in place like the contiguous cache)."""
    dt, shape = stored(cfg.dtype), (layers, num_blocks, block_size)
    if kind == "attention":
        K, H = cfg.base_num_kv_heads, cfg.head_dim  # as gqa_cache.empty
        return gqa_cache.KV(jnp.zeros((*shape, K, H), dt), jnp.zeros((*shape, K, H), dt))
    latent = jnp.zeros((*shape, cfg.kv_lora_rank), dt), jnp.zeros((*shape, cfg.qk_rope_head_dim), dt)
    if kind == "dsa":
        return dsa_cache.Indexed(*latent, jnp.zeros((*shape, cfg.index_head_dim), dt))
    return mla_cache.Latent(*latent)


def _targets(table_BM, positions_BT, lengths_B, num_blocks: int, C: int):
    """(block, offset) of each new token [B, T]; block `num_blocks` (dropped) for padding."""
    M = table_BM.shape[1]
    block_BT = jnp.take_along_axis(table_BM, jnp.minimum(positions_BT // C, M - 1), axis=1)
    valid_BT = positions_BT < lengths_B[:, None]
    return jnp.where(valid_BT, block_BT, num_blocks), positions_BT % C


def _write(pool, j, new, block_BT, offset_BT, dtype):
    """The new values into their blocks of layer j (the pool keeps `dtype` values)."""
    return type(pool)(*(a.at[j, block_BT, offset_BT].set(store(n, a.dtype, dtype), mode="drop")
                        for a, n in zip(pool, new)))


def _read(a_LNC_, j, table_BM, dtype):
    """Layer j's positions of each row through its table, as `dtype` (the values'): [B, M·C, ...]."""
    x = load(a_LNC_[j, table_BM], dtype)  # [B, M, C, ...]
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _kpos(table_BM, lengths_B, C: int):
    """Each read position's position, −1 past the row's length (not written: masked)."""
    p_S = jnp.arange(table_BM.shape[1] * C)
    return jnp.where(p_S[None] < lengths_B[:, None], p_S[None], -1)


READ = 256  # positions per read block: the table columns gathered and folded into the softmax at once
_NEG = float(jnp.finfo(jnp.float32).min)


def _attend_blocks(q_BTNH, k_LNCKH, v_LNCKH, j, table_BM, qpos_BT, lengths_B, window: int, scale: float,
                   sinks_N=None):
    """Queries at qpos_BT over layer j's positions [0, len_b) through the table, READ positions (R
    table columns) at a time in an online softmax (cache_read.attend's, over gathered blocks): the
    columns past the longest row's length are never read. A row of length 0 (an idle slot) reads
    nothing: zeros."""
    _, _, C, K, H = k_LNCKH.shape
    B, T, N, _ = q_BTNH.shape
    M, G = table_BM.shape[1], N // K
    R = max(1, min(READ // C, M))
    q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
    qpos_BT1 = qpos_BT[:, :, None]

    def body(i, carry):
        m, l, acc = carry  # [B, K, G, T] (acc: ..., H), float32
        start = jnp.minimum(i * R, M - R)  # the last read shifted back to fit: its first columns were read
        t_BR = jax.lax.dynamic_slice(table_BM, (0, start), (B, R))
        k_BSKH, v_BSKH = (load(x[j, t_BR], q_BTNH.dtype).reshape(B, R * C, K, H) for x in (k_LNCKH, v_LNCKH))
        kpos_1S = (start * C + jnp.arange(R * C))[None]
        visible_BTS = ((kpos_1S >= i * R * C) & (kpos_1S < lengths_B[:, None]))[:, None] & visible(
            qpos_BT1, kpos_1S[:, None], window)
        s = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH.astype(q_BTKGH.dtype)).astype(jnp.float32) * scale
        s = jnp.where(visible_BTS[:, None, None], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(visible_BTS[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v_BSKH.dtype), v_BSKH).astype(jnp.float32)
        return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

    init = (jnp.full((B, K, G, T), _NEG, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, (jnp.max(lengths_B) + R * C - 1) // (R * C), body, init)
    if sinks_N is not None:  # the sink joins the denominator only
        sink = sinks_N.astype(jnp.float32).reshape(1, K, G, 1)
        m_sink = jnp.maximum(m, sink)
        correction = jnp.exp(m - m_sink)
        l, acc = l * correction + jnp.exp(sink - m_sink), acc * correction[..., None]
    out_BKGTH = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q_BTNH.dtype)


def step_attention(attn, x_BTD, positions_BT, lengths_B, pool: gqa_cache.KV, j, shared: Table, variant: str,
                   prefill_cfg=None, rope_BT=None, blocks_BT=None):
    """gqa_cache.step_in_stack over a paged pool: the new keys written into their blocks, then the
    queries over the row's table. Decode steps only (the prefill is contiguous)."""
    assert prefill_cfg is None, "the prefill runs on the contiguous cache (paged_cache.write_prompt)"
    w = window(attn.cfg, variant)
    q_BTNH, k_new, v_new = attn.qkv(x_BTD, positions_BT if rope_BT is None else rope_BT, local=bool(w))
    NB, C = pool.k_LBSKH.shape[1:3]
    pool = _write(pool, j, (k_new, v_new), *_targets(shared.table_BM, positions_BT, lengths_B, NB, C), attn.cfg.dtype)
    scale = attn.query_scale or 1.0 / math.sqrt(q_BTNH.shape[-1])
    out_BTNH = _attend_blocks(q_BTNH, pool.k_LBSKH, pool.v_LBSKH, j, shared.table_BM, positions_BT, lengths_B, w,
                              scale, attn.sinks_N())
    return attn.out(attn.gated(out_BTNH, x_BTD)), pool


def step_mla(mla, x_BTD, positions_BT, lengths_B, pool: mla_cache.Latent, j, shared: Table, variant: str,
             prefill_cfg=None):
    """mla_cache.step's decode over a paged pool of latents (the up-projections absorbed as there)."""
    assert prefill_cfg is None, "the prefill runs on the contiguous cache (paged_cache.write_prompt)"
    w = window(mla.cfg, variant)
    q_nope, q_rope = mla.queries(x_BTD, positions_BT, local=bool(w))
    c_new, k_rope_new = mla.latent(x_BTD, positions_BT, local=bool(w))
    NB, C = pool.c_LBSC.shape[1:3]
    dtype = jnp.dtype(mla.cfg.dtype)
    pool = _write(pool, j, (c_new, k_rope_new), *_targets(shared.table_BM, positions_BT, lengths_B, NB, C), dtype)
    out_BTNV = mla_cache._attend_latent(mla, q_nope, q_rope, _read(pool.c_LBSC, j, shared.table_BM, dtype),
                                        _read(pool.k_rope_LBSR, j, shared.table_BM, dtype),
                                        _kpos(shared.table_BM, lengths_B, C), positions_BT, w)
    return mla.out(out_BTNV.astype(x_BTD.dtype)), pool


def step_dsa(dsa, x_BTD, positions_BT, lengths_B, pool: dsa_cache.Indexed, j, shared: Table, variant: str,
             prefill_cfg=None):
    """dsa_cache.step's decode over a paged pool: the new latents and indexer keys written into their
    blocks, then each query's index_topk chosen positions of its row's table attended."""
    from maxlite.models.dsa import Keys

    assert prefill_cfg is None, "the prefill runs on the contiguous cache (paged_cache.write_prompt)"
    new = (*dsa.latent(x_BTD, positions_BT), dsa.index_keys(x_BTD, positions_BT))
    NB, C = pool.c_LBSC.shape[1:3]
    dtype = jnp.dtype(dsa.cfg.dtype)
    pool = _write(pool, j, new, *_targets(shared.table_BM, positions_BT, lengths_B, NB, C), dtype)
    kpos_BS = _kpos(shared.table_BM, lengths_B, C)
    keys = Keys(*(_read(a, j, shared.table_BM, dtype) for a in pool), kpos_BS, jnp.ones(kpos_BS.shape, jnp.int32))
    out_BTNV = dsa.sparse(x_BTD, positions_BT, jnp.ones(positions_BT.shape, jnp.int32), keys)
    return dsa.out(out_BTNV.astype(x_BTD.dtype)), pool


class _Module:
    """What decode.forward asks of a cache module, for a paged stack of one kind."""

    def __init__(self, step):
        self.step_in_stack = step

    @staticmethod
    def advance(shared, positions_BT, lengths_B):
        return shared  # the host owns the table


MODULES = {"attention": _Module(step_attention), "mla": _Module(step_mla), "dsa": _Module(step_dsa)}


def write_prompt(pool, prefilled, rows_K, cols_K, blocks_K):
    """`pool` with block blocks_K[i] set to positions [c·C, (c+1)·C) (c = cols_K[i]) of row rows_K[i]
    of a contiguous prefill cache [L, Bp, S, ...] (a ring of S slots: position p in slot p mod S;
    the positions it no longer holds lie outside the window: never visible). Block NB: dropped."""
    C = pool[0].shape[2]
    slots_KC = (cols_K[:, None] * C + jnp.arange(C)[None]) % prefilled[0].shape[2]
    return type(pool)(*(a.at[:, blocks_K].set(store(src[:, rows_K[:, None], slots_KC], a.dtype, src.dtype),
                                              mode="drop") for a, src in zip(pool, prefilled)))
