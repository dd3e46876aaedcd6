"""Kimi delta attention (KDA, Kimi Linear): the `kda` mixer kind, a gated delta rule whose decay is
per channel (each key dim of each head its own), not per head as the gated delta-net's.

Per layer (the equations of transformers' KimiLinearDeltaAttention, its torch path):
  q, k, v [H heads × Dh] projections of the normed input, each SiLU(causal depthwise conv, W taps)
  q, k ← L2-normalised (eps 1e-6), q × Dh^-½;   β = sigmoid(x·W_b) [H]
  g = −exp(A_log[h]) · softplus(x·W_fa·W_fb + dt_bias)   [H, Dh], a low-rank (Dh) forget gate
  S_t = Diag(exp(g_t)) S_{t−1} + k_t δ_tᵀ,  δ_t = β_t (v_t − (Diag(exp(g_t)) S_{t−1})ᵀ k_t),  o_t = S_tᵀ q_t
  out = o_proj( RMSNorm(o) · w · sigmoid(x·W_ga·W_gb) )   (a low-rank output gate, sigmoid, plain w)

What is the gated delta-net's is reused from maxlite/models/gated_deltanet.py: the causal
convolution, the L2 norm and the chunked rule (`chunked_delta_rule`, given a per-channel g: within a
chunk the pairwise decays exp(γ_i − γ_j) are [C, C, Dh] per head; the state passes from chunk to
chunk). The dims are the gated delta-net keys' (gdn_num_key_heads = gdn_num_value_heads = H,
gdn_key_head_dim = gdn_value_head_dim = Dh, gdn_conv_kernel_dim, gdn_chunk_size), so decoding keeps
the same fixed state (maxlite/models/gdn_cache.py, which drives `mix` as it does the gated
delta-net's). Shape legend as in gated_deltanet.py (M = H heads, E = U = Dh; the gates' rank is E).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxlite.models import lora
from maxlite.models.gated_deltanet import _l2norm, causal_conv, chunked_delta_rule
from maxlite.models.layers import BTD, constrain, param
from maxlite.models.matmul import project


class KimiDeltaAttention(nnx.Module):
    """The KDA mixer of a layer (`kda` kind); parameters under `attn`."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, M, E, W = cfg.base_emb_dim, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_conv_kernel_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        heads = ("embed", "heads", "head_dim")
        self.q = param(rngs, (D, M, E), heads, wd, scale=s)
        self.k = param(rngs, (D, M, E), heads, wd, scale=s)
        self.v = param(rngs, (D, M, E), heads, wd, scale=s)
        self.conv_q = param(rngs, (W, M, E), (None, "heads", "head_dim"), wd, scale=0.5)
        self.conv_k = param(rngs, (W, M, E), (None, "heads", "head_dim"), wd, scale=0.5)
        self.conv_v = param(rngs, (W, M, E), (None, "heads", "head_dim"), wd, scale=0.5)
        self.f_a = param(rngs, (D, E), ("embed", None), wd, scale=s)            # the forget gate's low rank
        self.f_b = param(rngs, (E, M, E), (None, "heads", "head_dim"), wd, scale=s)
        self.g_a = param(rngs, (D, E), ("embed", None), wd, scale=s)            # the output gate's
        self.g_b = param(rngs, (E, M, E), (None, "heads", "head_dim"), wd, scale=s)
        self.b = param(rngs, (D, M), ("embed", "heads"), wd, scale=s)
        # A ∈ [1, 16] and dt_bias = softplus⁻¹(dt), dt ∈ [1e-3, 1e-1] log-uniform, as HF (and FLA) initialise them
        a_init = jnp.log(jax.random.uniform(rngs.params(), (M,), jnp.float32, 1.0, 16.0))
        self.A_log = nnx.Param(a_init.astype(wd), out_sharding=("heads",))
        dt = jnp.exp(jax.random.uniform(rngs.params(), (M, E), jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
        self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(wd), out_sharding=("heads", "head_dim"))
        self.norm_scale = param(rngs, (E,), ("head_dim",), wd, init="ones")
        self.o = param(rngs, (M, E, D), ("heads", "head_dim", "embed"), wd, scale=s)
        self.cfg, self.dtype, self.eps = cfg, jnp.dtype(cfg.dtype), cfg.normalization_layer_epsilon
        lora.attach(self, cfg, rngs, {  # LoRA on Kimi's q/k/v/o_proj (grouped-query attention's names)
            **{f"{n}_proj": (1, {n: ((D, M, E), heads)}) for n in "qkv"},
            "o_proj": (2, {"o": ((M, E, D), ("heads", "head_dim", "embed"))})})

    def mix(self, x_BTD, seg_BT, valid_BT=None, windows=None, state=None, chunk: int | None = None, dropout_key=None):
        """(out_BTD, the conv windows after these tokens, the state after them): as
        GatedDeltaNet.mix (maxlite/models/gated_deltanet.py), which gdn_cache.py drives."""
        proj = {n: lora.adapt(self, n, x_BTD, project("btd,dme->btme", x_BTD, getattr(self, n)[...]),
                              dropout_key=dropout_key) for n in "qkv"}
        windows = (None, None, None) if windows is None else windows
        (q, q_ext), (k, k_ext), (v, v_ext) = (
            causal_conv(proj[n], w[...], seg_BT, win) for n, w, win in
            (("q", self.conv_q, windows[0]), ("k", self.conv_k, windows[1]), ("v", self.conv_v, windows[2])))
        f32 = jnp.float32
        q = _l2norm(q.astype(f32)) * q.shape[-1] ** -0.5
        k = _l2norm(k.astype(f32))
        beta = jax.nn.sigmoid(project("btd,dm->btm", x_BTD, self.b[...]).astype(f32))
        f_BTE = project("btd,de->bte", x_BTD, self.f_a[...])
        f = project("bte,emu->btmu", f_BTE, self.f_b[...]).astype(f32) + self.dt_bias[...].astype(f32)
        g = -jnp.exp(self.A_log[...].astype(f32))[:, None] * jax.nn.softplus(f)      # [B, T, M, E]
        if valid_BT is not None:
            beta, g = beta * valid_BT[..., None], g * valid_BT[..., None, None]
        o, state = chunked_delta_rule(q, k, v, g, beta, seg_BT, state, chunk or self.cfg.gdn_chunk_size)
        o = o.astype(self.dtype).astype(f32)  # HF returns the core in the compute dtype, then norms it
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps)
        gate = project("bte,emu->btmu", project("btd,de->bte", x_BTD, self.g_a[...]), self.g_b[...])
        o = (self.norm_scale[...].astype(f32) * o) * jax.nn.sigmoid(gate.astype(f32))
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
