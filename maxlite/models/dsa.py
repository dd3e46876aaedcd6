"""DeepSeek sparse attention (DeepSeek-V3.2): the `dsa` mixer kind (maxlite/models/kinds.py; its decode
cache is maxlite/models/dsa_cache.py).

Multi-head latent attention (maxlite/models/mla.py) where each query attends only the `index_topk`
earlier tokens a lightning indexer scores highest (every earlier token while there are no more). The
indexer has its own small heads: queries from MLA's query latent, q_I = RMSNorm(x·W_q_a)·W_Iq
([H_I, D_I]), one key per token, k_I = LayerNorm(x·W_Ik) ([D_I]), both with RoPE on their first R =
qk_rope_head_dim dims (split halves, unlike DeepSeek's interleaved MLA RoPE), and a weight per head
and token, w = x·W_Iw / √H_I. A token t's score for query s is Σ_h w_{s,h}·ReLU(q_{s,h}·k_t / √D_I),
in float32; the top `index_topk` of the causal (and same-document) tokens are kept, as transformers'
DeepseekV32Attention computes them (the reference computes the same scores through a Hadamard
rotation and FP8, which leave the dot products as they are up to rounding).

Attention reads the kept tokens only: each query's index_topk latents and RoPE keys are gathered and
attended with the key and value up-projections absorbed into the query and the output (no head is
expanded: multi-query attention over C + R wide keys, as DeepSeek's sparse kernels run it), in
training, the prefill and every decode step alike. The indexer's scores are still [B, T, S] (J
numbers per key, float32), and the gather is XLA's (no fused kernel yet).

Training trains the indexer as DeepSeek-V3.2's sparse stage does: the indexer's loss is the KL
divergence from the heads' attention over each query's chosen keys (summed over heads, normalised,
detached) to the softmax of the indexer's scores for them, its inputs detached so that it trains the
indexer alone; the language model's loss trains the rest (`with_indexer_loss`). Its dense warm-up
stage (`index_stage=dense_warmup`, which comes first in DeepSeek's recipe) attends every earlier token
instead, trains the indexer towards the heads' attention over all of them, and freezes every other
parameter (`freeze_all_but_the_indexers`). That dense attention holds [B, block, N, S] float32
probabilities per query block: a few thousand tokens on a CPU or one accelerator, not the 128k
warm-up of the paper, which needs a fused kernel.

Shape legend as in mla.py, plus I the indexer's heads and J their width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models import lora
from maxlite.models.layers import BTD, LayerNorm, constrain, param
from maxlite.models.matmul import project
from maxlite.models.mla import MLA


# queries scored at once: a longer sequence runs in blocks of this many (the largest divisor of its
# length up to it), each block's work recomputed in the backward pass, so that the indexer's scores
# ([B, block, S] float32, heads added one at a time) and the gathered latents ([B, block, k, C + R])
# are never held for the whole sequence: at 128k tokens, not [B, T, S]
QUERY_BLOCK = 512


class Keys(NamedTuple):
    """What the new tokens attend: each key's latent [B, S, C], RoPE key [B, S, R], indexer key
    [B, S, J], position [B, S] (−1: an empty cache slot) and segment [B, S]."""
    c_BSC: jax.Array
    k_rope_BSR: jax.Array
    k_index_BSJ: jax.Array
    pos_BS: jax.Array
    seg_BS: jax.Array


def visible(qpos_BT, qseg_BT, kpos_BS, kseg_BS):
    """[B, T, S]: a filled key at or before the query's position, in its segment (document)."""
    kpos, kseg = kpos_BS[:, None, :], kseg_BS[:, None, :]
    return (kpos >= 0) & (kpos <= qpos_BT[:, :, None]) & (kseg == qseg_BT[:, :, None])


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

    def query_latent(self, x_BTD):
        """RMSNorm(x·W_q_a) (with a LoRA adapter's part): what MLA's queries and the indexer's both
        start from (XLA computes it once)."""
        return self.q_norm(lora.adapt(self, "q_a", x_BTD, project("btd,dq->btq", x_BTD, self.q_a[...])))

    def index_queries(self, x_BTD, positions_BT):
        """(q_I [B, T, I, J] rotated, w [B, T, I] already / √I), float32. The indexer's inputs are
        detached: its loss trains the indexer alone (index_keys likewise)."""
        x_BTD = jax.lax.stop_gradient(x_BTD)
        q_BTIJ = project("btq,qij->btij", jax.lax.stop_gradient(self.query_latent(x_BTD)), self.index_q[...])
        q_BTIJ = self._rope(q_BTIJ.astype(jnp.float32), positions_BT, False)
        w_BTI = project("btd,di->bti", x_BTD, self.index_w[...]).astype(jnp.float32) * self.cfg.index_n_heads ** -0.5
        return q_BTIJ, w_BTI

    def index_keys(self, x_BTD, positions_BT):
        """k_I [B, T, J] rotated, float32: what decoding caches beside the latent."""
        k_BTJ = self.index_norm(project("btd,dj->btj", jax.lax.stop_gradient(x_BTD), self.index_k[...]))
        return self._rope(k_BTJ[:, :, None].astype(jnp.float32), positions_BT, False)[:, :, 0]

    def index_scores(self, q_BTIJ, w_BTI, k_BSJ, visible_BTS):
        """The indexer's scores of every key [B, T, S] (−inf where not visible), float32: the heads'
        scores added one head at a time ([B, T, S] held)."""
        k_BSJ = k_BSJ.astype(jnp.float32)
        scale = self.cfg.index_head_dim ** -0.5

        def add_head(scores_BTS, head):
            q_BTJ, w_BT = head
            return scores_BTS + w_BT[..., None] * jax.nn.relu(jnp.einsum("btj,bsj->bts", q_BTJ, k_BSJ) * scale), None
        zeros = jnp.zeros((*q_BTIJ.shape[:2], k_BSJ.shape[1]), jnp.float32)
        scores_BTS, _ = jax.lax.scan(add_head, zeros, (jnp.moveaxis(q_BTIJ, 2, 0), jnp.moveaxis(w_BTI, 2, 0)))
        return jnp.where(visible_BTS, scores_BTS, -jnp.inf)

    def choose(self, q_BTIJ, w_BTI, k_BSJ, visible_BTS):
        """The indexer's choice: (the `index_topk` visible keys of each query with the highest scores,
        [B, T, k] slot indices (k = min(index_topk, S)); whether each is visible [B, T, k]: every
        visible key is chosen while there are fewer; the chosen keys' scores [B, T, k], the indexer's
        logits its loss reads)."""
        scores_BTS = self.index_scores(q_BTIJ, w_BTI, k_BSJ, visible_BTS)
        top_BTk, index_BTk = jax.lax.top_k(jax.lax.stop_gradient(scores_BTS), min(self.cfg.index_topk, scores_BTS.shape[-1]))
        chosen_BTk = jnp.take_along_axis(scores_BTS, index_BTk, axis=-1)
        return index_BTk, top_BTk > -jnp.inf, chosen_BTk

    def attend_chosen(self, q_nope_BTNP, q_rope_BTNR, c_BSC, k_rope_BSR, index_BTk, valid_BTk):
        """Latent attention over each query's chosen slots only: their latents and RoPE keys gathered
        ([B, T, k, C + R]), the key and value up-projections absorbed into the query and the output
        (mla_cache's form: no head is expanded), float32 scores. (out_BTNV, the heads' attention
        probabilities [B, T, N, k])."""
        # a gather per row (batched over B: a batch-sharded cache stays where it is)
        take = jax.vmap(lambda a_SX, i_Tk: a_SX[i_Tk])
        return self._absorbed(q_nope_BTNP, q_rope_BTNR, take(c_BSC, index_BTk), take(k_rope_BSR, index_BTk),
                              valid_BTk, "btk")

    def attend_all(self, q_nope_BTNP, q_rope_BTNR, c_BSC, k_rope_BSR, visible_BTS):
        """The dense warm-up's attention: every visible key, in the same absorbed form, nothing
        gathered. (out_BTNV, probabilities [B, T, N, S])."""
        return self._absorbed(q_nope_BTNP, q_rope_BTNR, c_BSC, k_rope_BSR, visible_BTS, "bs")

    def _absorbed(self, q_nope_BTNP, q_rope_BTNR, c_C, k_rope_R, valid_BTk, keys: str):
        """Attention with the up-projections absorbed over latents and RoPE keys laid out as `keys`
        says ("btk": each query's own [B, T, k, ...]; "bs": shared by the queries, [B, S, ...])."""
        P = self.cfg.qk_nope_head_dim
        kv_b_CNc = lora.weight(self, "kv_b").astype(q_nope_BTNP.dtype)  # a LoRA adapter folded in: absorbed too
        q_lat_BTNC = jnp.einsum("btnp,cnp->btnc", q_nope_BTNP, kv_b_CNc[..., :P])
        k = keys[-1]
        scores_BTNk = (jnp.einsum(f"btnc,{keys}c->btn{k}", q_lat_BTNC, c_C.astype(q_lat_BTNC.dtype))
                       + jnp.einsum(f"btnr,{keys}r->btn{k}", q_rope_BTNR, k_rope_R.astype(q_rope_BTNR.dtype)))
        scores_BTNk = jnp.where(valid_BTk[:, :, None], scores_BTNk.astype(jnp.float32) * self.scale,
                                jnp.finfo(jnp.float32).min)
        probs_BTNk = jax.nn.softmax(scores_BTNk, axis=-1)
        out_lat_BTNC = jnp.einsum(f"btn{k},{keys}c->btnc", probs_BTNk.astype(c_C.dtype), c_C)
        out_BTNV = jnp.einsum("btnc,cnv->btnv", out_lat_BTNC, kv_b_CNc[..., P:].astype(out_lat_BTNC.dtype))
        return out_BTNV, probs_BTNk

    def _sparse_block(self, x_BTD, positions_BT, segments_BT, keys: Keys, dropout_key=None):
        q_nope, q_rope = self.queries(x_BTD, positions_BT, False, dropout_key)
        q_BTIJ, w_BTI = self.index_queries(x_BTD, positions_BT)
        seen_BTS = visible(positions_BT, segments_BT, keys.pos_BS, keys.seg_BS)
        if self.cfg.index_stage == "dense_warmup":
            out_BTNV, probs_BTNS = self.attend_all(q_nope, q_rope, keys.c_BSC, keys.k_rope_BSR, seen_BTS)
            return with_indexer_loss(out_BTNV, self.index_scores(q_BTIJ, w_BTI, keys.k_index_BSJ, seen_BTS),
                                     indexer_target(probs_BTNS, seen_BTS), seen_BTS)
        index_BTk, valid_BTk, chosen_BTk = self.choose(q_BTIJ, w_BTI, keys.k_index_BSJ, seen_BTS)
        out_BTNV, probs_BTNk = self.attend_chosen(q_nope, q_rope, keys.c_BSC, keys.k_rope_BSR, index_BTk, valid_BTk)
        return with_indexer_loss(out_BTNV, chosen_BTk, indexer_target(probs_BTNk, valid_BTk), valid_BTk)

    def sparse(self, x_BTD, positions_BT, segments_BT, keys: Keys, dropout_key=None):
        """The new tokens' attention over `keys` (the sequence itself in training and the prefill, the
        cache and themselves in a decode step), each reading its chosen latents only: out_BTNV. A long
        sequence's queries in blocks (QUERY_BLOCK), each block's work recomputed in the backward pass."""
        B, T = x_BTD.shape[:2]
        block = max(d for d in range(1, min(T, QUERY_BLOCK) + 1) if T % d == 0)
        if block == T:
            return self._sparse_block(x_BTD, positions_BT, segments_BT, keys, dropout_key)
        split = lambda a: jnp.moveaxis(a.reshape(B, T // block, block, *a.shape[2:]), 1, 0)  # noqa: E731
        run = jax.checkpoint(lambda xs: self._sparse_block(*xs, keys, dropout_key))
        out = jax.lax.map(run, (split(x_BTD), split(positions_BT), split(segments_BT)))
        return jnp.moveaxis(out, 0, 1).reshape(B, T, *out.shape[3:])

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False):
        c_BTC, k_rope_BTR = self.latent(x_BTD, positions_BT, False, dropout_key)
        keys = Keys(c_BTC, k_rope_BTR, self.index_keys(x_BTD, positions_BT), positions_BT, segment_ids_BT)
        out_BTNV = self.sparse(x_BTD, positions_BT, segment_ids_BT, keys, dropout_key)
        out_BTNV = constrain(out_BTNV, ("activation_batch", "activation_length", "activation_heads", None))
        return constrain(self.out(out_BTNV, dropout_key), BTD)


INDEXER = ("index_q", "index_k", "index_norm", "index_w")


def freeze_all_but_the_indexers(model: nnx.Module) -> None:
    """The dense warm-up: every parameter but the indexers' tagged `frozen` (maxlite.state.split_trainable
    leaves them out of the optimizer, as a vision tower's)."""
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param) and not any(part in INDEXER for part in path):
            variable.set_metadata(frozen=True)


