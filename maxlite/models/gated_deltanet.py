"""The gated delta-net mixer (Qwen3.5, Qwen3-Next): linear attention whose state is a fixed-size
matrix per head, so a token's cost does not grow with the context.

Per layer (the equations of transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet):
  q, k [Nk heads × Hk], v, z [Nv heads × Hv], b, a [Nv]   projections of the normed input
  q, k, v ← SiLU(causal depthwise conv, kernel W = gdn_conv_kernel_dim)   each channel its own taps
  q, k ← L2-normalised (eps 1e-6), q × Hk^-½;   each of the Nk q/k heads serves Nv/Nk value heads
  β = sigmoid(b),   g = −exp(A_log) · softplus(a + dt_bias)   (g ≤ 0: log of the state's decay)
  S_t = exp(g_t) S_{t−1} + k_t δ_tᵀ,  δ_t = β_t (v_t − (exp(g_t) S_{t−1})ᵀ k_t),  o_t = S_tᵀ q_t
  out = o_proj( RMSNorm(o) · w · SiLU(z) )   (the gated norm: a plain scale w, not 1 + w)

Training runs the chunked parallel form (`chunked_delta_rule`): within a chunk of C tokens the
updates are a unit lower-triangular system solved at once; the state S [Hk, Hv] (float32) passes
from chunk to chunk in a lax.scan. Packed documents do not leak: the state and the convolution's
window are reset where the segment changes (a term between tokens i and j counts only when they
share a segment). Decoding carries S and the last W−1 convolution inputs
(maxlite/models/gdn_cache.py).

Shape legend as in layers.py, plus C chunk, n chunks, M value heads (Nv), J key heads (Nk),
E key head dim (Hk), U value head dim (Hv), W conv taps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxlite.models import lora
from maxlite.models.layers import BTD, constrain, param
from maxlite.models.matmul import project


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def unit_lower_inverse(T_XCC):
    """The inverse of unit lower-triangular matrices [..., C, C] by recursive doubling: the inverses
    of the diagonal blocks of size b give those of size 2b, [[A, 0], [L, B]]⁻¹ = [[A⁻¹, 0],
    [−B⁻¹ L A⁻¹, B⁻¹]], in log2(C) rounds of batched matmuls. XLA:CPU's triangular solve runs row
    by row (~100× slower here); this is the same arithmetic as a blocked substitution."""
    C = T_XCC.shape[-1]
    P = 1 << (C - 1).bit_length()
    batch = T_XCC.shape[:-2]
    if P != C:  # identity past the end
        T_XCC = jnp.pad(T_XCC, [(0, 0)] * len(batch) + [(0, P - C)] * 2)
        T_XCC = T_XCC + jnp.diag(jnp.arange(P) >= C).astype(T_XCC.dtype)
    inv = jnp.ones((*batch, P, 1, 1), T_XCC.dtype)  # the 1 × 1 diagonal blocks
    b = 1
    while b < P:
        nb = P // (2 * b)
        blocks = jnp.diagonal(T_XCC.reshape(*batch, nb, 2 * b, nb, 2 * b), axis1=-4, axis2=-2)
        lower = jnp.moveaxis(blocks, -1, -3)[..., b:, :b]            # [..., nb, b, b]
        first, second = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        corner = -jnp.einsum("...ij,...jk,...kl->...il", second, lower, first)
        inv = jnp.concatenate([jnp.concatenate([first, jnp.zeros_like(first)], axis=-1),
                               jnp.concatenate([corner, second], axis=-1)], axis=-2)
        b *= 2
    return inv[..., 0, :C, :C]


def zero_state(shape) -> jax.Array:
    """The state before the first token when none is given: float32 zeros that XLA keeps as an array.

    A constant zero state reaches the first chunk's products with the state (`w @ S`, `(q·g_in) @ S`)
    when the sequence is one chunk: XLA then folds the zeros into a broadcast of a scalar inside the
    fusion that computes them, and jaxlib 0.10.2's XLA:CPU computes such a YNNPACK fusion (its
    `__ynn_fusion`: a dot whose operand is a broadcast of a scalar) with another result at each
    compilation of the same program — a scanned Kimi Linear's logits were off by O(1) or NaN in 19 of
    24 compilations, right in every one with XLA's YNNPACK fusions off or with the zeros kept as here
    (benchmarks/repro_kimi_scan_compile.py → benchmarks/results/kimi_scan_compile.json). The barrier
    costs nothing: the products are computed for every later chunk anyway."""
    return jax.lax.optimization_barrier(jnp.zeros(shape, jnp.float32))


def chunked_delta_rule(q_BTME, k_BTME, v_BTMU, g_BTM, beta_BTM, seg_BT, state_BMEU=None, chunk: int = 64):
    """The gated delta rule over T tokens in chunks of `chunk` (float32 throughout): (o_BTMU, the
    state after the last token). The decay's log g is per head [B, T, M], or per head and key dim
    [B, T, M, E] (Kimi delta attention, maxlite/models/kda.py: S_t = Diag(exp(g_t)) S_{t−1} + …). q must be normalised and scaled already; `state_BMEU` is the
    state before the first token (it belongs to the first token's segment; None: zeros). A term
    between two tokens counts only when they share a segment; tokens with β = 0 and g = 0 leave
    the state as it was (decoding's padding).

    One chunk at a time (a lax.scan over chunks, each step recomputed in the backward pass): a chunk's
    decays are [B, M, C, C] float32, and Kimi's per-channel ones [B, M, C, C, E], which for a whole
    4k sequence of Kimi-Linear-48B (64 chunks, 32 heads of 128) would be 4.3 GB per array."""
    f32 = jnp.float32
    B, T, M, E = q_BTME.shape
    U = v_BTMU.shape[-1]
    C = chunk
    pad = -T % C
    n = (T + pad) // C

    def blocks(x):  # [B, T, M, X] → [n, B, M, C, X]; [B, T, M] → [n, B, M, C]
        x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, C, *x.shape[2:])
        return x.transpose(1, 0, 3, 2, 4) if x.ndim == 5 else x.transpose(1, 0, 3, 2)

    seg = jnp.moveaxis(jnp.pad(seg_BT, [(0, 0), (0, pad)], mode="edge").reshape(B, n, C), 1, 0)  # [n, B, C]
    # the segment the state entering each chunk belongs to: the last token's of the chunk before
    seg_in = jnp.concatenate([seg[:1, :, 0], seg[:-1, :, -1]], axis=0)  # [n, B]
    causal, eye = jnp.tril(jnp.ones((C, C), bool)), jnp.eye(C, dtype=f32)

    @jax.checkpoint
    def step(S_BMEU, xs):
        q, k, v, g, beta, seg, seg_in = xs  # [B, M, C, E|U], g [B, M, C] (or [B, M, C, E]), [B, M, C], [B, C], [B]
        live = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]  # [B, 1, C, C]
        first = (seg == seg_in[:, None])[:, None]                        # [B, 1, C]: sees the entering state
        last = (seg == seg[:, -1:])[:, None]                             # shares the chunk's last segment
        k_beta = k * beta[..., None]
        if g.ndim == 4:  # per channel (KDA): each key dim its own decay, exp(γ_i − γ_j) [.., C, C, E] in the sums
            gamma = jnp.cumsum(g, axis=-2)                               # [B, M, C, E]
            live_e = live[..., None]
            diff = gamma[..., :, None, :] - gamma[..., None, :, :]
            decay = jnp.where(live_e, jnp.exp(jnp.where(live_e, diff, 0.0)), 0.0)
            strict = jnp.einsum("bmie,bmje,bmije->bmij", k_beta, k, decay) * ~jnp.eye(C, dtype=bool)
            intra = jnp.einsum("bmie,bmje,bmije->bmij", q, k, decay)
            g_in = jnp.exp(gamma) * first[..., None]                     # decay from the chunk's start
            g_out = jnp.exp(gamma[..., -1:, :] - gamma) * last[..., None]  # decay to the chunk's end
            carry_decay = (jnp.exp(gamma[..., -1, :]) * first[..., -1][..., None])[..., None]  # [B, M, E, 1]
        else:
            gamma = jnp.cumsum(g, axis=-1)                               # [B, M, C]
            diff = gamma[..., :, None] - gamma[..., None, :]
            decay = jnp.where(live, jnp.exp(jnp.where(live, diff, 0.0)), 0.0)  # exp(γ_i − γ_j), j ≤ i, one segment
            strict = jnp.einsum("bmie,bmje->bmij", k_beta, k) * decay * ~jnp.eye(C, dtype=bool)
            intra = jnp.einsum("bmie,bmje->bmij", q, k) * decay
            g_in = (jnp.exp(gamma) * first)[..., None]
            g_out = (jnp.exp(gamma[..., -1:] - gamma) * last)[..., None]
            carry_decay = (jnp.exp(gamma[..., -1]) * first[..., -1])[..., None, None]  # [B, M, 1, 1]
        rhs = jnp.concatenate([v * beta[..., None], k_beta * g_in], axis=-1)
        solved = jnp.einsum("...ij,...jk->...ik", unit_lower_inverse(eye + strict), rhs)
        u, w = solved[..., :U], solved[..., U:]                          # [B, M, C, U], [.., E]
        v_new = u - jnp.einsum("bmce,bmeu->bmcu", w, S_BMEU)
        o = jnp.einsum("bmce,bmeu->bmcu", q * g_in, S_BMEU) + jnp.einsum("bmij,bmju->bmiu", intra, v_new)
        S_BMEU = S_BMEU * carry_decay + jnp.einsum("bmce,bmcu->bmeu", k * g_out, v_new)
        return S_BMEU, o

    S0 = zero_state((B, M, E, U)) if state_BMEU is None else state_BMEU.astype(f32)
    xs = (*(blocks(x) for x in (q_BTME, k_BTME, v_BTMU, g_BTM, beta_BTM)), seg, seg_in)
    S, o = jax.lax.scan(step, S0, xs)  # o [n, B, M, C, U]
    o_BTMU = o.transpose(1, 0, 3, 2, 4).reshape(B, n * C, M, U)[:, :T]
    return o_BTMU, S


def causal_conv(x_BTX, w_WX, seg_BT, window_BVX=None, bias_X=None):
    """SiLU of the causal depthwise convolution: out_t = Σ_m w[m] · x[t − (W−1) + m] (+ bias), each
    input counted only within t's segment; `window_BVX` holds the W−1 inputs before the first
    (decoding; None: zeros). Returns (out, every input with the window before it [B, W−1+T, X])."""
    W = w_WX.shape[0]
    B, T = x_BTX.shape[:2]
    if window_BVX is None:
        window_BVX = jnp.zeros((B, W - 1, *x_BTX.shape[2:]), x_BTX.dtype)
    x_ext = jnp.concatenate([window_BVX.astype(x_BTX.dtype), x_BTX], axis=1)
    seg_ext = jnp.concatenate([jnp.repeat(seg_BT[:, :1], W - 1, axis=1), seg_BT], axis=1)
    w = w_WX.astype(x_BTX.dtype)
    out = sum(w[m] * jnp.where((seg_ext[:, m:m + T] == seg_BT).reshape(B, T, *(1,) * (x_BTX.ndim - 2)),
                               x_ext[:, m:m + T], 0) for m in range(W))
    return jax.nn.silu(out if bias_X is None else out + bias_X.astype(out.dtype)), x_ext


class GatedDeltaNet(nnx.Module):
    """The gated delta-net mixer of a layer (`gated_deltanet` kind); parameters under `attn`."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, J, M = cfg.base_emb_dim, cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
        E, U, W = cfg.gdn_key_head_dim, cfg.gdn_value_head_dim, cfg.gdn_conv_kernel_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        key_axes, value_axes = ("embed", "kv_heads", "head_dim"), ("embed", "heads", "head_dim")
        self.q = param(rngs, (D, J, E), key_axes, wd, scale=s)
        self.k = param(rngs, (D, J, E), key_axes, wd, scale=s)
        self.v = param(rngs, (D, M, U), value_axes, wd, scale=s)
        self.z = param(rngs, (D, M, U), value_axes, wd, scale=s)
        self.b = param(rngs, (D, M), ("embed", "heads"), wd, scale=s)
        self.a = param(rngs, (D, M), ("embed", "heads"), wd, scale=s)
        # conv taps as HF's conv1d.weight[c, 0, m], split by the tensor they filter
        self.conv_q = param(rngs, (W, J, E), (None, "kv_heads", "head_dim"), wd, scale=0.5)
        self.conv_k = param(rngs, (W, J, E), (None, "kv_heads", "head_dim"), wd, scale=0.5)
        self.conv_v = param(rngs, (W, M, U), (None, "heads", "head_dim"), wd, scale=0.5)
        # the decay's rate A ∈ [1, 16] (log-uniform spread over the heads) and the step bias, as HF
        # initialises them
        a_init = jnp.log(jax.random.uniform(rngs.params(), (M,), jnp.float32, 1.0, 16.0))
        self.A_log = nnx.Param(a_init.astype(wd), out_sharding=("heads",))
        self.dt_bias = param(rngs, (M,), ("heads",), wd, init="ones")
        self.norm_scale = param(rngs, (U,), ("head_dim",), wd, init="ones")
        self.o = param(rngs, (M, U, D), ("heads", "head_dim", "embed"), wd, scale=s)
        self.cfg, self.dtype, self.eps = cfg, jnp.dtype(cfg.dtype), cfg.normalization_layer_epsilon
        q, k, v = ((D, J, E), key_axes), ((D, J, E), key_axes), ((D, M, U), value_axes)
        z, b, a = ((D, M, U), value_axes), ((D, M), ("embed", "heads")), ((D, M), ("embed", "heads"))
        lora.attach(self, cfg, rngs, {  # LoRA on the HF projections (Qwen3.5's, or Qwen3-Next's fused ones)
            "in_proj_qkv": (1, {"q": q, "k": k, "v": v}), "in_proj_z": (1, {"z": z}), "in_proj_b": (1, {"b": b}),
            "in_proj_a": (1, {"a": a}), "in_proj_qkvz": (1, {"q": q, "k": k, "v": v, "z": z}),
            "in_proj_ba": (1, {"b": b, "a": a}),
            "out_proj": (2, {"o": ((M, U, D), ("heads", "head_dim", "embed"))})})

    def mix(self, x_BTD, seg_BT, valid_BT=None, windows=None, state=None, chunk: int | None = None, dropout_key=None):
        """(out_BTD, the conv windows after these tokens, the state after them). `valid_BT` marks real
        tokens (a prefix of each row; the rest neither write the state nor the windows); `windows`
        (q, k, v inputs before the first token) and `state` continue a sequence (decoding)."""
        J, M = self.q.shape[1], self.v.shape[1]
        q = project("btd,dje->btje", x_BTD, self.q[...])
        k = project("btd,dje->btje", x_BTD, self.k[...])
        v = project("btd,dmu->btmu", x_BTD, self.v[...])
        z = project("btd,dmu->btmu", x_BTD, self.z[...])
        b = project("btd,dm->btm", x_BTD, self.b[...])
        a = project("btd,dm->btm", x_BTD, self.a[...])
        proj = {"q": q, "k": k, "v": v, "z": z, "b": b, "a": a}
        for adapter in ("qkv", "qkvz", "z", "b", "a", "ba"):  # the targeted ones (lora.attach) add their updates
            kernels = lora.KERNELS[adapter]
            updated = lora.adapt(self, adapter, x_BTD, *(proj[n] for n in kernels), dropout_key=dropout_key)
            proj.update(zip(kernels, updated if len(kernels) > 1 else (updated,)))
        q, k, v, z, b, a = (proj[n] for n in "qkvzba")
        windows = (None, None, None) if windows is None else windows
        (q, q_ext), (k, k_ext), (v, v_ext) = (
            causal_conv(x, w[...], seg_BT, win) for x, w, win in
            ((q, self.conv_q, windows[0]), (k, self.conv_k, windows[1]), (v, self.conv_v, windows[2])))
        f32 = jnp.float32
        q = _l2norm(q.astype(f32)) * q.shape[-1] ** -0.5
        k = _l2norm(k.astype(f32))
        q, k = (jnp.repeat(x, M // J, axis=2) for x in (q, k))  # value head m reads key head m // (M/J)
        beta = jax.nn.sigmoid(b).astype(f32)
        g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(a.astype(f32) + self.dt_bias[...].astype(f32))
        if valid_BT is not None:
            beta, g = beta * valid_BT[..., None], g * valid_BT[..., None]
        o, state = chunked_delta_rule(q, k, v, g, beta, seg_BT, state, chunk or self.cfg.gdn_chunk_size)
        o = o.astype(self.dtype).astype(f32)  # HF returns the core in the compute dtype, then norms it
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps)
        o = (self.norm_scale[...].astype(f32) * o) * jax.nn.silu(z.astype(f32))
        o = constrain(o.astype(self.dtype), ("activation_batch", "activation_length", "activation_heads", None))
        out = lora.adapt(self, "o", o, project("btmu,mud->btd", o, self.o[...]), n_in=2, dropout_key=dropout_key)
        out = constrain(checkpoint_name(out, "out_proj"), BTD)
        W = self.conv_q.shape[0]
        kept = jnp.sum(valid_BT, axis=1) if valid_BT is not None else jnp.full(x_BTD.shape[:1], x_BTD.shape[1])
        index = kept[:, None] + jnp.arange(W - 1)  # the last W−1 real inputs, in x_ext's positions

        def last(x_ext):
            return jnp.take_along_axis(x_ext, index.reshape(*index.shape, *(1,) * (x_ext.ndim - 2)), axis=1)
        return out, (last(q_ext), last(k_ext), last(v_ext)), state

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False):
        return self.mix(x_BTD, segment_ids_BT, dropout_key=dropout_key)[0]
