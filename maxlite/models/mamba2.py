"""The Mamba-2 mixer (Nemotron-H): a selective state space layer whose state is a fixed-size matrix per
head, so a token's cost does not grow with the context.

Per layer (the equations of transformers' NemotronHMamba2Mixer, its PyTorch path):
  z, x [M heads × P], B, C [G groups × S], dt [M]     projections of the normed input
  x, B, C ← SiLU(causal depthwise conv (+ bias), kernel W = mamba_conv_kernel_dim)
  Δ = softplus(dt + dt_bias),  A = −exp(A_log)    (Δ·A ≤ 0: the log of the state's decay)
  h_t = exp(Δ_t A) h_{t−1} + Δ_t x_t B_tᵀ,   y_t = h_t C_t + D x_t    (head m reads group m // (M/G))
  out = out_proj( RMSNorm_G(y · SiLU(z)) · w )   (the gated norm over G groups of M·P/G channels)

Training runs the chunked form (state space duality, `chunked_scan`): within a chunk of C tokens the
output is a masked quadratic form (C·Bᵀ weighted by the decay between the two tokens), and the
state h [P, S] (float32) passes from chunk to chunk in a lax.scan. Packed documents do not leak:
the state and the convolution's window are reset where the segment changes. Decoding carries h and
the last W−1 convolution inputs (maxlite/models/mamba2_cache.py); a step of one token runs chunks
of one, the recurrent form.

Shape legend as in layers.py, plus C chunk, n chunks, M heads, P head dim, G groups, S state dim,
W conv taps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxlite.models.gated_deltanet import causal_conv
from maxlite.models.layers import BTD, constrain, param
from maxlite.models.matmul import project


def chunked_scan(x_BTMP, dt_BTM, A_M, B_BTGS, C_BTGS, seg_BT, state_BMPS=None, chunk: int = 128):
    """The selective scan h_t = exp(Δ_t A) h_{t−1} + Δ_t x_t B_tᵀ, y_t = h_t C_t over T tokens in
    chunks of `chunk` (float32 throughout): (y_BTMP without the D skip, the state after the last
    token). `state_BMPS` is the state before the first token (it belongs to the first token's
    segment; None: zeros). A term between two tokens counts only when they share a segment; a token
    with Δ = 0 leaves the state as it was (decoding's padding).

    One chunk at a time (a lax.scan over chunks, each chunk's work recomputed in the backward pass):
    a chunk's quadratic form is [B, M, C, C] float32, which over a whole 8k sequence of Nemotron-H 8B
    (64 chunks, 128 heads) would be 0.5 GiB per array; and C·Bᵀ stays per group ([B, G, C, C]), each
    head reading its group's without a copy."""
    f32 = jnp.float32
    B, T, M, P = x_BTMP.shape
    G, S = B_BTGS.shape[2:]
    C, heads = chunk, M // G  # head m reads group m // heads
    pad = -T % C
    n = (T + pad) // C

    def blocks(x):  # [B, T, H, X] → [n, B, H, C, X]; [B, T, H] → [n, B, H, C]
        x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, C, *x.shape[2:])
        return x.transpose(1, 0, 3, 2, 4) if x.ndim == 5 else x.transpose(1, 0, 3, 2)

    seg = jnp.moveaxis(jnp.pad(seg_BT, [(0, 0), (0, pad)], mode="edge").reshape(B, n, C), 1, 0)  # [n, B, C]
    seg_in = jnp.concatenate([seg[:1, :, 0], seg[:-1, :, -1]], axis=0)  # the entering state's segment [n, B]
    A, tril = A_M.astype(f32)[:, None], jnp.tril(jnp.ones((C, C), bool))
    by_group = lambda a: a.reshape(B, G, heads, *a.shape[2:])  # noqa: E731  [B, M, ...] → [B, G, heads, ...]

    @jax.checkpoint
    def step(h_BMPS, xs):
        x, dt, B_c, C_c, seg, seg_in = xs  # [B, M, C, P], [B, M, C], [B, G, C, S] ×2, [B, C], [B]
        gamma = jnp.cumsum(dt * A, axis=-1)                                 # [B, M, C]
        live = ((seg[:, :, None] == seg[:, None, :]) & tril)[:, None]       # [B, 1, C, C]
        diff = gamma[..., :, None] - gamma[..., None, :]
        decay = jnp.where(live, jnp.exp(jnp.where(live, diff, 0.0)), 0.0)  # exp(γ_i − γ_j), j ≤ i, one segment
        first = (seg == seg_in[:, None])[:, None]                           # [B, 1, C]: sees the entering state
        last = (seg == seg[:, -1:])[:, None]                                # shares the chunk's last segment
        xdt = by_group(x * dt[..., None])                                   # [B, G, heads, C, P]
        CB = jnp.einsum("bgis,bgjs->bgij", C_c, B_c)[:, :, None]            # [B, G, 1, C, C]
        y = jnp.einsum("bghij,bghjp->bghip", CB * by_group(decay), xdt)
        h = by_group(h_BMPS)                                                # [B, G, heads, P, S]
        y = y + jnp.einsum("bgcs,bghps->bghcp", C_c, h) * by_group(jnp.exp(gamma) * first)[..., None]
        into = by_group(jnp.exp(gamma[..., -1:] - gamma) * last)[..., None]  # [B, G, heads, C, 1]
        h = (h * by_group(jnp.exp(gamma[..., -1]) * first[..., -1])[..., None, None]
             + jnp.einsum("bgcs,bghcp->bghps", B_c, xdt * into))
        return h.reshape(B, M, P, S), y.reshape(B, M, C, P)

    h0 = jnp.zeros((B, M, P, S), f32) if state_BMPS is None else state_BMPS.astype(f32)
    xs = (blocks(x_BTMP), blocks(dt_BTM), blocks(B_BTGS), blocks(C_BTGS), seg, seg_in)
    h, y = jax.lax.scan(step, h0, xs)  # y [n, B, M, C, P]
    return y.transpose(1, 0, 3, 2, 4).reshape(B, n * C, M, P)[:, :T], h


class Mamba2(nnx.Module):
    """The Mamba-2 mixer of a layer (`mamba2` kind); parameters under `attn`."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, M, P = cfg.base_emb_dim, cfg.mamba_num_heads, cfg.mamba_head_dim
        G, S, W = cfg.mamba_num_groups, cfg.mamba_state_dim, cfg.mamba_conv_kernel_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        head_axes, group_axes = ("embed", "heads", "head_dim"), ("embed", None, None)
        self.z = param(rngs, (D, M, P), head_axes, wd, scale=s)
        self.x = param(rngs, (D, M, P), head_axes, wd, scale=s)
        self.B = param(rngs, (D, G, S), group_axes, wd, scale=s)
        self.C = param(rngs, (D, G, S), group_axes, wd, scale=s)
        self.dt = param(rngs, (D, M), ("embed", "heads"), wd, scale=s)
        # conv taps as HF's conv1d.weight[c, 0, m], split by the tensor they filter
        self.conv_x = param(rngs, (W, M, P), (None, "heads", "head_dim"), wd, scale=0.5)
        self.conv_B = param(rngs, (W, G, S), (None, None, None), wd, scale=0.5)
        self.conv_C = param(rngs, (W, G, S), (None, None, None), wd, scale=0.5)
        if cfg.mamba_conv_bias:
            self.conv_bias_x = param(rngs, (M, P), ("heads", "head_dim"), wd, init="zeros")
            self.conv_bias_B = param(rngs, (G, S), (None, None), wd, init="zeros")
            self.conv_bias_C = param(rngs, (G, S), (None, None), wd, init="zeros")
        # A = 1..M over the heads, D and the step bias 1: as HF initialises them
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, M + 1, dtype=jnp.float32)).astype(wd), out_sharding=("heads",))
        self.D = param(rngs, (M,), ("heads",), wd, init="ones")
        self.dt_bias = param(rngs, (M,), ("heads",), wd, init="ones")
        self.norm_scale = param(rngs, (M, P), ("heads", "head_dim"), wd, init="ones")
        self.o = param(rngs, (M, P, D), ("heads", "head_dim", "embed"), wd, scale=s)
        self.cfg, self.dtype, self.eps = cfg, jnp.dtype(cfg.dtype), cfg.normalization_layer_epsilon
        self.groups, self.bias = G, cfg.mamba_conv_bias

    def mix(self, x_BTD, seg_BT, valid_BT=None, windows=None, state=None, chunk: int | None = None):
        """(out_BTD, the conv windows after these tokens, the state after them). `valid_BT` marks real
        tokens (a prefix of each row; the rest neither write the state nor the windows); `windows`
        (x, B, C inputs before the first token) and `state` continue a sequence (decoding)."""
        f32 = jnp.float32
        z = project("btd,dmp->btmp", x_BTD, self.z[...])
        xs = project("btd,dmp->btmp", x_BTD, self.x[...])
        Bs = project("btd,dgs->btgs", x_BTD, self.B[...])
        Cs = project("btd,dgs->btgs", x_BTD, self.C[...])
        dt = project("btd,dm->btm", x_BTD, self.dt[...])
        windows = (None, None, None) if windows is None else windows
        biases = (self.conv_bias_x, self.conv_bias_B, self.conv_bias_C) if self.bias else (None,) * 3
        (xs, x_ext), (Bs, B_ext), (Cs, C_ext) = (
            causal_conv(v, w[...], seg_BT, win, None if b is None else b[...]) for v, w, win, b in
            zip((xs, Bs, Cs), (self.conv_x, self.conv_B, self.conv_C), windows, biases))
        dt = jax.nn.softplus(dt.astype(f32) + self.dt_bias[...].astype(f32))
        if valid_BT is not None:
            dt = dt * valid_BT[..., None]
        A = -jnp.exp(self.A_log[...].astype(f32))
        y, state = chunked_scan(xs, dt, A, Bs, Cs, seg_BT, state, chunk or self.cfg.mamba_chunk_size)
        y = y + self.D[...].astype(f32)[:, None] * xs.astype(f32)
        # the gated norm: y · SiLU(z), RMS-normed over each group's M·P/G channels, then scaled
        y = y * jax.nn.silu(z.astype(f32))
        B, T, M, P = y.shape
        grouped = y.reshape(B, T, self.groups, M * P // self.groups)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
        y = grouped.reshape(B, T, M, P) * self.norm_scale[...].astype(f32)
        y = constrain(y.astype(self.dtype), ("activation_batch", "activation_length", "activation_heads", None))
        out = constrain(checkpoint_name(project("btmp,mpd->btd", y, self.o[...]), "out_proj"), BTD)
        W = self.conv_x.shape[0]
        kept = jnp.sum(valid_BT, axis=1) if valid_BT is not None else jnp.full(x_BTD.shape[:1], x_BTD.shape[1])
        index = kept[:, None] + jnp.arange(W - 1)  # the last W−1 real inputs, in x_ext's positions

        def last(ext):
            return jnp.take_along_axis(ext, index.reshape(*index.shape, *(1,) * (ext.ndim - 2)), axis=1)
        return out, (last(x_ext), last(B_ext), last(C_ext)), state

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False):
        return self.mix(x_BTD, segment_ids_BT)[0]
