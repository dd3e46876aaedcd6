"""Causal, segment-masked, grouped-query attention behind one key, `attention` (MaxText's names).

  dot_product   the reference: materialises the [B, K, G, T, S] scores (fast at short T)
  blockwise     pure XLA, online softmax over key blocks with a hand-written VJP: O(T) memory in
                the forward and backward passes; the portable fallback and the CPU choice at long T
  flash         Pallas splash attention (TPU); on CPU it runs in the Pallas interpreter (tests only)
  cudnn_flash   cuDNN's fused attention (NVIDIA GPUs): packed documents as per-row offsets and
                lengths (cuDNN's packed layout) when a row holds at most max_segments_per_seq,
                else jax.nn.dot_product_attention(implementation="cudnn") with a dense mask
  autoselected  flash on TPU, cudnn_flash on GPU, blockwise on CPU at long T, else dot_product:
                resolved once with the config (maxlite.models.names.resolve_attention), so what
                runs is what the planner and status.json name

Every implementation takes q_BTNH, k_BSKH, v_BSKH (K/V never repeated to N heads) and segment ids:
a token attends to earlier tokens of its own segment (packed documents stay apart). With a
`window` W > 0 (a sliding-window layer: Mistral, Gemma 3's local layers) it attends to the last W
tokens only, itself included (key index j with i − W < j ≤ i, Hugging Face's rule): blockwise then
visits only the key blocks the window reaches, splash skips the blocks its LocalMask empties and
cuDNN gets its sliding-window length, so the work is O(T·W), not O(T²). Scores are scaled by
`scale` (default 1/√H; Gemma 3's query_pre_attn_scalar^-½). With attention sinks (`sinks_N`, gpt-oss:
a learned logit per query head) each softmax's denominator gets exp(sink) too, a key that takes no
value: dot_product as an extra score column, blockwise in its final normalisation (and its gradient
−Σ p_sink·(dO·O)), splash as the kernel's own `sinks`; cuDNN takes none through JAX, so
resolve_attention runs blockwise instead.
With context parallelism (the sequence split over devices: maxlite/models/context.py) every
implementation runs per shard inside a shard_map: the shard's queries against the whole sequence's
keys and values, all-gathered (K heads, not N) and put back into sequence order, under the same
rule of positions: dot_product masks by each query's sequence position, blockwise runs each
contiguous query chunk against the key blocks up to its own (a loop as long as that shard needs:
with load balance every shard needs the same), splash gets a mask whose query rows are in the
shard layout's order, and cuDNN gets a dense mask per block of query rows (maxlite/models/cudnn_attention.py).
Shape legend as in layers.py. Sharding-free: the splash kernel, which GSPMD cannot partition, is
wrapped in a shard_map whose specs come from the logical-axis rules that are active.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxlite.models import context, cudnn_attention
from maxlite.models.attention_mask import scale_or_default as _scale, visible, visible_in_blocks
from maxlite.models.matmul import project
from maxlite.models.names import ATTENTION, IMAGE_BLOCK_ATTENTION, resolve_attention
from maxlite.models.platform import target_platform

_NEG = -1e30  # masked score; finite so that a fully masked key block gives exp(0)·0, not NaN


def attend(cfg, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window: int = 0, scale: float | None = None,
           sinks_N=None, blocks_BT=None, chunk: int = 0, positions_BT=None):
    """Dispatch on cfg.attention (resolved with the config; a config that never was — a model built
    by hand — is resolved here by the same rule); `window` (static) is the layer's sliding window,
    0 for a global layer; `sinks_N` the layer's attention sinks (None: none); `blocks_BT` each token's
    image block (−1: none; its tokens see each other both ways: attention_mask.visible_in_blocks),
    None where the model has none; `chunk` (static) a chunked-attention layer's chunk (0: none; its
    `window` is the chunk): each query attends within its own chunk of `positions_BT` (each document's
    own positions; None: the row's indices) only — every (document, chunk) its own segment
    (`chunk_segments`), so every implementation runs it through its segment mask, visiting only the
    key blocks its window reaches; cuDNN's packed layout counts documents, not chunks: a chunked layer
    runs blockwise there. Returns out_BTNH in q's dtype."""
    T, n = q_BTNH.shape[1], context.shards()
    if chunk:
        assert n == 1, "kind_checks.chunked_layout refuses context parallelism"
        segment_ids_BT = chunk_segments(segment_ids_BT, positions_BT, chunk)
    is_balanced = context.balanced(cfg)
    impl = resolve_attention(cfg.attention, target_platform(), T, cfg.attention_block_size, cfg.sa_block_q,
                             n * (2 if is_balanced else 1), sinks_N is not None, blocks_BT is not None, cfg.dtype)
    if chunk and impl == "cudnn_flash":
        impl = "blockwise"
    if blocks_BT is not None:  # config_checks refuses the others with a bidirectional vision encoder
        assert impl in IMAGE_BLOCK_ATTENTION and n == 1, (impl, n)
        if impl == "blockwise":
            return blockwise(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, min(cfg.attention_block_size, T),
                             window=window, scale=scale, sinks_N=sinks_N, blocks_BT=blocks_BT)
        return dot_product(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window=window, scale=scale, sinks_N=sinks_N,
                           blocks_BT=blocks_BT)
    if n > 1:
        return _across_shards(cfg, impl, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window, scale, is_balanced,
                              sinks_N)
    args = (q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
    if impl == "dot_product":
        return dot_product(*args, window=window, scale=scale, sinks_N=sinks_N)
    if impl == "blockwise":
        return blockwise(*args, min(cfg.attention_block_size, k_BSKH.shape[1]), window=window, scale=scale,
                         sinks_N=sinks_N)
    if impl == "flash":
        return flash(*args, splash_block_sizes(cfg, T), window=window, scale=scale, sinks_N=sinks_N)
    assert impl == "cudnn_flash" and impl in ATTENTION, impl
    return cudnn_attention.cudnn_flash(*args, cfg.max_segments_per_seq, window=window, scale=scale)


# ---- dot_product ----------------------------------------------------------------------------


def chunk_segments(segment_ids_BT, positions_BT, chunk: int):
    """Segment ids under which the segment mask is a chunked layer's: each (document, chunk of `chunk`
    of its positions) its own id, padding (0) kept 0. `positions_BT` None: the row's indices."""
    B, T = segment_ids_BT.shape
    pos_BT = jnp.broadcast_to(jnp.arange(T), (B, T)) if positions_BT is None else positions_BT
    per_document = T // chunk + 1  # chunk ids of one document's positions (< T) stay below it
    return jnp.where(segment_ids_BT == 0, 0, segment_ids_BT * per_document + pos_BT // chunk)


def dot_product(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window: int = 0, scale: float | None = None,
                sinks_N=None, blocks_BT=None):
    pos_T = jnp.arange(q_BTNH.shape[1])
    return _dot_product(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, segment_ids_BT, pos_T, pos_T, window, scale,
                        sinks_N, blocks_BT)


def softmax_with_sinks(logits_BKGTS, sinks_N):
    """softmax over the last axis; with sinks, each row's denominator also holds exp(sink) of its
    query head (N = K·G), a column whose probability is dropped."""
    if sinks_N is None:
        return jax.nn.softmax(logits_BKGTS, axis=-1)
    B, K, G, T, _ = logits_BKGTS.shape
    sink_BKGT1 = jnp.broadcast_to(sinks_N.astype(jnp.float32).reshape(1, K, G, 1, 1), (B, K, G, T, 1))
    return jax.nn.softmax(jnp.concatenate([logits_BKGTS, sink_BKGT1], axis=-1), axis=-1)[..., :-1]


def _dot_product(q_BTNH, k_BSKH, v_BSKH, qseg_BT, kseg_BS, qpos_T, kpos_S, window, scale, sinks_N=None,
                 blocks_BT=None):
    """Queries at sequence positions qpos_T against keys at kpos_S (a context shard's queries
    against the whole sequence); `blocks_BT` (queries and keys alike: no context shards) the image
    blocks whose tokens see each other both ways."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = project("btkgh,bskh->bkgts", q_BTKGH, k_BSKH).astype(jnp.float32)
    if blocks_BT is None:
        near_BTS = visible(qpos_T[:, None], kpos_S[None, :], window)[None]
    else:
        near_BTS = visible_in_blocks(qpos_T[None, :, None], kpos_S[None, None, :], window, blocks_BT[:, :, None],
                                     blocks_BT[:, None, :])
    mask_BTS = near_BTS & (qseg_BT[:, :, None] == kseg_BS[:, None, :])
    # the mask as an additive bias: its gradient is the identity, so the backward pass keeps no
    # [B, K, G, T, S] mask (a select would); every row keeps its own diagonal, so none is all _NEG
    bias_B11TS = jnp.where(mask_BTS, 0.0, _NEG)[:, None, None]
    scaled_BKGTS = scores_BKGTS / math.sqrt(H) if scale is None else scores_BKGTS * scale
    probs_BKGTS = softmax_with_sinks(scaled_BKGTS + bias_B11TS, sinks_N).astype(q_BTNH.dtype)
    out_BTKGH = project("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
    return out_BTKGH.reshape(B, T, N, H)


# ---- blockwise (online softmax over key blocks, flash-attention-2 backward) -------------------
#
# The queries are cut into n blocks of C, the keys into m blocks of C. Step d of a loop pairs every
# query block i (sequence block b + i: b is the first query block's, 0 unless the queries are a
# context shard's chunk) with key block b + i − d (taken from the keys; blocks before the sequence
# start are masked), so a step costs n·C² scores whatever d is, and the mask depends on (d, c, s)
# only: query index − key index = d·C + c − s. A causal layer needs d = 0 … b+n−1; a sliding-window
# layer only the offsets its window reaches, ⌈(W − 1)/C⌉ + 1 of them: O(T·W) work. A context
# shard's chunk runs as many steps as its own position needs (a loop with a traced trip count):
# with load balance every shard needs the same. With bidirectional image blocks (Gemma 3) a query
# also sees the later keys of its own image: the loop starts at d = −a, a = the key blocks the
# longest image reaches ahead, counted from the batch's blocks (a traced start). Extra legend: n query
# blocks, m key blocks, C = S block length.


def num_offsets(T: int, block: int, window: int) -> int:
    """Key-block offsets a query block needs: all n causally, fewer with a window."""
    n = T // block
    return n if not window else min(n, -(-(window - 1) // block) + 1)


def _blocks(x_BT, block: int):
    """[B, T, ...] → [B, n, C, ...]."""
    B, T = x_BT.shape[:2]
    return x_BT.reshape(B, T // block, block, *x_BT.shape[2:])


def _key_blocks(d, first, n: int, *xs_Bm):
    """The key block each query block meets at offset d (d < 0: ahead of it): (those blocks of each
    x [B, m, ...], which exist [n], their indices [n])."""
    m = xs_Bm[0].shape[1]
    idx_n = first + jnp.arange(n) - d
    take = jnp.clip(idx_n, 0, m - 1)
    return tuple(jnp.take(x, take, axis=1) for x in xs_Bm), (idx_n >= 0) & (idx_n < m), take


def _offset_scores(q_BnCKGH, k_BnSKH, seg_BnC, kseg_BnS, exists_n, d, window, scale, blk=None):
    """Scaled f32 scores of query block i against the key block d behind it, masked, and the mask
    [B, n, 1, 1, C, S]; `blk` (the query blocks' image blocks [B, n, C], the key block's [B, n, S]) adds
    the keys of a query's own image, ahead of it too."""
    C = q_BnCKGH.shape[2]
    s = jnp.einsum("bnckgh,bnskh->bnkgcs", q_BnCKGH, k_BnSKH).astype(jnp.float32) * scale
    c_C, s_S = jnp.arange(C), jnp.arange(C)
    if blk is None:
        near_BnCS = visible(d * C + c_C[:, None], s_S[None, :], window)[None, None]
    else:
        qblk_BnC, kblk_BnS = blk
        near_BnCS = visible_in_blocks(d * C + c_C[:, None], s_S[None, :], window, qblk_BnC[:, :, :, None],
                                      kblk_BnS[:, :, None, :])
    mask_BnCS = (near_BnCS & exists_n[None, :, None, None]
                 & (seg_BnC[:, :, :, None] == kseg_BnS[:, :, None, :]))
    mask = mask_BnCS[:, :, None, None]
    return jnp.where(mask, s, _NEG), mask


def _loop(body, init, start, steps, max_steps: int, dynamic: bool):
    """body(d, carry) for d = start … steps−1: a scan of max_steps (static, start 0), or a loop of the
    traced bounds (a context shard's own count; image blocks' offsets ahead)."""
    if dynamic:
        return jax.lax.fori_loop(start, steps, body, init)
    return jax.lax.scan(lambda carry, d: (body(d, carry), None), init, jnp.arange(max_steps))[0]


def blocks_ahead(blocks_BT, block: int):
    """How many key blocks ahead of its own a query's image reaches at most (0 without images): the
    longest run of one image block's tokens, L, reaches ⌈(L − 1)/C⌉ blocks on."""
    B, T = blocks_BT.shape
    is_image_BT = blocks_BT >= 0
    starts_BT = is_image_BT & (blocks_BT != jnp.pad(blocks_BT[:, :-1], ((0, 0), (1, 0)), constant_values=-1))
    idx_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    start_at_BT = jax.lax.cummax(jnp.where(starts_BT, idx_BT, -1), axis=1)
    longest = jnp.max(jnp.where(is_image_BT, idx_BT - start_at_BT + 1, 0))
    return jnp.minimum((longest - 1 + block - 1) // block, T // block - 1).astype(jnp.int32)


def _key_blocks_of(d, first, n, k_BmSKH, v_BmSKH, kseg_BmS, blk):
    """_key_blocks of k, v, their segments and, with `blk` (query blocks' [B, n, C], keys' [B, m, S]),
    their image blocks: (k, v, kseg, blk at d or None), which exist, their indices."""
    if blk is None:
        (k, v, kseg), exists, idx = _key_blocks(d, first, n, k_BmSKH, v_BmSKH, kseg_BmS)
        return k, v, kseg, None, exists, idx
    (k, v, kseg, kblk), exists, idx = _key_blocks(d, first, n, k_BmSKH, v_BmSKH, kseg_BmS, blk[1])
    return k, v, kseg, (blk[0], kblk), exists, idx


def _blockwise_fwd(q_BnCKGH, k_BmSKH, v_BmSKH, sinks_KG, qseg_BnC, kseg_BmS, blk, first, start, steps, window,
                   scale, max_steps, dynamic):
    B, n, C, K, G, H = q_BnCKGH.shape

    def body(d, carry):
        m, l, acc = carry  # [B, n, K, G, C] (acc: ..., H)
        k, v, kseg, blk_d, exists, _ = _key_blocks_of(d, first, n, k_BmSKH, v_BmSKH, kseg_BmS, blk)
        s, mask = _offset_scores(q_BnCKGH, k, qseg_BnC, kseg, exists, d, window, scale, blk_d)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l_new = l * correction + p.sum(-1)
        pv = jnp.einsum("bnkgcs,bnskh->bnkgch", p.astype(v.dtype), v)
        return m_new, l_new, acc * correction[..., None] + pv.astype(jnp.float32)

    init = (jnp.full((B, n, K, G, C), _NEG, jnp.float32), jnp.zeros((B, n, K, G, C), jnp.float32),
            jnp.zeros((B, n, K, G, C, H), jnp.float32))
    m, l, acc = _loop(body, init, start, steps, max_steps, dynamic)
    # the sink joins the denominator (no sinks: _NEG, which adds exp(_NEG − m) = 0 and changes nothing)
    sink = sinks_KG[None, None, :, :, None]
    m_sink = jnp.maximum(m, sink)
    correction = jnp.exp(m - m_sink)
    m, l, acc = m_sink, l * correction + jnp.exp(sink - m_sink), acc * correction[..., None]
    out_BnCKGH = jnp.transpose(acc / l[..., None], (0, 1, 4, 2, 3, 5)).astype(q_BnCKGH.dtype)
    return out_BnCKGH, m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13))
def _blockwise(q_BnCKGH, k_BmSKH, v_BmSKH, sinks_KG, qseg_BnC, kseg_BmS, blk, first, start, steps, window, scale,
               max_steps, dynamic):
    return _blockwise_fwd(q_BnCKGH, k_BmSKH, v_BmSKH, sinks_KG, qseg_BnC, kseg_BmS, blk, first, start, steps, window,
                          scale, max_steps, dynamic)[0]


def _blockwise_vjp_fwd(q, k, v, sinks, qseg, kseg, blk, first, start, steps, window, scale, max_steps, dynamic):
    out, lse = _blockwise_fwd(q, k, v, sinks, qseg, kseg, blk, first, start, steps, window, scale, max_steps,
                              dynamic)
    return out, (q, k, v, sinks, qseg, kseg, blk, first, start, steps, out, lse)


def _blockwise_vjp_bwd(window, scale, max_steps, dynamic, res, dout_BnCKGH):
    q_BnCKGH, k_BmSKH, v_BmSKH, sinks_KG, qseg_BnC, kseg_BmS, blk, first, start, steps, out_BnCKGH, lse_BnKGC = res
    n = q_BnCKGH.shape[1]
    dout = dout_BnCKGH.astype(jnp.float32)
    delta_BnKGC = jnp.einsum("bnckgh,bnckgh->bnkgc", dout, out_BnCKGH.astype(jnp.float32))
    q32 = q_BnCKGH.astype(jnp.float32)

    def body(d, carry):
        dq, dk, dv = carry  # dk, dv: f32 [B, m, S, K, H], in key-block order
        k, v, kseg, blk_d, exists, idx = _key_blocks_of(d, first, n, k_BmSKH, v_BmSKH, kseg_BmS, blk)
        s, mask = _offset_scores(q_BnCKGH, k, qseg_BnC, kseg, exists, d, window, scale, blk_d)
        p = jnp.where(mask, jnp.exp(s - lse_BnKGC[..., None]), 0.0)
        dp = jnp.einsum("bnckgh,bnskh->bnkgcs", dout, v.astype(jnp.float32))
        ds = p * (dp - delta_BnKGC[..., None]) * scale
        dq = dq + jnp.einsum("bnkgcs,bnskh->bnckgh", ds, k.astype(jnp.float32))
        # back to the key blocks these came from (blocks that do not exist carry zeros: masked)
        dk = dk.at[:, idx].add(jnp.einsum("bnkgcs,bnckgh->bnskh", ds, q32))
        dv = dv.at[:, idx].add(jnp.einsum("bnkgcs,bnckgh->bnskh", p, dout))
        return dq, dk, dv

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dq, dk, dv = _loop(body, (zeros(q_BnCKGH), zeros(k_BmSKH), zeros(v_BmSKH)), start, steps, max_steps, dynamic)
    ints = [np.zeros(x.shape, jax.dtypes.float0) for x in (qseg_BnC, kseg_BmS)]
    ints += [None if blk is None else tuple(np.zeros(x.shape, jax.dtypes.float0) for x in blk)]
    ints += [np.zeros(x.shape, jax.dtypes.float0) for x in (first, start, steps)]
    # d/d sink of Σ_j p_j v_j with p_j = exp(s_j − lse): −p_sink · (dO · O) per query row
    dsinks_KG = -jnp.sum(jnp.exp(sinks_KG[None, None, :, :, None] - lse_BnKGC) * delta_BnKGC, axis=(0, 1, 4))
    return (dq.astype(q_BnCKGH.dtype), dk.astype(k_BmSKH.dtype), dv.astype(v_BmSKH.dtype), dsinks_KG, *ints)


_blockwise.defvjp(_blockwise_vjp_fwd, _blockwise_vjp_bwd)


def blockwise(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, block: int, window: int = 0,
              scale: float | None = None, sinks_N=None, blocks_BT=None):
    """`blocks_BT`: each token's image block (−1: none), whose tokens see each other both ways
    (attention_mask.visible_in_blocks): the loop then also visits the key blocks ahead that the batch's
    longest image reaches (blocks_ahead), a loop with a traced start."""
    T = q_BTNH.shape[1]
    if T % block:
        raise ValueError(f"blockwise attention: block {block} must divide the sequence length {T}")
    offsets = num_offsets(T, block, window)
    if blocks_BT is None:
        return _blockwise_chunk(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, segment_ids_BT, np.int32(0), np.int32(0),
                                np.int32(offsets), block, window, scale, offsets, False, sinks_N)
    blk = (_blocks(blocks_BT, block), _blocks(blocks_BT, block))
    return _blockwise_chunk(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, segment_ids_BT, np.int32(0),
                            -blocks_ahead(blocks_BT, block), np.int32(offsets), block, window, scale, offsets, True,
                            sinks_N, blk)


def _blockwise_chunk(q_BTNH, k_BSKH, v_BSKH, qseg_BT, kseg_BS, first_block, start, steps, block, window, scale,
                     max_steps, dynamic, sinks_N=None, blk=None):
    """Queries that start at sequence block `first_block` against the whole sequence's keys, at
    offsets start … steps − 1 (`blk`: image blocks, _offset_scores)."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BnCKGH = _blocks(q_BTNH.reshape(B, T, K, N // K, H), block)
    sinks_KG = (jnp.full((K, N // K), _NEG, jnp.float32) if sinks_N is None
                else sinks_N.astype(jnp.float32).reshape(K, N // K))
    out = _blockwise(q_BnCKGH, _blocks(k_BSKH, block), _blocks(v_BSKH, block), sinks_KG, _blocks(qseg_BT, block),
                     _blocks(kseg_BS, block), blk, jnp.asarray(first_block, jnp.int32), jnp.asarray(start, jnp.int32),
                     jnp.asarray(steps, jnp.int32), window, _scale(H, scale), max_steps, dynamic)
    return out.reshape(B, T, N, H)


def _blockwise_shard(q_BTNH, k_BSKH, v_BSKH, qseg_BT, kseg_BS, chunks, block, window, scale, sinks_N=None):
    """A context shard's query chunks, each against the keys up to its own (its own step count)."""
    S = k_BSKH.shape[1]
    offsets = num_offsets(S, block, window)
    outs = []
    for c in chunks:
        first = c.first // block
        steps = jnp.minimum(first + c.length // block, offsets)
        rows = slice(c.start, c.start + c.length)
        outs.append(_blockwise_chunk(q_BTNH[:, rows], k_BSKH, v_BSKH, qseg_BT[:, rows], kseg_BS, first, 0,
                                     steps, block, window, scale, offsets, True, sinks_N))
    return jnp.concatenate(outs, axis=1)


# ---- flash: Pallas splash attention ----------------------------------------------------------

_SPLASH_KEYS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")


def splash_block_sizes(cfg, seq_len: int):
    """BlockSizes from the sa_* keys (MaxText's names), each capped at the sequence length."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    sizes = {k: min(getattr(cfg, f"sa_{k}"), seq_len) for k in _SPLASH_KEYS}
    if cfg.sa_use_fused_bwd_kernel:
        sizes.pop("block_q_dq"), sizes.pop("block_kv_dq")
    return sk.BlockSizes(**sizes, use_fused_bwd_kernel=cfg.sa_use_fused_bwd_kernel)


def _splash_kernel(T: int, N: int, window: int, block_sizes, interpret: bool, head_shards: int = 1,
                   q_shards: int = 1, balanced_over: int = 0):
    """A splash kernel over a [T, T] causal (or sliding-window) mask for N heads, its mask info
    split into head_shards × q_shards; with `balanced_over` = n the query rows are in the balanced
    layout of n context shards (maxlite/models/context.py). Built per trace (its mask arrays are
    constants of the trace that made it, so a kernel is never reused across traces); the costly part,
    processing the mask (every block pair: minutes at T = 128k), is cached by the library per mask."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (splash_attention_kernel as sk,
                                                                  splash_attention_mask as sm)

    if balanced_over:
        from maxlite.models.splash_mask import OrderedMask
        head = OrderedMask(context.balanced_order(T, balanced_over), window)
    else:  # a window: keys i − (W − 1) … i; the kernel skips the blocks this mask leaves empty
        head = sm.LocalMask((T, T), (window - 1, 0), offset=0) if window else sm.CausalMask((T, T))
    return sk.make_splash_mha(sm.MultiHeadMask([head] * N), block_sizes=block_sizes,
                              head_shards=head_shards, q_seq_shards=q_shards, interpret=interpret)


def _splash_local(q_BNTH, k_BKSH, v_BKSH, seg_BT, sinks_N=None, *, block_sizes, interpret, window):
    N, T = q_BNTH.shape[1], q_BNTH.shape[2]
    kernel = _splash_kernel(T, N, window, block_sizes, interpret)
    sk = _splash_module()
    return jax.vmap(lambda q, k, v, seg: kernel(q, k, v, seg, sinks_N))(
        q_BNTH, k_BKSH, v_BKSH, sk.SegmentIds(q=seg_BT, kv=seg_BT))


def _splash_module():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    return sk


def _mesh_spec(*logical):
    """PartitionSpec of logical axis names under the active rules (None outside a rules context)."""
    from flax import linen as nn

    return nn.logical_to_mesh_axes(logical)


def _scaled(q_BTNH, scale):
    """The kernel does not scale: the queries come scaled."""
    H = q_BTNH.shape[-1]
    if scale is None:
        return q_BTNH / jnp.asarray(math.sqrt(H), q_BTNH.dtype)
    return q_BTNH * jnp.asarray(scale, q_BTNH.dtype)


def _sinks_f32(sinks_N):
    return () if sinks_N is None else (sinks_N.astype(jnp.float32),)


def flash(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, block_sizes, window: int = 0,
          scale: float | None = None, sinks_N=None):
    interpret = target_platform() != "tpu"  # the Pallas interpreter: CPU tests
    q_BNTH = jnp.swapaxes(_scaled(q_BTNH, scale), 1, 2)
    k_BKSH, v_BKSH = jnp.swapaxes(k_BSKH, 1, 2), jnp.swapaxes(v_BSKH, 1, 2)
    local = functools.partial(_splash_local, block_sizes=block_sizes, interpret=interpret, window=window)
    mesh = jax.sharding.get_abstract_mesh()
    sinks = _sinks_f32(sinks_N)
    if mesh.empty:
        out_BNTH = local(q_BNTH, k_BKSH, v_BKSH, segment_ids_BT, *sinks)
    else:  # a Pallas call is opaque to GSPMD: run it per shard (batch and heads), as MaxText does
        q_spec = _mesh_spec("activation_batch", "activation_heads", "activation_length", None)
        kv_spec = _mesh_spec("activation_batch", "activation_kv_heads", "activation_length", None)
        seg_spec = _mesh_spec("activation_batch", "activation_length")
        sinks_spec = (_mesh_spec("activation_heads"),) * len(sinks)
        out_BNTH = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, *sinks_spec),
                                 out_specs=q_spec, check_vma=False)(
            q_BNTH, k_BKSH, v_BKSH, segment_ids_BT, *sinks)
    return jnp.swapaxes(out_BNTH, 1, 2)


