"""Multi-head latent attention's decode cache (the `mla` mixer kind's; maxlite/models/decode.py
drives it for every layer of the kind).

The cache holds what MLA compresses each token to, not its keys and values: the normed latent c
(kv_lora_rank = C numbers) and the rotated RoPE key all heads share (qk_rope_head_dim = R), so
C + R numbers per token and layer (DeepSeek-V3: 576, where its 128 full heads would take 40,960).
A decode step never expands the latent into heads: the key up-projection is absorbed into the
query (q_nope·(c·W_k) = (q_nope·W_kᵀ)·c, the score against the latent directly) and the value
up-projection into the output (the probabilities weight the latents, then W_v makes the heads), as
DeepSeek's inference does. The prefill runs the training attention on the expanded heads
(mla.MLA.expand: blockwise, splash, cuDNN), then writes the prompt's latents. Slots, the ring of a
sliding window and the shared record of slot positions are grouped-query attention's
(maxlite/models/gqa_cache.py), the visibility rule too.

Shape legend as in mla.py, plus S cache slots and L the layers of one variant.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlite.models import lora
from maxlite.models.cache_bits import stored
from maxlite.models.gqa_cache import _slots, _write, advance, slots  # noqa: F401 (advance: this kind's)
from maxlite.models.layers import constrain
from maxlite.models.layout import window

CACHE_AXES = ("layers", "activation_batch", "activation_length", None)  # the latent is not split over heads
BATCH_AXES = (1, 0)  # of (the latents [L, B, S, ·], the shared slot record [B, S]), as gqa_cache.BATCH_AXES


class Latent(NamedTuple):
    """The latent and the shared RoPE key of the layers of one variant: [L, B, S, C], [L, B, S, R]."""
    c_LBSC: jax.Array
    k_rope_LBSR: jax.Array


def empty(cfg, variant: str, layers: int, batch: int, length: int) -> tuple[Latent, jax.Array]:
    """(the latents of `layers` layers, the slots' positions [B, S] they share), empty."""
    S = slots(window(cfg, variant), length)
    zeros = lambda width: constrain(jnp.zeros((layers, batch, S, width), stored(cfg.dtype)),  # noqa: E731
                                    CACHE_AXES)
    return Latent(zeros(cfg.kv_lora_rank), zeros(cfg.qk_rope_head_dim)), jnp.full((batch, S), -1, jnp.int32)


def _attend_latent(mla, q_nope_BTNP, q_rope_BTNR, c_BSC, k_rope_BSR, kpos_BS, qpos_BT, w: int):
    """Attention against the latent with the up-projections absorbed: out_BTNV."""
    P = mla.cfg.qk_nope_head_dim
    kv_b_CNc = lora.weight(mla, "kv_b").astype(q_nope_BTNP.dtype)  # a LoRA adapter folded in: absorbed too
    q_lat_BTNC = jnp.einsum("btnp,cnp->btnc", q_nope_BTNP, kv_b_CNc[..., :P])
    scores_BNTS = (jnp.einsum("btnc,bsc->bnts", q_lat_BTNC, c_BSC.astype(q_lat_BTNC.dtype))
                   + jnp.einsum("btnr,bsr->bnts", q_rope_BTNR, k_rope_BSR.astype(q_rope_BTNR.dtype)))
    scores_BNTS = scores_BNTS.astype(jnp.float32) * mla.scale
    kpos, qpos = kpos_BS[:, None, :], qpos_BT[:, :, None]
    visible_BTS = (kpos >= 0) & (kpos <= qpos)
    if w:
        visible_BTS &= qpos - kpos < w
    scores_BNTS = jnp.where(visible_BTS[:, None], scores_BNTS, jnp.finfo(jnp.float32).min)
    probs_BNTS = jax.nn.softmax(scores_BNTS, axis=-1).astype(c_BSC.dtype)
    out_lat_BTNC = jnp.einsum("bnts,bsc->btnc", probs_BNTS, c_BSC)
    return jnp.einsum("btnc,cnv->btnv", out_lat_BTNC, kv_b_CNc[..., P:].astype(out_lat_BTNC.dtype))


def step(mla, x_BTD, positions_BT, lengths_B, cache: Latent, pos_BS, variant: str, prefill_cfg=None):
    """One layer's latent attention over T new tokens (`cache` this layer's [B, S, ·]): to (cache,
    new tokens) — in the prefill, to the new tokens alone through the training attention —, then
    the new latents written. Returns (the attention's output x_BTD, the new cache)."""
    w = window(mla.cfg, variant)
    q_nope, q_rope = mla.queries(x_BTD, positions_BT, local=bool(w))
    c_new, k_rope_new = mla.latent(x_BTD, positions_BT, local=bool(w))
    if prefill_cfg is not None:
        # right-padded rows: padding sits after every real token, so no real query sees it
        q_BTNK, k_BTNK, v_BTNV = mla.expand(q_nope, q_rope, c_new, k_rope_new)
        out_BTNV = mla.attend(prefill_cfg, q_BTNK, k_BTNK, v_BTNV, jnp.ones(positions_BT.shape, jnp.int32), w)
    else:
        c_BSC, k_rope_BSR = (jnp.concatenate([old, new.astype(old.dtype)], axis=1)
                             for old, new in ((cache.c_LBSC, c_new), (cache.k_rope_LBSR, k_rope_new)))
        kpos_BS = jnp.concatenate([pos_BS, positions_BT], axis=1)
        out_BTNV = _attend_latent(mla, q_nope, q_rope, c_BSC, k_rope_BSR, kpos_BS, positions_BT, w)
    slots_BT = _slots(positions_BT, lengths_B, pos_BS.shape[1])
    new = Latent(*(constrain(_write(old, n, slots_BT), CACHE_AXES[1:]) for old, n in
                   ((cache.c_LBSC, c_new), (cache.k_rope_LBSR, k_rope_new))))
    return mla.out(out_BTNV.astype(x_BTD.dtype)), new
