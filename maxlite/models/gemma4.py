"""Gemma 4's layer pieces (the family: maxlite/families/gemma4.py), as transformers' modeling_gemma4 computes them.

Shape legend as in layers.py, plus L layers and P the per-layer embedding width.

- Attention: q and k RMS-normed per head (scales from 1), v RMS-normed without a scale, RoPE, scores
  not scaled (1.0). Sliding-window ("local") layers have head_dim and base_num_kv_heads; global layers
  may be wider (`global_head_dim`, `global_num_kv_heads`), with "proportional" RoPE (only the first
  `global_rope_fraction` of the frequency pairs rotate, the rest have frequency 0) and, with
  `attention_k_eq_v`, no value projection (values: the key projection, v-normed, unrotated).
- Key/value sharing: the last `num_kv_shared_layers` layers have no k/v projections; each attends with
  the keys and values of the last earlier layer of its kind. In training they travel in the layer
  stack's carry (maxlite/models/carry.py, the "kv" side: variant → (k, v)); decoding:
  maxlite/models/gemma4_cache.py.
- Per-layer embeddings: a second table [V_p, L·P] gives each token one P-vector per layer, combined
  with a projection of the (scaled) token embedding; inside layer i, after the MLP's residual add,
  x += norm(proj(gelu(gate(x)) · e_i)). Then each layer's output is multiplied by its `layer_scalar`.
  Both are sides (maxlite/models/sides.py): the blocks run them without naming them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxlite.models.layers import (BTD, Attention, GatedMLP, _adapted, apply_rope, constrain, make_norm, param,
                                   project)
from maxlite.models.layout import attention_shape


def rope_frequencies(cfg, variant: str) -> np.ndarray:
    """Inverse frequencies [H/2] of a layer: local layers the default RoPE with their own base; global
    layers proportional RoPE (HF `rope_type: proportional`) over their own head dim."""
    _, H = attention_shape(cfg, variant == "global")
    if variant == "local":
        base = cfg.local_rope_max_timescale or cfg.rope_max_timescale
        return 1.0 / (base ** (np.arange(0, H, 2, dtype=np.float64) / H))
    angles = int(cfg.global_rope_fraction * H // 2)
    inv_freq = np.zeros(H // 2)
    inv_freq[:angles] = 1.0 / (cfg.rope_max_timescale ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / H))
    return inv_freq


def unscaled_rms(x, eps: float):
    """RMSNorm without a scale (Gemma 4's v_norm), in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Gemma4Attention(Attention):
    """layers.Attention over this layer's own shape, with Gemma 4's norms and RoPE, optionally
    without k/v (`shared`) or without v (`attention_k_eq_v` on global layers)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, variant: str, shared: bool):
        K, H = attention_shape(cfg, variant == "global")
        super().__init__(dataclasses.replace(cfg, head_dim=H, base_num_kv_heads=K), rngs=rngs)
        self.variant, self.shared = variant, shared
        self.k_eq_v = variant == "global" and cfg.attention_k_eq_v
        dropped = ("k", "v", "k_norm") if shared else ("v",) if self.k_eq_v else ()
        for name in dropped:
            for attr in (name, f"{name}_lora_a", f"{name}_lora_b"):
                if hasattr(self, attr):
                    delattr(self, attr)
        self.query_scale = 1.0

    def qkv(self, x_BTD, positions_BT, dropout_key=None, local=False):
        """q_BTNH and (k_BSKH, v_BSKH), the latter None in a sharing layer."""
        inv_freq = jnp.asarray(rope_frequencies(self.cfg, self.variant), jnp.float32)  # a trace-time constant
        q_BTNH = _adapted(self, "q", x_BTD, project("btd,dnh->btnh", x_BTD, self.q[...]), dropout_key)
        q_BTNH = apply_rope(self.q_norm(q_BTNH), positions_BT, inv_freq)
        if self.shared:
            return q_BTNH, None, None
        k_BSKH = _adapted(self, "k", x_BTD, project("bsd,dkh->bskh", x_BTD, self.k[...]), dropout_key)
        v_BSKH = k_BSKH if self.k_eq_v else _adapted(self, "v", x_BTD, project("bsd,dkh->bskh", x_BTD, self.v[...]),
                                                     dropout_key)
        k_BSKH = apply_rope(self.k_norm(k_BSKH), positions_BT, inv_freq)
        return q_BTNH, k_BSKH, unscaled_rms(v_BSKH, self.cfg.normalization_layer_epsilon)

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False, blocks_BT=None):
        return self.carried(x_BTD, {}, positions_BT, segment_ids_BT, dropout_key, local, blocks_BT)[0]

    def carried(self, x_BTD, state: dict, positions_BT, segment_ids_BT, dropout_key=None, local=False,
                blocks_BT=None):
        """(the attention's output, the carry's state): with the "kv" side (a model whose last layers
        share keys and values) a sharing layer attends with `state["kv"]`'s keys and values of its
        variant, and any other layer stores its own there as the latest of its kind. Images' blocks
        (`blocks_BT`, vision_bidirectional) are seen both ways in the sliding-window layers only, as
        transformers' Gemma 4 draws them (its global layers stay causal)."""
        q_BTNH, k_BSKH, v_BSKH = self.qkv(x_BTD, positions_BT, dropout_key, local)
        kv = state.get("kv")
        if self.shared:
            k_BSKH, v_BSKH = kv[self.variant]
        elif kv is not None:
            state = {**state, "kv": {**kv, self.variant: (k_BSKH, v_BSKH)}}
        blocks_BT = blocks_BT if self.variant == "local" else None
        out_BTNH = self._attend(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, local, blocks_BT)
        return constrain(self.out(out_BTNH, dropout_key), BTD), state


def local_attention(cfg, *, rngs):
    return Gemma4Attention(cfg, rngs=rngs, variant="local", shared=False)


def global_attention(cfg, *, rngs):
    return Gemma4Attention(cfg, rngs=rngs, variant="global", shared=False)


def local_attention_shared(cfg, *, rngs):
    return Gemma4Attention(cfg, rngs=rngs, variant="local", shared=True)


def global_attention_shared(cfg, *, rngs):
    return Gemma4Attention(cfg, rngs=rngs, variant="global", shared=True)


def wide_mlp(cfg, *, rngs):
    """The double-wide MLP of the key/value-sharing layers (`use_double_wide_mlp`)."""
    return GatedMLP(cfg, rngs=rngs, mlp_dim=2 * cfg.base_mlp_dim)


def shared_kv_start(cfg, x_BTD) -> dict:
    """The "kv" side's start (maxlite/models/sides.py): the keys and values the sharing layers read,
    before any layer stored them: variant → zeros."""
    B, T, _ = x_BTD.shape
    out = {}
    for variant in ("local", "global"):
        K, H = attention_shape(cfg, variant == "global")
        out[variant] = (jnp.zeros((B, T, K, H), x_BTD.dtype),) * 2
    return out


def per_layer_inputs(model, inputs_BT, x_BTD, seen: dict):
    """The "per_layer" side's inputs: each layer's per-layer embeddings [L, B, T, P] (the model's
    PerLayerInputs part, `per_layer`). An image token takes the padding token's table row (as
    transformers' Gemma4Model looks it up), its projection the image's soft token."""
    cfg = model.cfg
    if cfg.vision_encoder:
        inputs_BT = jnp.where(inputs_BT == cfg.image_token_id, cfg.pad_token_id, inputs_BT)
    return jnp.moveaxis(model.per_layer(inputs_BT, x_BTD), 2, 0)


def per_layer_finish(part: "PerLayerBranch", x_BTD, carry):
    """The "per_layer" side's step after the feed-forward, with this layer's input; a block run without
    the model's per-layer inputs (a multi-token-prediction depth) has none and skips the branch."""
    e_BTP = carry.inputs.get("per_layer")
    return x_BTD if e_BTP is None else part(x_BTD, e_BTP)


def layer_scalar(cfg, *, rngs):
    """The "layer_scalar" side's parameter on each block: its output's scale, from 1."""
    return param(rngs, (1,), ("norm",), jnp.dtype(cfg.weight_dtype), init="ones")


def scale_finish(scalar, x_BTD, carry):
    """The "layer_scalar" side's step, last in the layer."""
    return x_BTD * scalar[...].astype(x_BTD.dtype)


class PerLayerInputs(nnx.Module):
    """The model's per-layer embedding table and the projection of the token embedding: each token's
    [L, P] per-layer inputs, (norm(proj(x)/√D) + table[id]·√P) / √2."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, L, P = cfg.base_emb_dim, cfg.base_num_decoder_layers, cfg.per_layer_embed_dim
        wd = jnp.dtype(cfg.weight_dtype)
        self.embedding = param(rngs, (cfg.per_layer_vocab_size or cfg.vocab_size, L * P), ("vocab", "embed"), wd,
                               scale=cfg.init_scale)
        self.projection = param(rngs, (D, L * P), ("embed", "mlp"), wd, scale=cfg.init_scale)
        self.norm = make_norm(cfg, P, rngs)
        self.cfg = cfg

    def __call__(self, inputs_BT, x_BTD):
        """[B, T, L, P] from the token ids and their scaled embeddings x_BTD."""
        cfg = self.cfg
        B, T = inputs_BT.shape
        L, P, dt = cfg.base_num_decoder_layers, cfg.per_layer_embed_dim, x_BTD.dtype
        token_BTLP = jnp.take(self.embedding[...], inputs_BT, axis=0).astype(dt).reshape(B, T, L, P)
        token_BTLP = token_BTLP * jnp.asarray(math.sqrt(P), dt)
        proj_BTLP = project("btd,de->bte", x_BTD, self.projection[...]) * jnp.asarray(cfg.base_emb_dim ** -0.5, dt)
        proj_BTLP = self.norm(proj_BTLP.reshape(B, T, L, P))
        return (proj_BTLP + token_BTLP) * jnp.asarray(2.0 ** -0.5, dt)


class PerLayerBranch(nnx.Module):
    """Inside a layer: x + norm(proj(gelu(gate(x)) · e)), e this layer's per-layer input [B, T, P]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, P, wd = cfg.base_emb_dim, cfg.per_layer_embed_dim, jnp.dtype(cfg.weight_dtype)
        self.gate = param(rngs, (D, P), ("embed", "mlp"), wd, scale=cfg.init_scale)
        self.proj = param(rngs, (P, D), ("mlp", "embed"), wd, scale=cfg.init_scale)
        self.norm = make_norm(cfg, D, rngs)

    def __call__(self, x_BTD, e_BTP):
        h_BTP = jax.nn.gelu(project("btd,dp->btp", x_BTD, self.gate[...]), approximate=True) * e_BTP
        return x_BTD + self.norm(project("btp,pd->btd", h_BTP, self.proj[...]))


class MoEBlock(nnx.Module):
    """Gemma 4's MoE feed-forward (`enable_moe_block`, the `gemma4_moe` kind): a dense GeGLU MLP and
    routed experts side by side, each between its own norms, their outputs added. It reads the
    un-normed residual: the dense MLP's pre-norm is its own, and so is the experts'. The router
    scores a scale-free RMS norm of the residual times a learned scale and D^-0.5 (softmax, top k,
    renormalised), then multiplies each chosen weight by its expert's learned scale. The experts and
    the routing implementation are maxlite/models/moe.py's."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        from maxlite.models.moe import MoE

        D, wd = cfg.base_emb_dim, jnp.dtype(cfg.weight_dtype)
        self.dense_norm = make_norm(cfg, D, rngs)
        self.dense = GatedMLP(cfg, rngs=rngs)
        self.dense_post_norm = make_norm(cfg, D, rngs)
        self.experts_norm = make_norm(cfg, D, rngs)
        self.experts = MoE(cfg, rngs=rngs)
        self.experts_post_norm = make_norm(cfg, D, rngs)
        self.router_scale = param(rngs, (D,), ("norm",), wd, init="ones")
        self.expert_scale = param(rngs, (cfg.num_experts,), (None,), wd, init="ones")
        self.cfg = cfg

    def __call__(self, x_BTD, dropout_key=None):
        """Decoding's feed-forward: dropless."""
        return self.routed(x_BTD, None, dropout_key, dropless=True)[0]

    def routed(self, x_BTD, segment_ids_BT=None, dropout_key=None, dropless: bool = False):
        from maxlite.models import moe, moe_parallel
        from maxlite.models.names import resolve_moe
        from maxlite.models.platform import target_platform

        cfg, experts = self.cfg, self.experts
        B, T, D = x_BTD.shape
        dense_BTD = self.dense_post_norm(self.dense(self.dense_norm(x_BTD), dropout_key))
        impl = resolve_moe(cfg.moe_implementation, target_platform(), cfg.capacity_factor)
        slots = moe.capacity(cfg, T) if not dropless else (T if impl == "capacity" else 0)
        valid_BT = jnp.ones((B, T), bool) if segment_ids_BT is None else segment_ids_BT != 0
        scores_in = unscaled_rms(x_BTD, cfg.normalization_layer_epsilon) * \
            (self.router_scale[...].astype(jnp.float32) * D ** -0.5).astype(x_BTD.dtype)
        routing = moe.route(cfg, scores_in, experts.router[...], None, valid_BT, slots)
        scale_BTk = jnp.take(self.expert_scale[...].astype(jnp.float32), routing.experts_BTk)
        routing = routing._replace(weights_BTk=routing.weights_BTk * scale_BTk)
        y_BTD, dropped = moe_parallel.experts(impl, self.experts_norm(x_BTD), routing, slots, experts.gate[...],
                                              experts.up[...], experts.down[...], experts.glu,
                                              -1.0 if dropless else cfg.ragged_buffer_factor)
        y_BTD = self.experts_post_norm(y_BTD.astype(x_BTD.dtype))
        # what capped receive buffers dropped counts with the capacity drops (ragged_buffer_factor)
        return constrain(dense_BTD + y_BTD, BTD), {**routing.stats, "dropped": routing.stats["dropped"] + dropped}
