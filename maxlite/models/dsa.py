"""DeepSeek sparse attention (DeepSeek-V3.2): the `dsa` mixer kind (maxlite/models/kinds.py; its decode
cache is maxlite/models/dsa_cache.py).

Multi-head latent attention (maxlite/models/mla.py) where each query attends only the `index_topk`
earlier tokens a lightning indexer scores highest (every earlier token while there are no more). The
indexer has its own small heads: queries from MLA's query latent, q_I = RMSNorm(x·W_q_a)·W_Iq
([H_I, D_I]), one key per token, k_I = LayerNorm(x·W_Ik) ([D_I]), both with RoPE on their first R =
qk_rope_head_dim dims (split halves, unlike DeepSeek's interleaved MLA RoPE), and a weight per head
and token, w = x·W_Iw / √H_I. A token t's score for query s is Σ_h w_{s,h}·ReLU(q_{s,h}·k_t / √D_I),
in float32; the top `index_topk` of the causal (and same-document) tokens are kept. As transformers'
DeepseekV32Attention (the reference computes the same scores through a Hadamard rotation and FP8,
which leave the dot products as they are up to rounding), the indexer takes no gradient here.

Attention over the kept tokens runs as a dense masked softmax ([B, N, T, S] scores, the indexer's
choice a mask): exact, but the memory and FLOPs of dense attention. The model's FLOP count (MFU, the
planner) counts what the sparse algorithm computes, min(s, index_topk) keys per query. Not yet
modelled: the indexer's own training loss (DeepSeek's warm-up of the indexer against the dense
attention's distribution, then sparse training: until then its parameters are tagged `frozen`, kept as
initialised or imported and out of the optimizer), a gather kernel that reads only the kept latents.

Shape legend as in mla.py, plus I the indexer's heads and J their width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models import lora
from maxlite.models.layers import BTD, LayerNorm, constrain, param
from maxlite.models.matmul import project
from maxlite.models.mla import MLA


class DSA(MLA):
    """Latent attention over the tokens the indexer keeps."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        D, Q, I, J = cfg.base_emb_dim, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        self.index_q = param(rngs, (Q, I, J), ("embed", "heads", "head_dim"), wd, scale=s)
        self.index_k = param(rngs, (D, J), ("embed", None), wd, scale=s)
        self.index_norm = LayerNorm(J, 1e-6, jnp.dtype(cfg.dtype), wd, rngs=rngs)
        self.index_w = param(rngs, (D, I), ("embed", None), wd, scale=s)
        # no gradient reaches the indexer (its choice is discrete); its own loss is not modelled yet:
        # it stays as initialised or imported, out of the optimizer (maxlite.state.split_trainable)
        for variable in (self.index_q, self.index_k, self.index_norm.scale, self.index_norm.bias, self.index_w):
            variable.set_metadata(frozen=True)

    def query_latent(self, x_BTD):
        """RMSNorm(x·W_q_a) (with a LoRA adapter's part): what MLA's queries and the indexer's both
        start from (XLA computes it once)."""
        return self.q_norm(lora.adapt(self, "q_a", x_BTD, project("btd,dq->btq", x_BTD, self.q_a[...])))

    def index_queries(self, x_BTD, positions_BT):
        """(q_I [B, T, I, J] rotated, w [B, T, I] already / √I), float32."""
        q_BTIJ = project("btq,qij->btij", self.query_latent(x_BTD), self.index_q[...])
        q_BTIJ = self._rope(q_BTIJ.astype(jnp.float32), positions_BT, False)
        w_BTI = project("btd,di->bti", x_BTD, self.index_w[...]).astype(jnp.float32) * self.cfg.index_n_heads ** -0.5
        return q_BTIJ, w_BTI

    def index_keys(self, x_BTD, positions_BT):
        """k_I [B, T, J] rotated, float32: what decoding caches beside the latent."""
        k_BTJ = self.index_norm(project("btd,dj->btj", x_BTD, self.index_k[...]))
        return self._rope(k_BTJ[:, :, None].astype(jnp.float32), positions_BT, False)[:, :, 0]

    def keep(self, q_BTIJ, w_BTI, k_BSJ, visible_BTS):
        """The indexer's choice [B, T, S]: the `index_topk` visible keys of each query with the highest
        scores (every visible key while there are no more)."""
        scores_BTIS = jnp.einsum("btij,bsj->btis", q_BTIJ, k_BSJ.astype(jnp.float32)) * self.cfg.index_head_dim ** -0.5
        scores_BTS = jnp.einsum("bti,btis->bts", w_BTI, jax.nn.relu(scores_BTIS))
        scores_BTS = jax.lax.stop_gradient(jnp.where(visible_BTS, scores_BTS, -jnp.inf))
        k = min(self.cfg.index_topk, scores_BTS.shape[-1])
        _, top_BTk = jax.lax.top_k(scores_BTS, k)
        kept_BTS = jnp.zeros(scores_BTS.shape, bool).at[
            jnp.arange(scores_BTS.shape[0])[:, None, None], jnp.arange(scores_BTS.shape[1])[None, :, None],
            top_BTk].set(True)
        return kept_BTS & visible_BTS

    def attend_kept(self, q_BTNK, k_BSNK, v_BSNV, kept_BTS):
        """Softmax attention of each query over its kept keys, float32 scores: out_BTNV."""
        scores_BNTS = jnp.einsum("btnk,bsnk->bnts", q_BTNK, k_BSNK).astype(jnp.float32) * self.scale
        scores_BNTS = jnp.where(kept_BTS[:, None], scores_BNTS, jnp.finfo(jnp.float32).min)
        probs_BNTS = jax.nn.softmax(scores_BNTS, axis=-1).astype(v_BSNV.dtype)
        return jnp.einsum("bnts,bsnv->btnv", probs_BNTS, v_BSNV)

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False):
        q_nope, q_rope = self.queries(x_BTD, positions_BT, False, dropout_key)
        c_BTC, k_rope_BTR = self.latent(x_BTD, positions_BT, False, dropout_key)
        q_BTNK, k_BTNK, v_BTNV = self.expand(q_nope, q_rope, c_BTC, k_rope_BTR, dropout_key)
        T = x_BTD.shape[1]
        causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
        visible_BTS = causal[None] & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
        q_BTIJ, w_BTI = self.index_queries(x_BTD, positions_BT)
        kept_BTS = self.keep(q_BTIJ, w_BTI, self.index_keys(x_BTD, positions_BT), visible_BTS)
        out_BTNV = self.attend_kept(q_BTNK, k_BTNK, v_BTNV, kept_BTS)
        out_BTNV = constrain(out_BTNV, ("activation_batch", "activation_length", "activation_heads", None))
        return constrain(self.out(out_BTNV, dropout_key), BTD)
