"""Building blocks of the decoder families (Flax NNX; traits in maxlite/models/families.py).

Shape legend: B batch, T query time, S key time, D model dim, N query heads, K kv heads,
G query heads per kv head (N = K·G), H head dim, F mlp dim, V vocab, P max positions.
Parameters carry logical axis names only; `maxlite.mesh.RULES` maps them onto the mesh.
Compute runs in `dtype`; parameters are stored in `weight_dtype` and cast at use.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxlite.models import attention, lora
from maxlite.models.matmul import project
from maxlite.models.families import SWIGLU_ALPHA, family, has_qk_norm

Axes = tuple[str | None, ...]


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Axes, dtype, init: str = "normal",
          scale: float = 0.02) -> nnx.Param:
    if init == "normal":
        value = scale * jax.random.normal(rngs.params(), shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    return nnx.Param(value, out_sharding=axes)


def constrain(x: jax.Array, axes: Axes) -> jax.Array:
    """Shard an activation by logical names (a no-op outside a mesh + rules context)."""
    return nn.with_logical_constraint(x, axes)


BTD = ("activation_batch", "activation_length", "activation_embed")


class RMSNorm(nnx.Module):
    """x·rsqrt(mean(x²) + eps)·(offset + scale) over the last axis, in float32. offset 1 is Gemma's
    (1 + w) norm, its scale stored from 0."""

    def __init__(self, dim: int, eps: float, dtype, weight_dtype, *, rngs: nnx.Rngs, offset: float = 0.0,
                 axes: Axes = ("norm",)):
        self.scale = param(rngs, (dim,), axes, weight_dtype, init="zeros" if offset else "ones")
        self.eps, self.dtype, self.offset = eps, dtype, offset

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * (self.offset + self.scale[...].astype(jnp.float32))).astype(self.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, weight_dtype, *, rngs: nnx.Rngs, offset: float = 0.0,
                 axes: Axes = ("norm",)):
        self.scale = param(rngs, (dim,), ("norm",), weight_dtype, init="ones")
        self.bias = param(rngs, (dim,), ("norm",), weight_dtype, init="zeros")
        self.eps, self.dtype = eps, dtype

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + self.eps)
        x = x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return x.astype(self.dtype)


NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}  # by Family.norm


def make_norm(cfg, dim: int, rngs: nnx.Rngs, axes: Axes = ("norm",)):
    """The family's norm over `dim` (its kind and offset)."""
    fam = family(cfg)
    return NORMS[fam.norm](dim, cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype),
                           rngs=rngs, offset=fam.norm_offset, axes=axes)


def over_heads(norm, x_BTNH: jax.Array) -> jax.Array:
    """A norm over every head of a projection at once: [B, T, N, H] seen as [B, T, N·H]."""
    B, T, N, H = x_BTNH.shape
    return norm(x_BTNH.reshape(B, T, N * H)).reshape(B, T, N, H)


