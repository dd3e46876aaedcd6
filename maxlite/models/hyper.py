"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4; `hc_mult` > 0): the residual is N
parallel streams [B, T, N, D] instead of one [B, T, D].

Around each branch of a layer (the mixer, then the feed-forward) a `HyperConnection` computes three
sets of weights per token from all N streams (RMS-normed together, one linear map, float32):
`pre` [N] collapses the streams into the branch's input, `post` [N] spreads the branch's output
back over the streams, and `comb` [N, N] mixes the streams themselves, kept doubly stochastic by
Sinkhorn-Knopp iterations (rows and columns summing to 1, so the residual does not grow with depth):

    streams' = post ⊗ branch(Σ_n pre_n · streams_n) + combᵀ · streams

The model's input is the embedding copied into every stream; `HyperHead` collapses the streams once
more (its own `pre`) before the final norm. Matches transformers' DeepseekV4HyperConnection and
DeepseekV4HyperHead; the weights are stored [in, out] as maxlite's are ([N·D, (2 + N)·N]).

Shape legend as in layers.py, plus N streams (S for the [B, T, N, D] residual: x_BTSD).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models.layers import l2_norm, param

STREAMS = ("activation_batch", "activation_length", None, "activation_embed")


def expand(cfg, x_BTD):
    """The embedding copied into each of the `hc_mult` streams: [B, T, N, D]."""
    B, T, D = x_BTD.shape
    return jnp.broadcast_to(x_BTD[:, :, None, :], (B, T, cfg.hc_mult, D))


def sinkhorn(comb_BTNN, iters: int, eps: float):
    """Rows and columns of each [N, N] matrix normalised in turn (columns first), `iters` column passes."""
    comb_BTNN = comb_BTNN / (jnp.sum(comb_BTNN, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb_BTNN = comb_BTNN / (jnp.sum(comb_BTNN, axis=-1, keepdims=True) + eps)
        comb_BTNN = comb_BTNN / (jnp.sum(comb_BTNN, axis=-2, keepdims=True) + eps)
    return comb_BTNN


class HyperConnection(nnx.Module):
    """One branch's collapse, spread and mix weights (float32 parameters whatever weight_dtype)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        N, D = cfg.hc_mult, cfg.base_emb_dim
        self.fn = param(rngs, (N * D, (2 + N) * N), ("embed", None), jnp.float32, scale=cfg.init_scale)
        self.base = param(rngs, ((2 + N) * N,), (None,), jnp.float32, init="zeros")
        self.scale = param(rngs, (3,), (None,), jnp.float32, init="ones")
        self.cfg = cfg

    def weights(self, x_BTSD):
        """(pre [B, T, N], post [B, T, N], comb [B, T, N, N]), float32."""
        cfg, N = self.cfg, self.cfg.hc_mult
        B, T = x_BTSD.shape[:2]
        flat = l2_norm(x_BTSD.reshape(B, T, -1).astype(jnp.float32), cfg.normalization_layer_epsilon)
        mixes = jnp.einsum("btk,kc->btc", flat, self.fn[...], precision=jax.lax.Precision.HIGHEST)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mixes[..., :N] * scale[0] + base[:N]) + cfg.hc_eps
        post = 2 * jax.nn.sigmoid(mixes[..., N:2 * N] * scale[1] + base[N:2 * N])
        comb = mixes[..., 2 * N:].reshape(B, T, N, N) * scale[2] + base[2 * N:].reshape(N, N)
        comb = sinkhorn(jax.nn.softmax(comb, axis=-1) + cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        return pre, post, comb

    def collapse(self, x_BTSD):
        """(the branch's input [B, T, D], then `add(out)`: the streams after the branch's output)."""
        pre, post, comb = self.weights(x_BTSD)
        dt = x_BTSD.dtype
        x_in = jnp.sum(pre[..., None] * x_BTSD.astype(jnp.float32), axis=2).astype(dt)

        def add(out_BTD):
            mixed = jnp.einsum("btjk,btjd->btkd", comb.astype(dt), x_BTSD)  # Σ_j comb[j, k] · stream_j
            return post.astype(dt)[..., None] * out_BTD[:, :, None, :] + mixed
        return x_in, add


class HyperHead(nnx.Module):
    """The streams collapsed into one before the final norm (its own `pre` weights, float32)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        N, D = cfg.hc_mult, cfg.base_emb_dim
        self.fn = param(rngs, (N * D, N), ("embed", None), jnp.float32, scale=cfg.init_scale)
        self.base = param(rngs, (N,), (None,), jnp.float32, init="zeros")
        self.scale = param(rngs, (1,), (None,), jnp.float32, init="ones")
        self.cfg = cfg

    def __call__(self, x_BTSD):
        B, T = x_BTSD.shape[:2]
        flat = l2_norm(x_BTSD.reshape(B, T, -1).astype(jnp.float32), self.cfg.normalization_layer_epsilon)
        mixes = jnp.einsum("btk,kn->btn", flat, self.fn[...], precision=jax.lax.Precision.HIGHEST)
        pre = jax.nn.sigmoid(mixes * self.scale[...][0] + self.base[...]) + self.cfg.hc_eps
        return jnp.sum(pre[..., None] * x_BTSD.astype(jnp.float32), axis=2).astype(x_BTSD.dtype)
