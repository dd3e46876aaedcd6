"""The Qwen3-VL / Qwen3.5 vision tower (Flax NNX), numerically HF's `Qwen3VLVisionModel` and
`Qwen3_5VisionModel`, and the host-side layout that gives it static shapes under jit.

The two towers are one structure: a patch embedding (HF's Conv3d, a matmul over pixel rows), a
learned square position table resampled bilinearly to each image's grid, pre-norm ViT blocks with
2D (h, w) rotary attention restricted to each image frame, and a merger that concatenates each
merge×merge block of patches into one token for the decoder. Qwen3-VL adds DeepStack: after the
blocks named in `deepstack_visual_indexes` a merger of its own (norm after the concatenation)
emits features the decoder adds to its first hidden states. Qwen3.5 has none.

Shape legend: B batch, N patches (S the same, as keys), C pixel row (in_channels·tp·p·p), D hidden,
F mlp, A heads, H head dim, M merged tokens (N / merge²), U merged width (merge²·D), O out dim,
K DeepStack mergers, P learned positions. Parameters carry logical axis names only
(`maxlite.mesh.RULES`); compute runs in `dtype`, softmax and rotary in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxlite.models.layers import LayerNorm, param
from maxlite.models.matmul import project

MODEL_TYPES = ("qwen3_vl_vision", "qwen3_5_vision")  # HF vision_config.model_type; only the first has DeepStack
ACTIVATIONS = {"gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
               "gelu": functools.partial(jax.nn.gelu, approximate=False)}
LAYOUT_KEYS = ("segment", "rope_hw", "pos_index", "pos_weight")


@dataclasses.dataclass(frozen=True)
class QwenVisionSpec:
    """One Qwen vision tower's shape. `layer_norm_eps` is HF's hard-coded 1e-6 (not in its config)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...] = ()
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    model_type: str = "qwen3_vl_vision"
    # the most patches one image frame has (the image processor's pixel budget / patch²; not in HF's
    # config): a row longer than that attends in bands of it (`banded_attention`); 0: dense over the row
    max_frame_patches: int = 0

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"vision model_type {self.model_type!r} is not one of {MODEL_TYPES}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not one of {tuple(ACTIVATIONS)}")
        if self.model_type == "qwen3_5_vision" and self.deepstack_visual_indexes:
            raise ValueError("a Qwen3.5 vision tower has no DeepStack: set deepstack_visual_indexes=()")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} must lie in [0, {self.depth})")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} must split into {self.num_heads} heads of a "
                             "multiple of 4 (2D rotary: h and w halves, each rotated in pairs)")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} must be a square")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """C: the width of one pixel row (HF's pixel_values), in_channels·tp·p·p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @classmethod
    def from_hf(cls, vision_config) -> "QwenVisionSpec":
        """From an HF vision_config (a `Qwen3VLVisionConfig` / `Qwen3_5VisionConfig` or its dict)."""
        c = vision_config if isinstance(vision_config, dict) else vision_config.to_dict()
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope['rope_type']!r}: only HF's 'axial' vision rotary is supported")
        model_type = c.get("model_type", "qwen3_vl_vision")
        return cls(depth=c["depth"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                   num_heads=c["num_heads"], patch_size=c["patch_size"], temporal_patch_size=c["temporal_patch_size"],
                   spatial_merge_size=c["spatial_merge_size"], in_channels=c["in_channels"],
                   out_hidden_size=c["out_hidden_size"], num_position_embeddings=c["num_position_embeddings"],
                   deepstack_visual_indexes=tuple(c.get("deepstack_visual_indexes") or ())
                   if model_type == "qwen3_vl_vision" else (),
                   hidden_act=c["hidden_act"], rope_theta=float(rope.get("rope_theta", 10000.0)),
                   model_type=model_type)

    def to_hf(self) -> dict:
        """The HF vision_config fields (Qwen3.5's config has no deepstack_visual_indexes)."""
        fields = dict(model_type=self.model_type, depth=self.depth, hidden_size=self.hidden_size,
                      intermediate_size=self.intermediate_size, num_heads=self.num_heads,
                      patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                      spatial_merge_size=self.spatial_merge_size, in_channels=self.in_channels,
                      out_hidden_size=self.out_hidden_size, num_position_embeddings=self.num_position_embeddings,
                      hidden_act=self.hidden_act,
                      rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})
        if self.model_type == "qwen3_vl_vision":
            fields["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        return fields


def _block_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch of an h×w frame in HF's order: merge×merge blocks row-major,
    patches row-major within a block (the order of pixel_values' rows and of the merged tokens)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()


def _bilinear_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The two taps into a `side`-long table and their weights at `index` of a `size`-long axis:
    bilinear, align_corners=True, border-clamped, in float32 (HF's _interpolation_axis_taps_weights)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    raw = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0)
    return np.clip(raw, 0, side - 1), weights.astype(np.float32)


def patch_layout(grids, spec: QwenVisionSpec, max_patches: int) -> dict[str, np.ndarray]:
    """The side inputs of one batch row holding images with `grids` [(t, h, w) in patches], padded
    to `max_patches`: `segment [N]` (1, 2, … one per image frame, as HF's cu_seqlens: a video's
    frames attend separately; 0 padding), `rope_hw [N, 2]` (each patch's row and column, HF's
    rotary position ids), `pos_index [N, 4]` and `pos_weight [N, 4]` (the bilinear resampling of the
    learned position table, HF's get_vision_interpolation_indices_and_weights; padding weighs 0)."""
    merge, unit = spec.spatial_merge_size, spec.merge_unit
    if max_patches % unit:
        raise ValueError(f"max_patches {max_patches} must be a multiple of spatial_merge_size² = {unit}")
    total = sum(t * h * w for t, h, w in grids)
    if total > max_patches:
        raise ValueError(f"{len(grids)} images hold {total} patches, more than max_patches={max_patches}: "
                         "raise it or put fewer images in this row")
    side = math.isqrt(spec.num_position_embeddings)
    out = {"segment": np.zeros(max_patches, np.int32), "rope_hw": np.zeros((max_patches, 2), np.int32),
           "pos_index": np.zeros((max_patches, 4), np.int32), "pos_weight": np.zeros((max_patches, 4), np.float32)}
    start, segment = 0, 0
    for t, h, w in grids:
        if h % merge or w % merge:
            raise ValueError(f"image grid {h}×{w} patches is not a multiple of spatial_merge_size {merge}")
        if spec.max_frame_patches and h * w > spec.max_frame_patches:  # its attention would be cut short
            raise ValueError(f"image grid {h}×{w} patches is more than the pixel budget's "
                             f"{spec.max_frame_patches} patches a frame (image_max_pixels)")
        rows, cols = _block_order(h, w, merge)
        h_taps, h_weights = _bilinear_taps(rows, h, side)
        w_taps, w_weights = _bilinear_taps(cols, w, side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        for _ in range(t):
            frame = slice(start, start + h * w)
            segment += 1
            out["segment"][frame] = segment
            out["rope_hw"][frame] = np.stack([rows, cols], axis=-1)
            out["pos_index"][frame], out["pos_weight"][frame] = index, weight
            start += h * w
    return out


def stack_layouts(layouts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Rows' layouts (each from patch_layout, same max_patches) as one batch [B, ...]."""
    return {k: np.stack([layout[k] for layout in layouts]) for k in LAYOUT_KEYS}


def flops_per_patch(spec: QwenVisionSpec, patches_per_frame: int) -> float:
    """Forward matmul FLOPs per patch of a frame of `patches_per_frame` patches (attention spans a
    frame): the patch embedding, the 4-tap blend of learned positions, per block q/k/v, the output
    projection, the MLP and the two attention products (q·k and p·v, over the frame), and the
    merger plus each DeepStack merger (computed once per merge² patches)."""
    D, F = spec.hidden_size, spec.intermediate_size
    block = 2 * D * 3 * D + 2 * D * D + 2 * 2 * D * F + 2 * 2 * patches_per_frame * D
    return 2 * spec.patch_dim * D + 2 * 4 * D + spec.depth * block + projector_flops_per_patch(spec)


def projector_flops_per_patch(spec: QwenVisionSpec) -> float:
    """The part of `flops_per_patch` in the merger and the DeepStack mergers (`vision_train=projector`)."""
    U, O = spec.merge_unit * spec.hidden_size, spec.out_hidden_size
    return (1 + len(spec.deepstack_visual_indexes)) * (2 * U * U + 2 * U * O) / spec.merge_unit


def _rotate(x_BNAH: jax.Array, angles_BNh: jax.Array) -> jax.Array:
    """HF's vision rotary: x·cos + rotate_half(x)·sin, the h/w angles [.., H/2] repeated over both
    halves of each head, in float32."""
    cos, sin = jnp.cos(angles_BNh)[:, :, None, :], jnp.sin(angles_BNh)[:, :, None, :]
    x = x_BNAH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BNAH.dtype)


def _within_segments(q_BNAH, k_BSAH, v_BSAH, qseg_BN, kseg_BS, dt):
    """Softmax attention of each query over the keys of its own segment (an image frame; padding's
    0 over padding), scores and softmax in float32."""
    scores_BANS = project("bnah,bsah->bans", q_BNAH, k_BSAH).astype(jnp.float32) * q_BNAH.shape[-1] ** -0.5
    scores_BANS = jnp.where((qseg_BN[:, :, None] == kseg_BS[:, None, :])[:, None], scores_BANS, -jnp.inf)
    probs_BANS = jax.nn.softmax(scores_BANS, axis=-1).astype(dt)
    return project("bans,bsah->bnah", probs_BANS, v_BSAH)


def banded_attention(q_BNAH, k_BNAH, v_BNAH, segment_BN, band: int, dt):
    """The same attention as `_within_segments` over the whole row, for rows whose segments are
    contiguous and at most `band` patches long (patch_layout's frames under the pixel budget): the
    row in chunks of `band` queries, each against the keys from one band before it to one band after
    (a frame that reaches a chunk lies there), one chunk at a time, each recomputed in the backward
    pass. Scores held: chunks × band × 3·band, not the row's N × N (8 frames of 4,096 patches a row:
    16 heads × 32,768² × 2 bytes = 32 GiB a layer in bfloat16 dense; 3/8 of that in all, 1/8·3/8 at
    a time, here). Padding's segment 0 attends within its band: its outputs are noise either way."""
    B, N = segment_BN.shape
    chunks = -(-N // band)
    tail = chunks * band - N

    def padded(x, before, after, value=0):
        return jnp.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
    # the row's tail and the bands' margins are segment −1: no patch's, each tail query its own key
    q_BcCAH = padded(q_BNAH, 0, tail).reshape(B, chunks, band, *q_BNAH.shape[2:])
    qseg_BcC = padded(segment_BN, 0, tail, -1).reshape(B, chunks, band)
    k_BWAH, v_BWAH = padded(k_BNAH, band, tail + band), padded(v_BNAH, band, tail + band)
    kseg_BW = padded(segment_BN, band, tail + band, -1)

    @jax.checkpoint
    def chunk(c):
        window = lambda x: jax.lax.dynamic_slice_in_dim(x, c * band, 3 * band, axis=1)  # noqa: E731
        return _within_segments(q_BcCAH[:, c], window(k_BWAH), window(v_BWAH), qseg_BcC[:, c], window(kseg_BW), dt)
    out_cBCAH = jax.lax.map(chunk, jnp.arange(chunks))
    return jnp.moveaxis(out_cBCAH, 0, 1).reshape(B, chunks * band, *q_BNAH.shape[2:])[:, :N]


class VisionBlock(nnx.Module):
    """x + attn(norm1(x)); x + mlp(norm2(x)): bidirectional attention within each image frame."""

    def __init__(self, spec: QwenVisionSpec, *, rngs: nnx.Rngs, dtype, weight_dtype):
        D, F, A, H = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.head_dim
        eps = spec.layer_norm_eps
        self.norm1 = LayerNorm(D, eps, dtype, weight_dtype, rngs=rngs)
        self.qkv = param(rngs, (D, 3, A, H), ("embed", None, "heads", "head_dim"), weight_dtype)
        self.qkv_bias = param(rngs, (3, A, H), (None, "heads", "head_dim"), weight_dtype, init="zeros")
        self.o = param(rngs, (A, H, D), ("heads", "head_dim", "embed"), weight_dtype)
        self.o_bias = param(rngs, (D,), ("norm",), weight_dtype, init="zeros")
        self.norm2 = LayerNorm(D, eps, dtype, weight_dtype, rngs=rngs)
        self.fc1 = param(rngs, (D, F), ("embed", "mlp"), weight_dtype)
        self.fc1_bias = param(rngs, (F,), ("mlp",), weight_dtype, init="zeros")
        self.fc2 = param(rngs, (F, D), ("mlp", "embed"), weight_dtype)
        self.fc2_bias = param(rngs, (D,), ("norm",), weight_dtype, init="zeros")
        self.act = ACTIVATIONS[spec.hidden_act]
        self.dtype = dtype

    def attend(self, x_BND, angles_BNh, segment_BN, band: int = 0):
        dt = self.dtype
        qkv_BN3AH = project("bnd,dcah->bncah", x_BND, self.qkv[...]) + self.qkv_bias[...].astype(dt)
        q_BNAH, k_BSAH, v_BSAH = (qkv_BN3AH[:, :, i] for i in range(3))
        q_BNAH, k_BSAH = _rotate(q_BNAH, angles_BNh), _rotate(k_BSAH, angles_BNh)
        if 0 < band < x_BND.shape[1]:
            out_BNAH = banded_attention(q_BNAH, k_BSAH, v_BSAH, segment_BN, band, dt)
        else:
            out_BNAH = _within_segments(q_BNAH, k_BSAH, v_BSAH, segment_BN, segment_BN, dt)
        return project("bnah,ahd->bnd", out_BNAH, self.o[...]) + self.o_bias[...].astype(dt)

    def __call__(self, x_BND, angles_BNh, segment_BN, band: int = 0):
        dt = self.dtype
        x_BND = x_BND + self.attend(self.norm1(x_BND), angles_BNh, segment_BN, band)
        h_BNF = self.act(project("bnd,df->bnf", self.norm2(x_BND), self.fc1[...]) + self.fc1_bias[...].astype(dt))
        return x_BND + project("bnf,fd->bnd", h_BNF, self.fc2[...]) + self.fc2_bias[...].astype(dt)


class PatchMerger(nnx.Module):
    """Each merge×merge block of patches → one token of the decoder's width: norm, concatenate,
    fc1, exact GELU, fc2. A DeepStack merger (`postshuffle`) norms after concatenating."""

    def __init__(self, spec: QwenVisionSpec, *, rngs: nnx.Rngs, dtype, weight_dtype, postshuffle: bool):
        D, U, O = spec.hidden_size, spec.merge_unit * spec.hidden_size, spec.out_hidden_size
        self.norm = LayerNorm(U if postshuffle else D, spec.layer_norm_eps, dtype, weight_dtype, rngs=rngs)
        self.fc1 = param(rngs, (U, U), ("embed", "mlp"), weight_dtype)
        self.fc1_bias = param(rngs, (U,), ("mlp",), weight_dtype, init="zeros")
        self.fc2 = param(rngs, (U, O), ("mlp", "embed"), weight_dtype)
        self.fc2_bias = param(rngs, (O,), ("norm",), weight_dtype, init="zeros")
        self.postshuffle, self.unit, self.dtype = postshuffle, spec.merge_unit, dtype

    def __call__(self, x_BND):
        B, N, D = x_BND.shape
        merged = lambda x: x.reshape(B, N // self.unit, self.unit * D)  # noqa: E731  (consecutive patches: one block)
        x_BMU = self.norm(merged(x_BND)) if self.postshuffle else merged(self.norm(x_BND))
        h_BMU = jax.nn.gelu(project("bmu,uv->bmv", x_BMU, self.fc1[...]) + self.fc1_bias[...].astype(self.dtype),
                            approximate=False)
        return project("bmu,uo->bmo", h_BMU, self.fc2[...]) + self.fc2_bias[...].astype(self.dtype)


class QwenVisionTower(nnx.Module):
    """pixels [B, N, C] (HF's pixel_values rows, several images per row, padded) and their layout
    (patch_layout, stacked) → (tokens [B, M, O], DeepStack features [K, B, M, O]). An image whose
    patches start at row n has its t·h·w / merge² tokens from n / merge² on; padding's are noise."""

    def __init__(self, spec: QwenVisionSpec, *, rngs: nnx.Rngs, dtype=jnp.float32, weight_dtype=jnp.float32):
        D = spec.hidden_size
        self.patch = param(rngs, (spec.patch_dim, D), (None, "embed"), weight_dtype)
        self.patch_bias = param(rngs, (D,), ("norm",), weight_dtype, init="zeros")
        self.pos_table = param(rngs, (spec.num_position_embeddings, D), ("position", "embed"), weight_dtype)
        # An unrolled list, not a scan: DeepStack reads the hidden state after chosen blocks.
        self.blocks = nnx.List([VisionBlock(spec, rngs=rngs, dtype=dtype, weight_dtype=weight_dtype)
                                for _ in range(spec.depth)])
        self.merger = PatchMerger(spec, rngs=rngs, dtype=dtype, weight_dtype=weight_dtype, postshuffle=False)
        self.deepstack = nnx.List([PatchMerger(spec, rngs=rngs, dtype=dtype, weight_dtype=weight_dtype, postshuffle=True)
                                   for _ in spec.deepstack_visual_indexes])
        self.spec, self.dtype = spec, dtype

    def rotary_angles(self, rope_hw_BN2):
        """[B, N, H/2]: row·inv_freq then column·inv_freq, inv_freq over H/4 pairs (HF's axial rotary)."""
        half = self.spec.head_dim // 2
        inv_freq = 1.0 / (self.spec.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))
        angles_BN2f = rope_hw_BN2[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
        return angles_BN2f.reshape(*rope_hw_BN2.shape[:2], half)

    def __call__(self, pixels_BNC, layout):
        dt = self.dtype
        x_BND = project("bnc,cd->bnd", pixels_BNC.astype(dt), self.patch[...]) + self.patch_bias[...].astype(dt)
        pos_BN4D = self.pos_table[...][layout["pos_index"]]  # in the table's dtype, as HF sums it
        pos_BND = jnp.einsum("bnkd,bnk->bnd", pos_BN4D, layout["pos_weight"].astype(pos_BN4D.dtype))
        x_BND = x_BND + pos_BND.astype(dt)
        angles_BNh = self.rotary_angles(layout["rope_hw"])
        segment_BN = layout["segment"]  # padding (0) attends only padding
        deepstack = []
        for i, block in enumerate(self.blocks):
            x_BND = block(x_BND, angles_BNh, segment_BN, self.spec.max_frame_patches)
            if i in self.spec.deepstack_visual_indexes:
                deepstack.append(self.deepstack[self.spec.deepstack_visual_indexes.index(i)](x_BND))
        tokens_BMO = self.merger(x_BND)
        B, M, O = tokens_BMO.shape
        deepstack_KBMO = jnp.stack(deepstack) if deepstack else jnp.zeros((0, B, M, O), dt)
        return tokens_BMO, deepstack_KBMO
