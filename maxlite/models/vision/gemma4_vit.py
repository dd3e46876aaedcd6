"""Gemma 4's image encoder and its multimodal embedder (HF's Gemma4VisionModel + Gemma4MultimodalEmbedder).

An image arrives as the processor made it (maxlite/data/images.py `gemma4_patches`): up to Np patches
of P×P×C pixels in [0, 1], each with its (column, row) in the image's own patch grid, padded to Np
with positions (−1, −1). Then:

  patches · 2 − 1 → a matmul to the width D, + the column's and the row's rows of a learned 2-D
  position table (zero at padding) → `depth` layers: RMSNorm, attention (q/k RMS-normed per head,
  v normed without a scale, 2-D RoPE: the head's first half rotated by the column, its second half
  by the row; scores unscaled; padding keys unseen), RMSNorm, residual; RMSNorm, GeGLU MLP, RMSNorm,
  residual → average of each pool×pool block of the grid (the blocks in row-major order; an image
  of w × h patches gives (w/pool)·(h/pool) soft tokens, the rest of its M = Np/pool² slots are
  padding) → × √D in float32 (→ optional standardisation by a stored bias and scale) → the embedder:
  RMSNorm without a scale, a matmul to the text model's width E.

Shape legend: I images, T patches (Np), C = P·P·3 pixels per patch, D vision width, N heads, K kv
heads, H head dim, F mlp dim, M soft-token slots per image, E text hidden size. Compute runs in
`dtype`, softmax, norms and the pooling in float32; parameters are stored in `weight_dtype`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxlite.models.layers import RMSNorm, apply_rope, param
from maxlite.models.matmul import project
from maxlite.models.vision.stack import layer_stack, run_stack

ACTIVATIONS = {"gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
               "gelu": functools.partial(jax.nn.gelu, approximate=False)}
# HF's Gemma4ImageProcessor: the soft-token budgets it accepts
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


@dataclasses.dataclass(frozen=True)
class Gemma4VisionSpec:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pool: int  # HF pooling_kernel_size
    max_soft_tokens: int  # soft-token slots per image (the processor's max_soft_tokens)
    position_table: int  # HF position_embedding_size: positions per axis
    text_hidden_size: int
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    standardize: bool = False
    clipped: bool = False  # HF use_clipped_linears: each linear's input and output clamped to stored bounds

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"vision num_heads {self.num_heads} is not a multiple of its kv heads {self.num_kv_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim}: the 2-D RoPE needs a multiple of 4")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")

    @property
    def num_patches(self) -> int:
        """Np: an image's patch slots (the budget of soft tokens × pool²)."""
        return self.max_soft_tokens * self.pool ** 2

    @property
    def patch_width(self) -> int:
        return 3 * self.patch_size ** 2

    @classmethod
    def from_hf(cls, vision: dict, text_hidden_size: int, max_soft_tokens: int) -> Gemma4VisionSpec:
        """From a Gemma4VisionConfig's dict (defaults filled) and the processor's budget."""
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_parameters {rope}: Gemma 4's tower has axial 2-D RoPE")
        return cls(hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                   depth=vision["num_hidden_layers"], num_heads=vision["num_attention_heads"],
                   num_kv_heads=vision["num_key_value_heads"], head_dim=vision["head_dim"],
                   patch_size=vision["patch_size"], pool=vision["pooling_kernel_size"],
                   max_soft_tokens=max_soft_tokens, position_table=vision["position_embedding_size"],
                   text_hidden_size=text_hidden_size, rope_theta=float(rope.get("rope_theta", 100.0)),
                   rms_norm_eps=vision["rms_norm_eps"], hidden_act=vision["hidden_activation"],
                   standardize=bool(vision.get("standardize")), clipped=bool(vision.get("use_clipped_linears")))

    def to_hf(self) -> dict:
        """The Gemma4VisionConfig this spec is."""
        return {"model_type": "gemma4_vision", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.depth,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "hidden_activation": self.hidden_act, "rms_norm_eps": self.rms_norm_eps,
                "patch_size": self.patch_size, "pooling_kernel_size": self.pool,
                "position_embedding_size": self.position_table, "standardize": self.standardize,
                "use_clipped_linears": self.clipped, "attention_bias": False,
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}