def indexer_target(probs_BTNk, valid_BTk):
    """The indexer's target: the heads' attention over its keys, summed over heads and normalised, detached."""
    target_BTk = jnp.sum(jax.lax.stop_gradient(probs_BTNk), axis=2) * valid_BTk
    return target_BTk / jnp.maximum(jnp.sum(target_BTk, axis=-1, keepdims=True), 1e-30)


@jax.custom_vjp
def with_indexer_loss(out_BTNV, logits_BTk, target_BTk, valid_BTk):
    """`out_BTNV` as it is, and in the backward pass the gradient of the indexer's loss,
    Σ_t KL(target_t ‖ softmax(logits_t)) over each query's chosen keys (DeepSeek-V3.2's sparse-stage
    indexer loss), sent to the indexer's logits: added to the objective's gradient as if the loss were
    (the loss is summed over tokens as the objective's is, then divided with it by the tokens), while
    the objective's value stays the language model's. The logits are the indexer's own (its inputs
    detached), so this trains the indexer and nothing else."""
    return out_BTNV


def _with_indexer_loss_fwd(out_BTNV, logits_BTk, target_BTk, valid_BTk):
    return out_BTNV, (logits_BTk, target_BTk, valid_BTk)


def _with_indexer_loss_bwd(residuals, g_BTNV):
    logits_BTk, target_BTk, valid_BTk = residuals
    p_BTk = jax.nn.softmax(jnp.where(valid_BTk, logits_BTk, -jnp.inf), axis=-1)
    d_logits = jnp.where(valid_BTk, p_BTk - target_BTk, 0.0)  # ∂ KL(target ‖ softmax(logits)) / ∂ logits
    return g_BTNV, d_logits.astype(logits_BTk.dtype), jnp.zeros_like(target_BTk), None


with_indexer_loss.defvjp(_with_indexer_loss_fwd, _with_indexer_loss_bwd)