def rotary_dims(cfg) -> int:
    """How many of each head's dimensions RoPE rotates: the first partial_rotary_factor of them."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def rope_frequencies(cfg, local: bool = False, dims: int | None = None) -> np.ndarray:
    """Inverse frequencies [dims/2] (a trace-time constant; dims: rotary_dims) of global layers, with
    the configured scaling (llama3's rule, linear or YaRN), or of sliding-window layers: their own
    unscaled base when local_rope_max_timescale is set, else the global layers' RoPE."""
    h = dims or rotary_dims(cfg)
    own = local and cfg.local_rope_max_timescale > 0
    base = cfg.local_rope_max_timescale if own else cfg.rope_max_timescale
    inv_freq = 1.0 / (base ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if own or cfg.rope_scaling_factor <= 0:
        return inv_freq
    if cfg.rope_scaling_type == "linear":  # positions ÷ factor
        return inv_freq / cfg.rope_scaling_factor
    if cfg.rope_scaling_type == "yarn":
        return _yarn_frequencies(cfg, inv_freq, base, h)
    # Same piecewise rule as Meta's reference and HF's `rope_type: llama3`.
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position
    wavelen = 2 * math.pi / inv_freq
    with np.errstate(divide="ignore", invalid="ignore"):  # hi = lo (Llama 4 Scout's): no band to smooth
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_frequencies(cfg, inv_freq: np.ndarray, base: float, h: int) -> np.ndarray:
    """YaRN (Peng et al. 2023) as HF's `rope_type: yarn`: frequencies that turn fewer than beta_slow
    times over the pre-trained context are divided by the factor, those that turn more than beta_fast
    times are kept, a linear ramp between (in float32, as HF computes it)."""
    def dim_of(rotations):  # the dimension whose frequency turns `rotations` times over the context
        return h * math.log(cfg.rope_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(cfg.beta_fast), dim_of(cfg.beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, h - 1)
    high = high + 0.001 if low == high else high  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(h // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    inv_freq = inv_freq.astype(np.float32)
    kept = 1 - ramp
    return (inv_freq / np.float32(cfg.rope_scaling_factor)) * (1 - kept) + inv_freq * kept


def rope_attention_factor(cfg, local: bool = False) -> float:
    """What YaRN multiplies the rotated q and k by (1 for every other RoPE): the checkpoint's own
    rope_attention_factor, else m(mscale)/m(mscale_all_dim) when both are set, else m(1), with
    m(s) = 0.1·s·ln(factor) + 1 (HF's _compute_yarn_parameters)."""
    if cfg.rope_scaling_type != "yarn" or cfg.rope_scaling_factor <= 0 or (local and cfg.local_rope_max_timescale > 0):
        return 1.0
    if cfg.rope_attention_factor > 0:
        return cfg.rope_attention_factor
    if cfg.mscale and cfg.mscale_all_dim:
        return yarn_mscale(cfg.rope_scaling_factor, cfg.mscale) / yarn_mscale(cfg.rope_scaling_factor, cfg.mscale_all_dim)
    return yarn_mscale(cfg.rope_scaling_factor)


def yarn_mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's magnitude correction m(s) = 0.1·s·ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def mrope_axes(sections: tuple[int, ...], half: int) -> np.ndarray:
    """Which of a token's (time, height, width) positions turns each of the `half` rotary
    frequencies under multimodal RoPE with `sections` frequencies per axis, interleaved as Qwen3-VL
    does: frequency j takes height when j % 3 == 1 and j < 3·sections[1], width when j % 3 == 2
    and j < 3·sections[2], else time. [half] int32 (0, 1, 2)."""
    if sum(sections) != half or len(sections) != 3:
        raise ValueError(f"mrope_sections={list(sections)} must be 3 numbers summing to {half} (the rotated dims / 2)")
    j = np.arange(half)
    axes = np.zeros(half, np.int32)
    axes[(j % 3 == 1) & (j < 3 * sections[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * sections[2])] = 2
    return axes


def rope_positions(cfg, positions: jax.Array, half: int) -> jax.Array:
    """The positions RoPE turns each frequency by: [B, T] as they are, or a multimodal model's
    [B, T, 3] (time, height, width; text tokens have all three equal) → [B, T, half]."""
    if positions.ndim == 2:
        return positions
    return jnp.take(positions, jnp.asarray(mrope_axes(tuple(cfg.mrope_sections), half)), axis=-1)


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array, scale=1.0) -> jax.Array:
    """Rotary embedding in the split-halves layout (the same layout as Hugging Face Llama) on the
    first 2·len(inv_freq) dimensions of each head (partial rotary: the rest pass unchanged), the
    rotated part multiplied by `scale` (YaRN's attention factor). `positions_BT` may also be
    per frequency, [B, T, len(inv_freq)] (rope_positions: multimodal RoPE)."""
    if positions_BT.ndim == 3:
        angles_BTh = positions_BT.astype(jnp.float32) * inv_freq
    else:
        angles_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angles_BTh)[:, :, None, :], jnp.cos(angles_BTh)[:, :, None, :]
    if not (isinstance(scale, (int, float)) and scale == 1.0):
        sin, cos = sin * scale, cos * scale
    x = x_BTNH.astype(jnp.float32)
    rotary = 2 * inv_freq.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    x1, x2 = jnp.split(x_rot, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_pass], axis=-1)
    return out.astype(x_BTNH.dtype)


def l2_norm(x_BTNH: jax.Array, eps: float) -> jax.Array:
    """Each head RMS-normed over its dimensions in float32, no learned scale (Llama 4's q/k "L2" norm)."""
    x = x_BTNH.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(x_BTNH.dtype)


def tempered(cfg, q_BTNH: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """Attention temperature tuning (Llama 4's NoPE layers, arXiv 2501.19399): the query at position p
    times 1 + temperature_tuning_scale · log(1 + ⌊(p + 1) / temperature_tuning_floor_scale⌋), which
    sharpens the softmax of far-reaching layers at long context (1 below the floor scale); as it is
    without temperature_tuning."""
    if not cfg.temperature_tuning:
        return q_BTNH
    p = positions_BT.astype(jnp.float32)
    scale_BT = jnp.log1p(jnp.floor((p + 1.0) / cfg.temperature_tuning_floor_scale)) * cfg.temperature_tuning_scale + 1.0
    return (q_BTNH.astype(jnp.float32) * scale_BT[:, :, None, None]).astype(q_BTNH.dtype)


def _adapters(module, cfg, rngs, kernels: dict) -> None:
    """LoRA A and B (`{kernel}_lora_a`, `{kernel}_lora_b`) beside each targeted kernel."""
    module.lora_scale = lora.scale(cfg) if cfg.lora_rank else 0.0
    module.lora_dropout = cfg.lora_dropout
    for kernel, (shape, axes) in kernels.items():
        if lora.enabled(cfg, kernel):
            n_in = 2 if kernel == "o" else 1
            a, b = lora.make(rngs, shape, axes, n_in, cfg.lora_rank, jnp.dtype(cfg.weight_dtype))
            setattr(module, f"{kernel}_lora_a", a)
            setattr(module, f"{kernel}_lora_b", b)


def _adapted(module, kernel: str, x, y, dropout_key=None):
    """y (= x @ kernel) plus the kernel's LoRA update, if it has one; with `dropout_key` (training
    with lora_dropout > 0) the update sees x through dropout, a mask of its own per kernel (PEFT's)."""
    a = getattr(module, f"{kernel}_lora_a", None)
    if a is None:
        return y
    n_in = 2 if kernel == "o" else 1
    if dropout_key is not None and module.lora_dropout > 0:
        x = lora.dropout(jax.random.fold_in(dropout_key, lora.KERNEL_INDEX[kernel]), x, module.lora_dropout)
    return y + lora.delta(x, a, getattr(module, f"{kernel}_lora_b"), n_in, module.lora_scale, y.dtype)


def pick(local, if_local, if_global):
    """if_local or if_global: statically for a Python bool, else a select on the traced flag (a
    scanned stack whose layers differ)."""
    if isinstance(local, bool):
        return if_local if local else if_global
    return jnp.where(local, if_local, if_global)


class Attention(nnx.Module):
    """Grouped-query causal attention; tokens attend only within their own segment (document), and
    in a sliding-window layer (`local`) to the last `sliding_window` tokens only."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, N, K, H = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        self.q = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), wd, scale=s)
        self.k = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), wd, scale=s)
        self.v = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), wd, scale=s)
        self.o = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), wd, scale=s)
        _adapters(self, cfg, rngs, {"q": ((D, N, H), ("embed", "heads", "head_dim")),
                                    "k": ((D, K, H), ("embed", "kv_heads", "head_dim")),
                                    "v": ((D, K, H), ("embed", "kv_heads", "head_dim")),
                                    "o": ((N, H, D), ("heads", "head_dim", "embed"))})
        fam = family(cfg)
        self.biases = fam.bias_leaves if cfg.use_bias else ()
        bias_shapes = {"q_bias": ((N, H), ("heads", "head_dim")), "k_bias": ((K, H), ("kv_heads", "head_dim")),
                       "v_bias": ((K, H), ("kv_heads", "head_dim")), "o_bias": ((D,), ("norm",))}
        for name in self.biases:
            shape, axes = bias_shapes[name]
            setattr(self, name, param(rngs, shape, axes, wd, init="zeros"))
        qk_norm = has_qk_norm(cfg)
        if fam.qk_norm and fam.qk_norm_heads:  # one scale per element of the projection [N·H]
            self.q_norm = make_norm(cfg, N * H, rngs)
            self.k_norm = make_norm(cfg, K * H, rngs)
        elif qk_norm:  # one scale [H] per projection, shared by its heads
            self.q_norm = make_norm(cfg, H, rngs, ("head_dim",))
            self.k_norm = make_norm(cfg, H, rngs, ("head_dim",))
        if fam.attn_output_gate:  # Qwen3.5's output gate: HF's q_proj holds it beside each head's query
            self.q_gate = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), wd, scale=s)
        self.qk_norm, self.qk_norm_heads, self.use_rope = qk_norm, fam.qk_norm and fam.qk_norm_heads, fam.rope
        # Llama 4: global layers without RoPE (tempered queries instead), a scaleless q/k norm on the others
        self.global_nope, self.qk_l2_norm = fam.global_nope, fam.qk_l2_norm and cfg.use_qk_norm
        self.query_scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar > 0 else None
        if cfg.attention_sink:  # a learned logit per query head in every softmax's denominator (gpt-oss)
            self.sinks = param(rngs, (N,), ("heads",), wd, init="zeros")
        self.cfg = cfg
        self.num_kv, self.dtype = K, jnp.dtype(cfg.dtype)

    def _bias(self, name: str, x):
        return x + getattr(self, name)[...].astype(self.dtype) if name in self.biases else x

    def qkv(self, x_BTD, positions_BT, dropout_key=None, local=False):
        """q_BTNH, k_BTKH, v_BTKH: projections (+ biases), q/k norms and RoPE (a sliding-window
        layer's own when `local`), shared by training and decoding."""
        key = dropout_key
        q_BTNH = _adapted(self, "q", x_BTD, project("btd,dnh->btnh", x_BTD, self.q[...]), key)
        k_BSKH = _adapted(self, "k", x_BTD, project("bsd,dkh->bskh", x_BTD, self.k[...]), key)
        v_BSKH = _adapted(self, "v", x_BTD, project("bsd,dkh->bskh", x_BTD, self.v[...]), key)
        q_BTNH, k_BSKH, v_BSKH = (self._bias(n, x) for n, x in
                                  (("q_bias", q_BTNH), ("k_bias", k_BSKH), ("v_bias", v_BSKH)))
        if self.qk_norm_heads:
            q_BTNH, k_BSKH = over_heads(self.q_norm, q_BTNH), over_heads(self.k_norm, k_BSKH)
        elif self.qk_norm:
            q_BTNH, k_BSKH = self.q_norm(q_BTNH), self.k_norm(k_BSKH)
        if self.use_rope:
            inv_freq = pick(local, jnp.asarray(rope_frequencies(self.cfg, local=True), jnp.float32),
                            jnp.asarray(rope_frequencies(self.cfg), jnp.float32))
            factors = rope_attention_factor(self.cfg, local=True), rope_attention_factor(self.cfg)
            scale = factors[0] if factors[0] == factors[1] else pick(local, *factors)
            positions_BT = rope_positions(self.cfg, positions_BT, inv_freq.shape[-1])
            roped = apply_rope(q_BTNH, positions_BT, inv_freq, scale), apply_rope(k_BSKH, positions_BT, inv_freq, scale)
            if self.qk_l2_norm:  # after RoPE, as Llama 4 (a rotation keeps the norm: the order is rounding only)
                roped = tuple(l2_norm(x, self.cfg.normalization_layer_epsilon) for x in roped)
            if self.global_nope:  # only the local (chunked) layers turn; the global ones are tempered instead
                q_BTNH, k_BSKH = (pick(local, r, x) for r, x in zip(roped, (q_BTNH, k_BSKH)))
                q_BTNH = pick(local, q_BTNH, tempered(self.cfg, q_BTNH, positions_BT))
            else:
                q_BTNH, k_BSKH = roped
        return q_BTNH, k_BSKH, v_BSKH

    def gated(self, out_BTNH, x_BTD):
        """The attention's output times sigmoid(x · q_gate) where the family gates it, else as it is."""
        if not hasattr(self, "q_gate"):
            return out_BTNH
        gate_BTNH = project("btd,dnh->btnh", x_BTD, self.q_gate[...])
        return (out_BTNH * jax.nn.sigmoid(gate_BTNH.astype(jnp.float32))).astype(out_BTNH.dtype)

    def out(self, out_BTNH, dropout_key=None):
        """The output projection (+ bias): [B, T, N, H] → [B, T, D]."""
        out_BTD = _adapted(self, "o", out_BTNH, project("btnh,nhd->btd", out_BTNH, self.o[...]), dropout_key)
        return self._bias("o_bias", out_BTD)

    def sinks_N(self):
        """The attention sinks (float32 [N]), or None."""
        return self.sinks[...].astype(jnp.float32) if self.cfg.attention_sink else None

    def _attend(self, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, local, blocks_BT=None, positions_BT=None):
        """The attention implementation with this layer's window: static for a Python bool; a
        scanned stack of local and global layers (Gemma 3) branches on its traced flag. `blocks_BT`:
        the image blocks seen both ways (the "image_blocks" side; None without). A model with
        chunk_attn_window_size C has chunked local layers (config checks refuse it with a window too),
        chunks of each document's own positions (`positions_BT`)."""
        C = self.cfg.chunk_attn_window_size
        W = C or self.cfg.sliding_window

        def run(window):
            return attention.attend(self.cfg, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window=window,
                                    scale=self.query_scale, sinks_N=self.sinks_N(), blocks_BT=blocks_BT,
                                    chunk=C if window else 0, positions_BT=positions_BT)
        if isinstance(local, bool) or not W:
            return run(W if local else 0)
        return jax.lax.cond(local, lambda: run(W), lambda: run(0))

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False, blocks_BT=None):
        q_BTNH, k_BSKH, v_BSKH = self.qkv(x_BTD, positions_BT, dropout_key, local)
        q_BTNH = constrain(q_BTNH, ("activation_batch", "activation_length", "activation_heads", None))
        k_BSKH = constrain(k_BSKH, ("activation_batch", "activation_length", "activation_kv_heads", None))
        q_BTNH = checkpoint_name(q_BTNH, "query_proj")  # names the remat policies refer to
        k_BSKH = checkpoint_name(k_BSKH, "key_proj")
        v_BSKH = checkpoint_name(v_BSKH, "value_proj")

        chunk_pos_BT = positions_BT if self.cfg.chunk_attn_window_size and positions_BT.ndim == 2 else None
        out_BTNH = self.gated(self._attend(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, local, blocks_BT, chunk_pos_BT),
                              x_BTD)
        out_BTNH = constrain(out_BTNH, ("activation_batch", "activation_length", "activation_heads", None))
        return constrain(checkpoint_name(self.out(out_BTNH, dropout_key), "out_proj"), BTD)


ACTIVATIONS = {"swiglu": jax.nn.silu, "geglu": functools.partial(jax.nn.gelu, approximate=True)}


def clamped_swiglu(gate, up, limit: float):
    """gpt-oss's gated hidden: (up + 1)·g·σ(α·g), the gate clamped above at `limit` and up on both
    sides (no clamp at limit 0)."""
    if limit > 0:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(SWIGLU_ALPHA * gate)


def limited_swiglu(gate, up, limit: float):
    """DeepSeek-V4's gated hidden: silu(g)·up, the gate clamped above at `limit` and up on both sides
    (no clamp at limit 0)."""
    if limit > 0:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def glu(cfg):
    """The family's gated hidden, glu(gate, up): act(gate)·up, or gpt-oss's or DeepSeek-V4's clamped SwiGLU."""
    mlp = family(cfg).mlp
    if mlp == "clamped_swiglu":
        return functools.partial(clamped_swiglu, limit=cfg.mlp_activations_limit)
    if mlp == "limited_swiglu":
        return functools.partial(limited_swiglu, limit=cfg.mlp_activations_limit)
    act = ACTIVATIONS[mlp]
    return lambda gate, up: act(gate) * up


class GatedMLP(nnx.Module):
    """down(act(gate(x)) · up(x)): SwiGLU (SiLU) or GeGLU (tanh GELU), by the family's `mlp`;
    `mlp_dim` wide (default base_mlp_dim; a MoE layer's shared experts: their own)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, mlp_dim: int | None = None):
        D, wd, s = cfg.base_emb_dim, jnp.dtype(cfg.weight_dtype), cfg.init_scale
        F = cfg.base_mlp_dim if mlp_dim is None else mlp_dim
        self.gate = param(rngs, (D, F), ("embed", "mlp"), wd, scale=s)
        self.up = param(rngs, (D, F), ("embed", "mlp"), wd, scale=s)
        self.down = param(rngs, (F, D), ("mlp", "embed"), wd, scale=s)
        _adapters(self, cfg, rngs, {"gate": ((D, F), ("embed", "mlp")), "up": ((D, F), ("embed", "mlp")),
                                    "down": ((F, D), ("mlp", "embed"))})
        self.dtype = jnp.dtype(cfg.dtype)
        self.glu = glu(cfg)

    def _proj(self, kernel: str, spec: str, x, dropout_key):
        return _adapted(self, kernel, x, project(spec, x, getattr(self, kernel)[...]),
                        dropout_key)

    def __call__(self, x_BTD, dropout_key=None):
        gate_BTF = checkpoint_name(self._proj("gate", "btd,df->btf", x_BTD, dropout_key), "mlpwi_0")
        up_BTF = checkpoint_name(self._proj("up", "btd,df->btf", x_BTD, dropout_key), "mlpwi_1")
        h_BTF = constrain(self.glu(gate_BTF, up_BTF), ("activation_batch", "activation_length", "activation_mlp"))
        return constrain(checkpoint_name(self._proj("down", "btf,fd->btd", h_BTF, dropout_key), "mlpwo"), BTD)


def relu2(x):
    """The squared ReLU (Nemotron-H's MLP activation)."""
    return jnp.square(jax.nn.relu(x))


# the ungated MLPs: (activation, whether up and down have biases)
PLAIN_MLPS = {"gelu": (jax.nn.gelu, True), "relu2": (relu2, False)}


class GeluMLP(nnx.Module):
    """down(act(up(x))), ungated: GPT-3's GELU with biases, or Nemotron-H's squared ReLU without
    (the family's `mlp`, PLAIN_MLPS)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, F, wd, s = cfg.base_emb_dim, cfg.base_mlp_dim, jnp.dtype(cfg.weight_dtype), cfg.init_scale
        self.act, biases = PLAIN_MLPS[family(cfg).mlp]
        self.up = param(rngs, (D, F), ("embed", "mlp"), wd, scale=s)
        self.down = param(rngs, (F, D), ("mlp", "embed"), wd, scale=s)
        if biases:
            self.up_bias = param(rngs, (F,), ("mlp",), wd, init="zeros")
            self.down_bias = param(rngs, (D,), ("norm",), wd, init="zeros")
        self.dtype, self.biases = jnp.dtype(cfg.dtype), biases

    def __call__(self, x_BTD, dropout_key=None):  # no adapters in these families
        dt = self.dtype
        h_BTF = project("btd,df->btf", x_BTD, self.up[...])
        h_BTF = checkpoint_name(h_BTF + self.up_bias[...].astype(dt) if self.biases else h_BTF, "mlpwi_0")
        h_BTF = constrain(self.act(h_BTF), ("activation_batch", "activation_length", "activation_mlp"))
        out_BTD = project("btf,fd->btd", h_BTF, self.down[...])
        out_BTD = out_BTD + self.down_bias[...].astype(dt) if self.biases else out_BTD
        return constrain(checkpoint_name(out_BTD, "mlpwo"), BTD)


def make_mlp(cfg, *, rngs: nnx.Rngs):
    """The family's dense MLP (the `dense` feed-forward kind)."""
    return GeluMLP(cfg, rngs=rngs) if family(cfg).mlp in PLAIN_MLPS else GatedMLP(cfg, rngs=rngs)