def _flash_across(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, block_sizes, window, scale, is_balanced, sinks_N=None):
    """Splash over context shards: one kernel for the whole [T, T] mask, its mask info split over
    the heads' and the sequence's mesh axes (each shard gets its query rows'), as MaxText does."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    B, T, N, H = q_BTNH.shape
    n, mesh = context.shards(), jax.sharding.get_abstract_mesh()
    heads = _mesh_spec("activation_heads")[0]
    head_shards = int(np.prod([mesh.shape[a] for a in ((heads,) if isinstance(heads, str) else heads or ())]))
    kernel = _splash_kernel(T, N, window, block_sizes, target_platform() != "tpu", head_shards, n,
                            n if is_balanced else 0)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(heads, context.length_axes())))
    sk = _splash_module()

    def local(q, k, v, qseg, kseg, chunks, extra):
        kernel, sinks = extra
        q_BNTH, k_BKSH, v_BKSH = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        out_BNTH = jax.vmap(lambda *a: kernel(*a[:3], sk.SegmentIds(q=a[3], kv=a[4]), *sinks))(
            q_BNTH, k_BKSH, v_BKSH, qseg, kseg)
        return jnp.swapaxes(out_BNTH, 1, 2)

    sinks = _sinks_f32(sinks_N)
    sinks_spec = (_mesh_spec("activation_heads"),) * len(sinks)
    return context.across_shards(local, _scaled(q_BTNH, scale), k_BSKH, v_BSKH, segment_ids_BT, is_balanced,
                                 (kernel, sinks), (kernel_spec, sinks_spec))


# ---- context parallelism: every implementation per shard ------------------------------------


def _across_shards(cfg, impl, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window, scale, is_balanced, sinks_N=None):
    """`impl` with the sequence split over the context axes (maxlite/models/context.py); the sinks
    travel split like the heads."""
    T = q_BTNH.shape[1]
    chunk = T // context.shards() // (2 if is_balanced else 1)
    H = q_BTNH.shape[-1]
    if impl == "flash":
        return _flash_across(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, splash_block_sizes(cfg, chunk), window,
                             scale, is_balanced, sinks_N)
    if impl == "dot_product":
        def local(q, k, v, qseg, kseg, chunks, sinks=None):
            return _dot_product(q, k, v, qseg, kseg, context.query_positions(chunks), jnp.arange(k.shape[1]),
                                window, scale, sinks)
    elif impl == "blockwise":
        block = min(cfg.attention_block_size, chunk)

        def local(q, k, v, qseg, kseg, chunks, sinks=None):
            return _blockwise_shard(q, k, v, qseg, kseg, chunks, block, window, scale, sinks)
    else:
        assert impl == "cudnn_flash" and sinks_N is None, impl

        def local(q, k, v, qseg, kseg, chunks):
            return cudnn_attention.shard(q, k, v, qseg, kseg, context.query_positions(chunks), window,
                                         _scale(H, scale))
    if sinks_N is None:
        return context.across_shards(local, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, is_balanced)
    return context.across_shards(local, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, is_balanced,
                                 sinks_N.astype(jnp.float32), _mesh_spec("activation_heads"))
