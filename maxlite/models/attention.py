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
a token attends to earlier tokens of its own segment (packed documents stay apart).
Shape legend as in layers.py. Sharding-free: the splash kernel, which GSPMD cannot partition, is
wrapped in a shard_map whose specs come from the logical-axis rules that are active.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxlite.models.matmul import project
from maxlite.models.names import ATTENTION, resolve_attention
from maxlite.models.platform import target_platform

try:  # private JAX module: jax.nn.dot_product_attention takes segments only as a dense mask
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # pragma: no cover - a JAX without it: cudnn_flash keeps the dense mask
    _cudnn = None

_NEG = -1e30  # masked score; finite so that a fully masked key block gives exp(0)·0, not NaN


def attend(cfg, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT):
    """Dispatch on cfg.attention (resolved with the config; a config that never was — a model built
    by hand — is resolved here by the same rule); returns out_BTNH in q's dtype."""
    impl = cfg.attention
    if impl == "autoselected":
        impl = resolve_attention(impl, target_platform(), q_BTNH.shape[1], cfg.attention_block_size, cfg.sa_block_q)
    if impl == "dot_product":
        return dot_product(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
    if impl == "blockwise":
        block = min(cfg.attention_block_size, k_BSKH.shape[1])
        return blockwise(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, block)
    if impl == "flash":
        return flash(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, splash_block_sizes(cfg, q_BTNH.shape[1]))
    assert impl == "cudnn_flash" and impl in ATTENTION, impl
    return cudnn_flash(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, cfg.max_segments_per_seq)


def _mask_BTS(segment_ids_BT, q_pos_T, k_pos_S, k_segment_ids_BS=None):
    k_segment_ids_BS = segment_ids_BT if k_segment_ids_BS is None else k_segment_ids_BS
    causal_TS = q_pos_T[:, None] >= k_pos_S[None, :]
    return causal_TS[None] & (segment_ids_BT[:, :, None] == k_segment_ids_BS[:, None, :])


# ---- dot_product ----------------------------------------------------------------------------


def dot_product(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = project("btkgh,bskh->bkgts", q_BTKGH, k_BSKH).astype(jnp.float32)
    pos_T = jnp.arange(T)
    # the mask as an additive bias: its gradient is the identity, so the backward pass keeps no
    # [B, K, G, T, S] mask (a select would); every row keeps its own diagonal, so none is all _NEG
    bias_B11TS = jnp.where(_mask_BTS(segment_ids_BT, pos_T, pos_T), 0.0, _NEG)[:, None, None]
    probs_BKGTS = jax.nn.softmax(scores_BKGTS / math.sqrt(H) + bias_B11TS, axis=-1).astype(q_BTNH.dtype)
    out_BTKGH = project("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
    return out_BTKGH.reshape(B, T, N, H)


# ---- blockwise (online softmax over key blocks, flash-attention-2 backward) -------------------


def _key_blocks(x_BS, block: int):
    """[B, S, ...] → [S/block, B, block, ...] (the scan axis first)."""
    B, S = x_BS.shape[:2]
    return jnp.swapaxes(x_BS.reshape(B, S // block, block, *x_BS.shape[2:]), 0, 1)


def _block_scores(q_BTKGH, k_BCKH, seg_BT, seg_BC, j, block):
    """Scaled, masked f32 scores of all queries against key block j, and the mask."""
    T, H = q_BTKGH.shape[1], q_BTKGH.shape[-1]
    s_BKGTC = jnp.einsum("btkgh,bckh->bkgtc", q_BTKGH, k_BCKH).astype(jnp.float32) / math.sqrt(H)
    mask_B11TC = _mask_BTS(seg_BT, jnp.arange(T), j * block + jnp.arange(block), seg_BC)[:, None, None]
    return jnp.where(mask_B11TC, s_BKGTC, _NEG), mask_B11TC


def _blockwise_fwd(q_BTKGH, k_BSKH, v_BSKH, seg_BT, block):
    B, T, K, G, H = q_BTKGH.shape
    xs = (jnp.arange(k_BSKH.shape[1] // block), _key_blocks(k_BSKH, block),
          _key_blocks(v_BSKH, block), _key_blocks(seg_BT, block))

    def body(carry, x):
        m_BKGT, l_BKGT, acc_BKGTH = carry
        j, k_BCKH, v_BCKH, seg_BC = x
        s_BKGTC, mask = _block_scores(q_BTKGH, k_BCKH, seg_BT, seg_BC, j, block)
        m_new = jnp.maximum(m_BKGT, s_BKGTC.max(-1))
        p_BKGTC = jnp.where(mask, jnp.exp(s_BKGTC - m_new[..., None]), 0.0)
        correction = jnp.exp(m_BKGT - m_new)
        l_new = l_BKGT * correction + p_BKGTC.sum(-1)
        pv_BKGTH = jnp.einsum("bkgtc,bckh->bkgth", p_BKGTC.astype(v_BCKH.dtype), v_BCKH)
        acc_new = acc_BKGTH * correction[..., None] + pv_BKGTH.astype(jnp.float32)
        return (m_new, l_new, acc_new), None

    init = (jnp.full((B, K, G, T), _NEG, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, H), jnp.float32))
    (m_BKGT, l_BKGT, acc_BKGTH), _ = jax.lax.scan(body, init, xs)
    out_BKGTH = acc_BKGTH / l_BKGT[..., None]
    lse_BKGT = m_BKGT + jnp.log(l_BKGT)
    out_BTKGH = jnp.transpose(out_BKGTH, (0, 3, 1, 2, 4)).astype(q_BTKGH.dtype)
    return out_BTKGH, lse_BKGT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(q_BTKGH, k_BSKH, v_BSKH, seg_BT, block):
    return _blockwise_fwd(q_BTKGH, k_BSKH, v_BSKH, seg_BT, block)[0]


def _blockwise_vjp_fwd(q_BTKGH, k_BSKH, v_BSKH, seg_BT, block):
    out_BTKGH, lse_BKGT = _blockwise_fwd(q_BTKGH, k_BSKH, v_BSKH, seg_BT, block)
    return out_BTKGH, (q_BTKGH, k_BSKH, v_BSKH, seg_BT, out_BTKGH, lse_BKGT)


def _blockwise_vjp_bwd(block, res, dout_BTKGH):
    q_BTKGH, k_BSKH, v_BSKH, seg_BT, out_BTKGH, lse_BKGT = res
    H = q_BTKGH.shape[-1]
    scale = 1.0 / math.sqrt(H)
    dout_f32 = dout_BTKGH.astype(jnp.float32)
    delta_BKGT = jnp.einsum("btkgh,btkgh->bkgt", dout_f32, out_BTKGH.astype(jnp.float32))
    xs = (jnp.arange(k_BSKH.shape[1] // block), _key_blocks(k_BSKH, block),
          _key_blocks(v_BSKH, block), _key_blocks(seg_BT, block))

    def body(dq_BTKGH, x):
        j, k_BCKH, v_BCKH, seg_BC = x
        s_BKGTC, mask = _block_scores(q_BTKGH, k_BCKH, seg_BT, seg_BC, j, block)
        p_BKGTC = jnp.where(mask, jnp.exp(s_BKGTC - lse_BKGT[..., None]), 0.0)
        dv_BCKH = jnp.einsum("bkgtc,btkgh->bckh", p_BKGTC, dout_f32)
        dp_BKGTC = jnp.einsum("btkgh,bckh->bkgtc", dout_f32, v_BCKH.astype(jnp.float32))
        ds_BKGTC = p_BKGTC * (dp_BKGTC - delta_BKGT[..., None]) * scale
        dq_BTKGH = dq_BTKGH + jnp.einsum("bkgtc,bckh->btkgh", ds_BKGTC, k_BCKH.astype(jnp.float32))
        dk_BCKH = jnp.einsum("bkgtc,btkgh->bckh", ds_BKGTC, q_BTKGH.astype(jnp.float32))
        return dq_BTKGH, (dk_BCKH, dv_BCKH)

    dq_BTKGH, (dk_NBCKH, dv_NBCKH) = jax.lax.scan(body, jnp.zeros(q_BTKGH.shape, jnp.float32), xs)

    def unblock(x_NBCKH, like):
        return jnp.swapaxes(x_NBCKH, 0, 1).reshape(like.shape).astype(like.dtype)

    seg_zero = np.zeros(seg_BT.shape, jax.dtypes.float0)
    return (dq_BTKGH.astype(q_BTKGH.dtype), unblock(dk_NBCKH, k_BSKH), unblock(dv_NBCKH, v_BSKH),
            seg_zero)


_blockwise.defvjp(_blockwise_vjp_fwd, _blockwise_vjp_bwd)


def blockwise(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, block: int):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if T % block:
        raise ValueError(f"blockwise attention: block {block} must divide the sequence length {T}")
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    return _blockwise(q_BTKGH, k_BSKH, v_BSKH, segment_ids_BT, block).reshape(B, T, N, H)


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


def _splash_local(q_BNTH, k_BKSH, v_BKSH, seg_BT, block_sizes, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import (splash_attention_kernel as sk,
                                                                  splash_attention_mask as sm)

    N, T = q_BNTH.shape[1], q_BNTH.shape[2]
    mask = sm.MultiHeadMask([sm.CausalMask((T, T))] * N)
    kernel = sk.make_splash_mha(mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=1,
                                interpret=interpret)
    segment_ids = sk.SegmentIds(q=seg_BT, kv=seg_BT)
    return jax.vmap(kernel)(q_BNTH, k_BKSH, v_BKSH, segment_ids)


def _mesh_spec(*logical):
    """PartitionSpec of logical axis names under the active rules (None outside a rules context)."""
    from flax import linen as nn

    return nn.logical_to_mesh_axes(logical)


def flash(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, block_sizes):
    H = q_BTNH.shape[-1]
    interpret = target_platform() != "tpu"  # the Pallas interpreter: CPU tests
    q_BNTH = jnp.swapaxes(q_BTNH / jnp.asarray(math.sqrt(H), q_BTNH.dtype), 1, 2)  # the kernel does not scale
    k_BKSH, v_BKSH = jnp.swapaxes(k_BSKH, 1, 2), jnp.swapaxes(v_BSKH, 1, 2)
    local = functools.partial(_splash_local, block_sizes=block_sizes, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        out_BNTH = local(q_BNTH, k_BKSH, v_BKSH, segment_ids_BT)
    else:  # a Pallas call is opaque to GSPMD: run it per shard (batch and heads), as MaxText does
        q_spec = _mesh_spec("activation_batch", "activation_heads", "activation_length", None)
        kv_spec = _mesh_spec("activation_batch", "activation_kv_heads", "activation_length", None)
        seg_spec = _mesh_spec("activation_batch", "activation_length")
        out_BNTH = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                                 out_specs=q_spec, check_vma=False)(
            q_BNTH, k_BKSH, v_BKSH, segment_ids_BT)
    return jnp.swapaxes(out_BNTH, 1, 2)


# ---- cudnn_flash ----------------------------------------------------------------------------


def segment_offsets(segment_ids_BT, max_segments: int):
    """cuDNN's packed layout of rows of contiguous segments: each segment's first position
    offsets_BM1 [B, M+1] and length lengths_BM [B, M] (-1 past a row's last segment; M =
    max_segments), and whether every row has at most M segments."""
    B, T = segment_ids_BT.shape
    starts_BT = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]],
                                axis=1)
    fits = jnp.all(starts_BT.sum(axis=1) <= max_segments)
    offsets_BM1 = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments + 1, fill_value=-1)[0])(starts_BT)
    offsets_BM1 = offsets_BM1.astype(jnp.int32)
    ends_BM = jnp.where(offsets_BM1[:, 1:] >= 0, offsets_BM1[:, 1:], T)
    lengths_BM = jnp.where(offsets_BM1[:, :-1] >= 0, ends_BM - offsets_BM1[:, :-1], -1)
    return offsets_BM1, lengths_BM, fits


def cudnn_flash(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, max_segments: int = 0):
    """With `max_segments` > 0, rows of at most that many contiguous segments (as the packer
    writes them; padding is one more) go to cuDNN as offsets and lengths; a batch with a longer row
    takes the dense [B, 1, T, S] mask, which costs 1.4-1.6x in the kernel (docs/performance.md)."""
    def dense():
        same_doc_B1TS = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=same_doc_B1TS,
                                            is_causal=True, implementation="cudnn")

    if not max_segments or _cudnn is None:
        return dense()
    offsets_BM1, lengths_BM, fits = segment_offsets(segment_ids_BT, max_segments)

    def packed():
        return _cudnn.dot_product_attention(
            q_BTNH, k_BSKH, v_BSKH, q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=offsets_BM1,
            kv_offsets=offsets_BM1, scale=1.0 / math.sqrt(q_BTNH.shape[-1]),
            mask_type=_cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")

    return jax.lax.cond(fits, packed, dense)
