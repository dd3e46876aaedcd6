"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the `mla` mixer kind (maxlite/models/kinds.py;
its decode cache is maxlite/models/mla_cache.py).

Keys and values come from one compressed latent per token: c = RMSNorm(x·W_kv_a[:, :C]) (C =
kv_lora_rank) up-projected per head, k_nope, v = c·W_kv_b, beside one RoPE key shared by every head,
k_rope = RoPE(x·W_kv_a[:, C:]) (R = qk_rope_head_dim). Queries go through an optional low-rank latent
(q_lora_rank > 0: q = RMSNorm(x·W_q_a)·W_q_b, else q = x·W_q) and split into q_nope (P =
qk_nope_head_dim) and q_rope (R). A head's score is q_nope·k_nope + q_rope·k_rope, scaled by
1/√(P + R) (× mscale² under YaRN); values are V = v_head_dim wide.

Training runs every attention implementation (maxlite/models/attention.py) on the expanded heads,
queries and keys P + R wide: where the values are narrower (DeepSeek: 128 against 192) they are
padded with zeros to that width and the padding cut from the output (wider values pad the queries
and keys instead; zeros change no score), so dot-product, blockwise, splash and cuDNN take MLA as
they are. Decoding caches the latent c and k_rope only (C + R numbers per token and layer) and never
expands it (mla_cache.py).

Shape legend as in layers.py, plus Q the query latent, C the key/value latent, P the no-RoPE part of
a query/key head, R its RoPE part (K = P + R the query/key head width), V the value head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxlite.models import attention, lora
from maxlite.models.families import family
from maxlite.models.layers import (BTD, apply_rope, constrain, make_norm, param, pick, rope_attention_factor,
                                   rope_frequencies, yarn_mscale)
from maxlite.models.matmul import project