def unscaled_rms(x, eps: float):
    """RMSNorm without a scale, in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rope_2d(x_ITNH, positions_IT2, theta: float):
    """The head's first half rotated by the patch's column, the second by its row (HF's axial RoPE:
    head_dim / 4 frequencies per axis, split-halves layout within each half)."""
    H = x_ITNH.shape[-1]
    half = H // 2
    inv_freq = jnp.asarray(1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float64) / half)), jnp.float32)
    parts = [apply_rope(x_ITNH[..., a * half:(a + 1) * half], positions_IT2[..., a], inv_freq) for a in (0, 1)]
    return jnp.concatenate(parts, axis=-1)


LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
BOUNDS = ("input_min", "input_max", "output_min", "output_max")  # HF's names of a clipped linear's bounds


class EncoderLayer(nnx.Module):
    """x + norm(attn(norm(x))), then x + norm(mlp(norm(x))): Gemma's sandwich, no biases. With
    `clipped` each linear's input and output are clamped to its stored bounds (never trained)."""

    def __init__(self, spec: Gemma4VisionSpec, *, rngs: nnx.Rngs, dtype, weight_dtype):
        D, N, K, H, F, eps = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                              spec.intermediate_size, spec.rms_norm_eps)
        wd = weight_dtype
        self.attn_norm = RMSNorm(D, eps, dtype, wd, rngs=rngs)
        self.q = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), wd)
        self.k = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), wd)
        self.v = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), wd)
        self.o = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), wd)
        self.q_norm = RMSNorm(H, eps, dtype, wd, rngs=rngs)
        self.k_norm = RMSNorm(H, eps, dtype, wd, rngs=rngs)
        self.attn_post_norm = RMSNorm(D, eps, dtype, wd, rngs=rngs)
        self.mlp_norm = RMSNorm(D, eps, dtype, wd, rngs=rngs)
        self.gate = param(rngs, (D, F), ("embed", "mlp"), wd)
        self.up = param(rngs, (D, F), ("embed", "mlp"), wd)
        self.down = param(rngs, (F, D), ("mlp", "embed"), wd)
        self.mlp_post_norm = RMSNorm(D, eps, dtype, wd, rngs=rngs)
        if spec.clipped:  # each linear's four bounds (q_input_min, ...): open until loaded, never trained
            for name in LINEARS:
                for bound in BOUNDS:
                    value = nnx.Param(jnp.full((1,), -jnp.inf if bound.endswith("min") else jnp.inf, jnp.float32),
                                      out_sharding=(None,))
                    value.set_metadata(frozen=True)
                    setattr(self, f"{name}_{bound}", value)
        self.spec, self.dtype, self.act = spec, dtype, ACTIVATIONS[spec.hidden_act]

    def linear(self, name: str, spec: str, x):
        """`project` with this layer's weight `name`, clamped in and out where the tower is clipped."""
        if not self.spec.clipped:
            return project(spec, x, getattr(self, name)[...])
        lo_in, hi_in, lo_out, hi_out = (getattr(self, f"{name}_{bound}")[0] for bound in BOUNDS)
        y = project(spec, jnp.clip(x, lo_in.astype(x.dtype), hi_in.astype(x.dtype)), getattr(self, name)[...])
        return jnp.clip(y, lo_out.astype(y.dtype), hi_out.astype(y.dtype))

    def attention(self, x_ITD, positions_IT2, valid_IT):
        spec = self.spec
        q_ITNH = rope_2d(self.q_norm(self.linear("q", "itd,dnh->itnh", x_ITD)), positions_IT2, spec.rope_theta)
        k_ISKH = rope_2d(self.k_norm(self.linear("k", "isd,dkh->iskh", x_ITD)), positions_IT2, spec.rope_theta)
        v_ISKH = unscaled_rms(self.linear("v", "isd,dkh->iskh", x_ITD), spec.rms_norm_eps)
        I, T, N, H = q_ITNH.shape
        K = k_ISKH.shape[2]
        q_ITKGH = q_ITNH.reshape(I, T, K, N // K, H)
        scores = project("itkgh,iskh->ikgts", q_ITKGH, k_ISKH).astype(jnp.float32)
        # padding keys unseen; a finite floor keeps an all-padding image (an empty slot) free of NaNs
        scores = jnp.where(valid_IT[:, None, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out_ITNH = project("ikgts,iskh->itkgh", probs, v_ISKH).reshape(I, T, N, H)
        return self.linear("o", "itnh,nhd->itd", out_ITNH)

    def mlp(self, x_ITD):
        h_ITF = self.act(self.linear("gate", "itd,df->itf", x_ITD)) * self.linear("up", "itd,df->itf", x_ITD)
        return self.linear("down", "itf,fd->itd", h_ITF)

    def __call__(self, x_ITD, positions_IT2, valid_IT):
        x_ITD = x_ITD + self.attn_post_norm(self.attention(self.attn_norm(x_ITD), positions_IT2, valid_IT))
        return x_ITD + self.mlp_post_norm(self.mlp(self.mlp_norm(x_ITD)))


class Gemma4VisionTower(nnx.Module):
    """(patches [I, Np, C], positions [I, Np, 2]) → (soft tokens [I, M, E] in `dtype`, valid [I, M]):
    an image's real soft tokens are its first (w/pool)·(h/pool) slots."""

    def __init__(self, spec: Gemma4VisionSpec, *, rngs: nnx.Rngs, dtype=jnp.float32, weight_dtype=jnp.float32):
        D, E = spec.hidden_size, spec.text_hidden_size
        dtype, wd = jnp.dtype(dtype), jnp.dtype(weight_dtype)
        self.patch = param(rngs, (spec.patch_width, D), (None, "embed"), wd)
        # [column or row, position, D]: the column's and the row's rows are added
        self.positions = param(rngs, (2, spec.position_table, D), (None, "position", "embed"), wd)

        self.layers = layer_stack(spec.depth, lambda r: EncoderLayer(spec, rngs=r, dtype=dtype, weight_dtype=wd),
                                  rngs)
        if spec.standardize:  # HF's std_bias / std_scale: stored with the checkpoint, never trained
            self.std_bias = param(rngs, (D,), ("norm",), wd, init="zeros")
            self.std_scale = param(rngs, (D,), ("norm",), wd, init="ones")
            for name in ("std_bias", "std_scale"):
                getattr(self, name).set_metadata(frozen=True)
        # the multimodal embedder's projection: the decoder's embed dim split like its embeddings
        self.mm_projection = param(rngs, (D, E), (None, "embed"), wd)
        self.spec, self.dtype = spec, dtype

    def encode(self, patches_ITC, positions_IT2):
        """The encoder's last hidden states [I, T, D] and which patches are real [I, T]."""
        spec = self.spec
        if patches_ITC.shape[1:] != (spec.num_patches, spec.patch_width) or positions_IT2.shape[1:] != (
                spec.num_patches, 2):
            raise ValueError(f"image patches {patches_ITC.shape} / positions {positions_IT2.shape}: the tower takes "
                             f"[images, {spec.num_patches}, {spec.patch_width}] and [images, {spec.num_patches}, 2] "
                             f"(maxlite/data/images.py gemma4_patches)")
        valid_IT = jnp.any(positions_IT2 != -1, axis=-1)
        x_ITD = project("itc,cd->itd", (2 * (patches_ITC - 0.5)).astype(self.dtype), self.patch[...])
        at_IT2 = jnp.maximum(positions_IT2, 0)
        table = self.positions[...].astype(self.dtype)
        pos_ITD = jnp.take(table[0], at_IT2[..., 0], axis=0) + jnp.take(table[1], at_IT2[..., 1], axis=0)
        x_ITD = x_ITD + jnp.where(valid_IT[..., None], pos_ITD, 0)
        return run_stack(self.layers, x_ITD, positions_IT2, valid_IT), valid_IT

    def pool(self, x_ITD, positions_IT2, valid_IT):
        """The soft tokens [I, M, D] (float32, × √D, standardised if stored) and which are real [I, M]:
        slot j is the mean of the pool×pool block j of the image's grid, blocks in row-major order."""
        spec, k = self.spec, self.spec.pool
        M = spec.max_soft_tokens
        at_IT2 = jnp.maximum(positions_IT2, 0)
        columns_I = jnp.max(at_IT2[..., 0], axis=-1) + 1
        slot_IT = at_IT2[..., 0] // k + (columns_I // k)[:, None] * (at_IT2[..., 1] // k)
        weight_ITM = jax.nn.one_hot(slot_IT, M, dtype=jnp.float32) * valid_IT[..., None] / k ** 2
        x_IMD = jnp.einsum("itm,itd->imd", weight_ITM, jnp.where(valid_IT[..., None], x_ITD, 0).astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
        x_IMD = x_IMD * np.float32(spec.hidden_size ** 0.5)
        if spec.standardize:
            x_IMD = (x_IMD - self.std_bias[...].astype(jnp.float32)) * self.std_scale[...].astype(jnp.float32)
        return x_IMD, jnp.any(weight_ITM > 0, axis=1)

    def __call__(self, patches_ITC, positions_IT2):
        x_ITD, valid_IT = self.encode(patches_ITC, positions_IT2)
        x_IMD, valid_IM = self.pool(x_ITD, positions_IT2, valid_IT)
        x_IMD = unscaled_rms(x_IMD.astype(self.dtype), self.spec.rms_norm_eps)
        return project("imd,de->ime", x_IMD, self.mm_projection[...]), valid_IM


def flops_per_image(spec: Gemma4VisionSpec) -> int:
    """Forward matmul FLOPs (2 per multiply-add) of one image at its full patch budget: the patch
    embedding, per layer q/k/v/o, the scores and the weighted sum over all Np×Np pairs and the GeGLU
    MLP; the pooling matmul and the embedder's projection."""
    T, D, F, H = spec.num_patches, spec.hidden_size, spec.intermediate_size, spec.head_dim
    N, K, M = spec.num_heads, spec.num_kv_heads, spec.max_soft_tokens
    attn = 2 * T * D * H * (2 * N + 2 * K) + 2 * 2 * T * T * N * H
    layer = attn + 2 * 3 * T * D * F
    return 2 * T * spec.patch_width * D + spec.depth * layer + 2 * T * M * D + projector_flops_per_image(spec)


def projector_flops_per_image(spec: Gemma4VisionSpec) -> int:
    """The part of `flops_per_image` in the embedder's projection (`vision_train=projector`)."""
    return 2 * spec.max_soft_tokens * spec.hidden_size * spec.text_hidden_size
