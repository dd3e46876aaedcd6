"""cuDNN's fused attention (attention=cudnn_flash, NVIDIA GPUs), split out of attention.py.

Packed documents reach cuDNN as per-row segment offsets and lengths (its packed layout) when a row
holds at most max_segments_per_seq; otherwise jax.nn.dot_product_attention(implementation="cudnn")
takes a dense mask. Under context parallelism each shard's queries go through `shard`: a dense mask
per block of query rows (cuDNN's causal mask is aligned to the top-left corner, which a shard's
positions do not share)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxlite.models.attention_mask import scale_or_default, visible

try:  # private JAX module: jax.nn.dot_product_attention takes segments only as a dense mask
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # pragma: no cover - a JAX without it: cudnn_flash keeps the dense mask
    _cudnn = None


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


def cudnn_flash(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, max_segments: int = 0, window: int = 0,
                scale: float | None = None):
    """With `max_segments` > 0, rows of at most that many contiguous segments (as the packer
    writes them; padding is one more) go to cuDNN as offsets and lengths; a batch with a longer row
    takes the dense [B, 1, T, S] mask, which costs 1.4-1.6x in the kernel (docs/performance.md).
    A window reaches cuDNN as its sliding-window length (keys i − W < j ≤ i)."""
    scale = scale_or_default(q_BTNH.shape[-1], scale)

    def dense():
        same_doc_B1TS = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=same_doc_B1TS, scale=scale,
                                            is_causal=True, implementation="cudnn",
                                            local_window_size=(window - 1, 0) if window else None)

    if not max_segments or _cudnn is None:
        return dense()
    offsets_BM1, lengths_BM, fits = segment_offsets(segment_ids_BT, max_segments)

    def packed():
        return _cudnn.dot_product_attention(
            q_BTNH, k_BSKH, v_BSKH, q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=offsets_BM1,
            kv_offsets=offsets_BM1, scale=scale, mask_type=_cudnn.MaskType.PADDING_CAUSAL,
            qkv_layout="BTNH", sliding_window_length=window or None)

    return jax.lax.cond(fits, packed, dense)


CUDNN_SHARD_ROWS = 1024  # context shards: query rows per cuDNN call (its dense mask: rows × T bytes per row)


def shard(q_BTNH, k_BSKH, v_BSKH, qseg_BT, kseg_BS, qpos_T, window, scale,
                 implementation: str = "cudnn"):
    """A context shard's queries (at sequence positions qpos_T) against the whole sequence through
    jax.nn.dot_product_attention with a dense mask, CUDNN_SHARD_ROWS query rows at a time: cuDNN
    aligns its causal mask to the top-left corner, which a shard's queries (positions other than
    0 … T−1 against keys 0 … S−1) do not share. `implementation` "xla" runs the same blocks on CPU."""
    B, T, N, H = q_BTNH.shape
    rows = min(CUDNN_SHARD_ROWS, T)
    while T % rows:
        rows -= 1
    kpos_S = jnp.arange(k_BSKH.shape[1])

    def one(args):
        q_BRNH, qseg_BR, qpos_R = args
        mask_BRS = (visible(qpos_R[:, None], kpos_S[None, :], window)[None]
                    & (qseg_BR[:, :, None] == kseg_BS[:, None, :]))
        return jax.nn.dot_product_attention(q_BRNH, k_BSKH, v_BSKH, mask=mask_BRS[:, None], scale=scale,
                                            implementation=implementation)

    blocks = (jnp.swapaxes(q_BTNH.reshape(B, T // rows, rows, N, H), 0, 1),
              jnp.swapaxes(qseg_BT.reshape(B, T // rows, rows), 0, 1), qpos_T.reshape(T // rows, rows))
    out = jax.lax.map(one, blocks)
    return jnp.swapaxes(out, 0, 1).reshape(B, T, N, H)