def softmax_scale(cfg) -> float:
    """1/√(P + R), the query/key head width, × m(mscale_all_dim)² under YaRN (DeepSeek's softmax
    scale, as transformers' DeepseekV3Attention: with mscale = mscale_all_dim the RoPE's own factor
    is 1 and this carries the whole correction)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling_type == "yarn" and cfg.rope_scaling_factor > 0 and cfg.mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.mscale_all_dim) ** 2
    return scale


class MLA(nnx.Module):
    """Causal multi-head latent attention within each token's segment (and a sliding window in a
    `local` layer, where the recipe gives one)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, N = cfg.base_emb_dim, cfg.base_num_query_heads
        Q, C, P, R, V = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        # the latent dims of the up-projections (q_b, kv_b) are split like `embed` (over fsdp): left whole,
        # DeepSeek-V3's 3.3 B of them were whole on every device (53 GB with gradients and Adam)
        if Q:
            self.q_a = param(rngs, (D, Q), ("embed", None), wd, scale=s)
            self.q_norm = make_norm(cfg, Q, rngs)
            self.q_b = param(rngs, (Q, N, P + R), ("embed", "heads", "head_dim"), wd, scale=s)
        else:
            self.q = param(rngs, (D, N, P + R), ("embed", "heads", "head_dim"), wd, scale=s)
        self.kv_a = param(rngs, (D, C + R), ("embed", None), wd, scale=s)
        self.kv_norm = make_norm(cfg, C, rngs)
        self.kv_b = param(rngs, (C, N, P + V), ("embed", "heads", "head_dim"), wd, scale=s)
        self.o = param(rngs, (N, V, D), ("heads", "head_dim", "embed"), wd, scale=s)
        self.cfg, self.dtype, self.scale = cfg, jnp.dtype(cfg.dtype), softmax_scale(cfg)
        queries = ({"q_a_proj": (1, {"q_a": ((D, Q), ("embed", None))}),
                    "q_b_proj": (1, {"q_b": ((Q, N, P + R), ("embed", "heads", "head_dim"))})} if Q else
                   {"q_proj": (1, {"q": ((D, N, P + R), ("embed", "heads", "head_dim"))})})
        lora.attach(self, cfg, rngs, {  # LoRA on the HF projections (DeepSeek's names), after the base weights
            **queries, "kv_a_proj_with_mqa": (1, {"kv_a": ((D, C + R), ("embed", None))}),
            "kv_b_proj": (1, {"kv_b": ((C, N, P + V), ("embed", "heads", "head_dim"))}),
            "o_proj": (2, {"o": ((N, V, D), ("heads", "head_dim", "embed"))})})

    def _rope(self, x_BTNR, positions_BT, local):
        """RoPE over the R dims (YaRN's attention factor with it, 1 for DeepSeek's mscale = mscale_all_dim);
        a family without positions (Kimi Linear's NoPE) leaves them as they are."""
        cfg, R = self.cfg, self.cfg.qk_rope_head_dim
        if not family(cfg).rope:
            return x_BTNR
        inv_freq = pick(local, jnp.asarray(rope_frequencies(cfg, local=True, dims=R), jnp.float32),
                        jnp.asarray(rope_frequencies(cfg, dims=R), jnp.float32))
        factors = rope_attention_factor(cfg, local=True), rope_attention_factor(cfg)
        return apply_rope(x_BTNR, positions_BT, inv_freq, factors[0] if factors[0] == factors[1] else pick(local, *factors))

    def queries(self, x_BTD, positions_BT, local=False, dropout_key=None):
        """(q_nope_BTNP, q_rope_BTNR), the latter rotated."""
        if self.cfg.q_lora_rank:
            q_BTQ = self.q_norm(lora.adapt(self, "q_a", x_BTD, project("btd,dq->btq", x_BTD, self.q_a[...]),
                                           dropout_key=dropout_key))
            q_BTNK = lora.adapt(self, "q_b", q_BTQ, project("btq,qnk->btnk", q_BTQ, self.q_b[...]),
                                dropout_key=dropout_key)
        else:
            q_BTNK = lora.adapt(self, "q", x_BTD, project("btd,dnk->btnk", x_BTD, self.q[...]), dropout_key=dropout_key)
        P = self.cfg.qk_nope_head_dim
        return q_BTNK[..., :P], self._rope(q_BTNK[..., P:], positions_BT, local)

    def latent(self, x_BTD, positions_BT, local=False, dropout_key=None):
        """(c_BTC, the normed key/value latent; k_rope_BTR, the rotated shared RoPE key): what
        decoding caches."""
        C = self.cfg.kv_lora_rank
        kv_BTc = lora.adapt(self, "kv_a", x_BTD, project("btd,dc->btc", x_BTD, self.kv_a[...]), dropout_key=dropout_key)
        k_rope_BT1R = self._rope(kv_BTc[..., None, C:], positions_BT, local)
        return self.kv_norm(kv_BTc[..., :C]), k_rope_BT1R[:, :, 0]

    def out(self, out_BTNV, dropout_key=None):
        return lora.adapt(self, "o", out_BTNV, project("btnv,nvd->btd", out_BTNV, self.o[...]), n_in=2,
                          dropout_key=dropout_key)

    def expand(self, q_nope_BTNP, q_rope_BTNR, c_BSC, k_rope_BSR, dropout_key=None):
        """Full heads q_BTNK, k_BSNK, v_BSNV from the latent (training and the prefill)."""
        P = self.cfg.qk_nope_head_dim
        kv_BSNc = lora.adapt(self, "kv_b", c_BSC, project("bsc,cnk->bsnk", c_BSC, self.kv_b[...]),
                             dropout_key=dropout_key)
        N = kv_BSNc.shape[2]
        k_rope_BSNR = jnp.broadcast_to(k_rope_BSR[:, :, None], (*k_rope_BSR.shape[:2], N, k_rope_BSR.shape[-1]))
        q_BTNK = jnp.concatenate([q_nope_BTNP, q_rope_BTNR.astype(q_nope_BTNP.dtype)], axis=-1)
        k_BSNK = jnp.concatenate([kv_BSNc[..., :P], k_rope_BSNR.astype(kv_BSNc.dtype)], axis=-1)
        return q_BTNK, k_BSNK, kv_BSNc[..., P:]

    def attend(self, cfg, q_BTNK, k_BSNK, v_BSNV, segment_ids_BT, window: int):
        """Any attention implementation over heads of unequal widths: the narrower side padded with
        zeros to the wider (no score changes), the values' padding cut from the output."""
        K, V = q_BTNK.shape[-1], v_BSNV.shape[-1]
        width = max(K, V)
        pad = lambda x: x if x.shape[-1] == width else jnp.pad(  # noqa: E731
            x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),))
        out = attention.attend(cfg, pad(q_BTNK), pad(k_BSNK), pad(v_BSNV), segment_ids_BT, window=window,
                               scale=self.scale)
        return out[..., :V]

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False):
        q_nope, q_rope = self.queries(x_BTD, positions_BT, local, dropout_key)
        c_BTC, k_rope_BTR = self.latent(x_BTD, positions_BT, local, dropout_key)
        q_BTNK, k_BTNK, v_BTNV = self.expand(q_nope, q_rope, c_BTC, k_rope_BTR, dropout_key)
        heads = ("activation_batch", "activation_length", "activation_heads", None)
        q_BTNK = checkpoint_name(constrain(q_BTNK, heads), "query_proj")  # names the remat policies use
        k_BTNK = checkpoint_name(constrain(k_BTNK, heads), "key_proj")
        v_BTNV = checkpoint_name(constrain(v_BTNV, heads), "value_proj")
        W = self.cfg.sliding_window

        def run(window):
            return self.attend(self.cfg, q_BTNK, k_BTNK, v_BTNV, segment_ids_BT, window)
        if isinstance(local, bool) or not W:
            out_BTNV = run(W if local else 0)
        else:
            out_BTNV = jax.lax.cond(local, lambda: run(W), lambda: run(0))
        out_BTNV = constrain(out_BTNV, heads)
        return constrain(checkpoint_name(self.out(out_BTNV, dropout_key), "out_proj"), BTD)
