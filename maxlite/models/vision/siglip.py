"""Gemma 3's image encoder: a SigLIP vision transformer and the multimodal projector that turns
its patch states into the decoder's soft tokens (HF's SiglipVisionModel + Gemma3MultiModalProjector).

pixels [I, C, H, W] → patches (a matmul over each flattened P×P patch, HF's stride-P conv) + learned
positions → `depth` pre-norm layers (bidirectional attention, tanh-GELU MLP, LayerNorms with biases)
→ post LayerNorm → average pool to mm_tokens_per_image → Gemma RMSNorm (1 + w) → projection to the
text model's hidden size.

Shape legend: I images, C channels, T patches per image, D vision width, N heads, H head dim,
F mlp dim, M soft tokens per image, E text hidden size, L layers. Compute runs in `dtype`,
softmax and norms in float32; parameters are stored in `weight_dtype` (layers.py's convention).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models.layers import LayerNorm, RMSNorm, param
from maxlite.models.matmul import project
from maxlite.models.vision.stack import layer_stack, run_stack

# HF's hidden_act → the activation (SigLIP checkpoints use the tanh approximation)
ACTIVATIONS = {"gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
               "gelu": functools.partial(jax.nn.gelu, approximate=False)}


@dataclasses.dataclass(frozen=True)
class SiglipSpec:
    """The encoder's and projector's shapes. The projector's RMSNorm takes layer_norm_eps, as HF's
    does (Gemma3MultiModalProjector reads vision_config.layer_norm_eps): one fact, one field."""
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    image_size: int
    mm_tokens_per_image: int
    text_hidden_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side divides "
                             f"the {self.patches_per_side} patches per side")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def pool(self) -> int:
        """The average pool's kernel (and stride) in patches per side."""
        return self.patches_per_side // math.isqrt(self.mm_tokens_per_image)

    @classmethod
    def from_hf(cls, config) -> SiglipSpec:
        """From a Gemma3Config (or its config.json dict)."""
        hf = config if isinstance(config, dict) else config.to_dict()
        vision, text = hf["vision_config"], hf["text_config"]
        return cls(hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                   depth=vision["num_hidden_layers"], num_heads=vision["num_attention_heads"],
                   patch_size=vision["patch_size"], image_size=vision["image_size"],
                   mm_tokens_per_image=hf["mm_tokens_per_image"], text_hidden_size=text["hidden_size"],
                   num_channels=vision.get("num_channels", 3), layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
                   hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"))

    def to_hf(self) -> dict:
        """The Gemma3Config keys this spec determines (vision_config whole, the text model's width);
        no pooling head: Gemma 3 reads the patch states, never SigLIP's pooled output."""
        vision = {"model_type": "siglip_vision_model", "hidden_size": self.hidden_size,
                  "intermediate_size": self.intermediate_size, "num_hidden_layers": self.depth,
                  "num_attention_heads": self.num_heads, "patch_size": self.patch_size,
                  "image_size": self.image_size, "num_channels": self.num_channels,
                  "layer_norm_eps": self.layer_norm_eps, "hidden_act": self.hidden_act, "vision_use_head": False}
        return {"vision_config": vision, "mm_tokens_per_image": self.mm_tokens_per_image,
                "text_config": {"hidden_size": self.text_hidden_size}}


class EncoderLayer(nnx.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x)): bidirectional multi-head attention and a GELU MLP,
    every projection with a bias."""

    def __init__(self, spec: SiglipSpec, *, rngs: nnx.Rngs, dtype, weight_dtype):
        D, N, H, F, eps = spec.hidden_size, spec.num_heads, spec.head_dim, spec.intermediate_size, spec.layer_norm_eps
        wd = weight_dtype
        self.ln1 = LayerNorm(D, eps, dtype, wd, rngs=rngs)
        self.q = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), wd)
        self.k = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), wd)
        self.v = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), wd)
        self.o = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), wd)
        self.q_bias = param(rngs, (N, H), ("heads", "head_dim"), wd, init="zeros")
        self.k_bias = param(rngs, (N, H), ("heads", "head_dim"), wd, init="zeros")
        self.v_bias = param(rngs, (N, H), ("heads", "head_dim"), wd, init="zeros")
        self.o_bias = param(rngs, (D,), ("norm",), wd, init="zeros")
        self.ln2 = LayerNorm(D, eps, dtype, wd, rngs=rngs)
        self.up = param(rngs, (D, F), ("embed", "mlp"), wd)
        self.up_bias = param(rngs, (F,), ("mlp",), wd, init="zeros")
        self.down = param(rngs, (F, D), ("mlp", "embed"), wd)
        self.down_bias = param(rngs, (D,), ("norm",), wd, init="zeros")
        self.dtype, self.act = dtype, ACTIVATIONS[spec.hidden_act]

    def _bias(self, name: str):
        return getattr(self, name)[...].astype(self.dtype)

    def attention(self, x_ITD: jax.Array) -> jax.Array:
        q_ITNH = project("itd,dnh->itnh", x_ITD, self.q[...]) + self._bias("q_bias")
        k_ISNH = project("isd,dnh->isnh", x_ITD, self.k[...]) + self._bias("k_bias")
        v_ISNH = project("isd,dnh->isnh", x_ITD, self.v[...]) + self._bias("v_bias")
        scores_INTS = project("itnh,isnh->ints", q_ITNH, k_ISNH).astype(jnp.float32)
        probs_INTS = jax.nn.softmax(scores_INTS / math.sqrt(q_ITNH.shape[-1]), axis=-1).astype(self.dtype)
        out_ITNH = project("ints,isnh->itnh", probs_INTS, v_ISNH)
        return project("itnh,nhd->itd", out_ITNH, self.o[...]) + self._bias("o_bias")

    def mlp(self, x_ITD: jax.Array) -> jax.Array:
        h_ITF = self.act(project("itd,df->itf", x_ITD, self.up[...]) + self._bias("up_bias"))
        return project("itf,fd->itd", h_ITF, self.down[...]) + self._bias("down_bias")

    def __call__(self, x_ITD: jax.Array) -> jax.Array:
        x_ITD = x_ITD + self.attention(self.ln1(x_ITD))
        return x_ITD + self.mlp(self.ln2(x_ITD))


class SiglipTower(nnx.Module):
    """pixels_ICHW (the image processor's normalized pixels, image_size square) → soft tokens
    [I, mm_tokens_per_image, text_hidden_size] in `dtype`."""

    def __init__(self, spec: SiglipSpec, *, rngs: nnx.Rngs, dtype=jnp.float32, weight_dtype=jnp.float32):
        D, T, E = spec.hidden_size, spec.num_patches, spec.text_hidden_size
        dtype, wd = jnp.dtype(dtype), jnp.dtype(weight_dtype)
        # a patch's C·P·P pixels in (channel, row, column) order: HF's conv kernel flattened
        self.patch = param(rngs, (spec.num_channels * spec.patch_size ** 2, D), (None, "embed"), wd)
        self.patch_bias = param(rngs, (D,), ("norm",), wd, init="zeros")
        self.positions = param(rngs, (T, D), ("position", "embed"), wd)

        self.layers = layer_stack(spec.depth, lambda r: EncoderLayer(spec, rngs=r, dtype=dtype, weight_dtype=wd),
                                  rngs)
        self.post_norm = LayerNorm(D, spec.layer_norm_eps, dtype, wd, rngs=rngs)
        self.mm_norm = RMSNorm(D, spec.layer_norm_eps, dtype, wd, rngs=rngs, offset=1.0)
        # the decoder's embed dim, split like its embeddings; the vision width stays whole
        self.mm_projection = param(rngs, (D, E), (None, "embed"), wd)
        self.spec, self.dtype = spec, dtype

    def patches(self, pixels_ICHW: jax.Array) -> jax.Array:
        """[I, C, H, W] → [I, T, C·P·P]: patches in row-major order over the grid (HF's conv output
        flattened), each patch's pixels in the kernel's (C, P, P) order."""
        I, C, Hpx, Wpx = pixels_ICHW.shape
        P, g = self.spec.patch_size, self.spec.patches_per_side
        if (Hpx, Wpx) != (self.spec.image_size,) * 2 or C != self.spec.num_channels:
            raise ValueError(f"pixels of shape {pixels_ICHW.shape}: the tower takes [images, {self.spec.num_channels}, "
                             f"{self.spec.image_size}, {self.spec.image_size}] (resize with the image processor)")
        x = pixels_ICHW.astype(self.dtype).reshape(I, C, g, P, g, P).transpose(0, 2, 4, 1, 3, 5)
        return x.reshape(I, g * g, C * P * P)

    def encode(self, pixels_ICHW: jax.Array) -> jax.Array:
        """The vision model's last hidden states [I, T, D] (after the post LayerNorm)."""
        x_ITD = project("itp,pd->itd", self.patches(pixels_ICHW), self.patch[...])
        x_ITD = x_ITD + self.patch_bias[...].astype(self.dtype) + self.positions[...].astype(self.dtype)
        return self.post_norm(run_stack(self.layers, x_ITD))

    def project_tokens(self, x_ITD: jax.Array) -> jax.Array:
        """Gemma 3's projector: average pool of each pool×pool block of patches (in float32), the
        Gemma RMSNorm, the projection: [I, T, D] → [I, M, E]."""
        I, _, D = x_ITD.shape
        k, m = self.spec.pool, self.spec.patches_per_side // self.spec.pool
        x = x_ITD.astype(jnp.float32).reshape(I, m, k, m, k, D).mean(axis=(2, 4))
        x_IMD = self.mm_norm(x.reshape(I, m * m, D).astype(self.dtype))
        return project("imd,de->ime", x_IMD, self.mm_projection[...])

    def __call__(self, pixels_ICHW: jax.Array) -> jax.Array:
        return self.project_tokens(self.encode(pixels_ICHW))


def flops_per_image(spec: SiglipSpec) -> int:
    """Forward matmul FLOPs (2 per multiply-add) of one image: patch embedding, per layer the four
    attention projections, the scores and the weighted sum over all T×T pairs, the MLP; the
    projector's matmul. Pooling and norms are not matmuls."""
    T, D, F, M, E = spec.num_patches, spec.hidden_size, spec.intermediate_size, spec.mm_tokens_per_image, \
        spec.text_hidden_size
    patch = 2 * T * spec.num_channels * spec.patch_size ** 2 * D
    layer = 2 * T * D * D * 4 + 2 * 2 * T * T * D + 2 * 2 * T * D * F
    return patch + spec.depth * layer + projector_flops_per_image(spec)


def projector_flops_per_image(spec: SiglipSpec) -> int:
    """The part of `flops_per_image` in the projector (`vision_train=projector`)."""
    return 2 * spec.mm_tokens_per_image * spec.hidden_size * spec.text_hidden_size
