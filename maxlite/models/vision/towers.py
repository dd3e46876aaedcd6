"""The vision encoder kinds (`vision_encoder`): each builds its tower from the recipe's vision keys
and encodes a batch's image arrays into decoder tokens.

    qwen_vit  Qwen3-VL / Qwen3.5 (qwen_vit.py): a row's images as patches at their own resolution,
              padded to `max_image_patches`; → [B, M, D] tokens (M = patches / merge²) and DeepStack's
              [K, B, M, D]
    siglip    Gemma 3 (siglip.py): a row's images, each resized to vision_image_size, padded to
              `max_images`; → [B, images · vision_tokens_per_image, D]
    gemma4_vit  Gemma 4 (gemma4_vit.py): a row's images as patches at their own aspect ratio, each
              padded to vision_tokens_per_image · pool² patches, padded to `max_images`; → [B, M, D]:
              each image's real soft tokens in order, then padding

The image arrays a batch holds (the keys maxlite/data/images.py writes, all beside the token rows):
qwen_vit: image_pixels [B, Np, C·tp·p·p], image_segment [B, Np], image_rope_hw [B, Np, 2],
image_pos_index / image_pos_weight [B, Np, 4]; siglip: image_pixels [B, I, C, S, S]; gemma4_vit:
image_pixels [B, I, Np, C·p·p], image_positions [B, I, Np, 2] (a patch's column and row; −1: padding).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

IMAGE_KEYS = {"qwen_vit": ("image_pixels", "image_segment", "image_rope_hw", "image_pos_index", "image_pos_weight"),
              "siglip": ("image_pixels",), "gemma4_vit": ("image_pixels", "image_positions")}


def qwen_spec(cfg):
    from maxlite.models.vision.qwen_vit import QwenVisionSpec

    return QwenVisionSpec(
        depth=cfg.vision_num_layers, hidden_size=cfg.vision_emb_dim, intermediate_size=cfg.vision_mlp_dim,
        num_heads=cfg.vision_num_heads, patch_size=cfg.vision_patch_size,
        temporal_patch_size=cfg.vision_temporal_patch_size, spatial_merge_size=cfg.vision_merge_size,
        in_channels=3, out_hidden_size=cfg.base_emb_dim, num_position_embeddings=cfg.vision_num_positions,
        deepstack_visual_indexes=tuple(cfg.vision_deepstack_layers), hidden_act=cfg.vision_act,
        layer_norm_eps=cfg.vision_norm_epsilon,
        # the image processor resizes every image under image_max_pixels: no frame has more patches
        max_frame_patches=cfg.image_max_pixels // cfg.vision_patch_size ** 2)


def siglip_spec(cfg):
    from maxlite.models.vision.siglip import SiglipSpec

    return SiglipSpec(
        hidden_size=cfg.vision_emb_dim, intermediate_size=cfg.vision_mlp_dim, depth=cfg.vision_num_layers,
        num_heads=cfg.vision_num_heads, patch_size=cfg.vision_patch_size, image_size=cfg.vision_image_size,
        num_channels=3, layer_norm_eps=cfg.vision_norm_epsilon, hidden_act=cfg.vision_act,
        mm_tokens_per_image=cfg.vision_tokens_per_image, text_hidden_size=cfg.base_emb_dim)


def gemma4_spec(cfg):
    from maxlite.models.vision.gemma4_vit import Gemma4VisionSpec

    return Gemma4VisionSpec(
        hidden_size=cfg.vision_emb_dim, intermediate_size=cfg.vision_mlp_dim, depth=cfg.vision_num_layers,
        num_heads=cfg.vision_num_heads, num_kv_heads=cfg.vision_num_kv_heads or cfg.vision_num_heads,
        head_dim=cfg.vision_head_dim or cfg.vision_emb_dim // cfg.vision_num_heads, patch_size=cfg.vision_patch_size,
        pool=cfg.vision_pool_size, max_soft_tokens=cfg.vision_tokens_per_image,
        position_table=cfg.vision_num_positions, text_hidden_size=cfg.base_emb_dim, rope_theta=cfg.vision_rope_theta,
        rms_norm_eps=cfg.vision_norm_epsilon, hidden_act=cfg.vision_act, standardize=cfg.vision_standardize,
        clipped=cfg.vision_clipped)


# the parts that map the encoder's features to the decoder's width (vision_train=projector trains them)
PROJECTORS = {"qwen_vit": ("merger", "deepstack"), "siglip": ("mm_norm", "mm_projection"),
              "gemma4_vit": ("mm_projection",)}


def build(cfg, rngs):
    """The recipe's vision tower (the model stores it as `vision`), its parameters that do not train
    (vision_train) tagged `frozen` (maxlite.state.split_trainable leaves them out of the optimizer)."""
    dtype, wd = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    if cfg.vision_encoder == "qwen_vit":
        from maxlite.models.vision.qwen_vit import QwenVisionTower

        tower = QwenVisionTower(qwen_spec(cfg), rngs=rngs, dtype=dtype, weight_dtype=wd)
    elif cfg.vision_encoder == "gemma4_vit":
        from maxlite.models.vision.gemma4_vit import Gemma4VisionTower

        tower = Gemma4VisionTower(gemma4_spec(cfg), rngs=rngs, dtype=dtype, weight_dtype=wd)
    else:
        from maxlite.models.vision.siglip import SiglipTower

        tower = SiglipTower(siglip_spec(cfg), rngs=rngs, dtype=dtype, weight_dtype=wd)
    if cfg.vision_train != "all":
        keep = PROJECTORS[cfg.vision_encoder] if cfg.vision_train == "projector" else ()
        for path, variable in nnx.iter_graph(tower):
            if isinstance(variable, nnx.Param) and not any(part in keep for part in path):
                variable.set_metadata(frozen=True)
    return tower


def encode(tower, cfg, images: dict):
    """(tokens [B, M, D], DeepStack's [K, B, M, D] or None) of a batch's image arrays."""
    if cfg.vision_encoder == "qwen_vit":
        layout = {k[len("image_"):]: images[k] for k in IMAGE_KEYS["qwen_vit"][1:]}
        tokens_BMD, deep_KBMD = tower(images["image_pixels"], layout)
        return tokens_BMD, (deep_KBMD if cfg.vision_deepstack_layers else None)
    pixels = images["image_pixels"]
    B, I = pixels.shape[:2]
    if cfg.vision_encoder == "gemma4_vit":
        positions = images["image_positions"]
        tokens, valid = tower(pixels.reshape(B * I, *pixels.shape[2:]), positions.reshape(B * I, *positions.shape[2:]))
        return real_first(tokens.reshape(B, -1, tokens.shape[-1]), valid.reshape(B, -1)), None
    tokens = tower(pixels.reshape(B * I, *pixels.shape[2:]))
    return tokens.reshape(B, I * tokens.shape[1], tokens.shape[2]), None


def real_first(tokens_BMD, valid_BM):
    """Each row's real tokens moved to its front, in order (a stable sort: the images' slots hold
    their real tokens first, then padding), so the row's k-th placeholder takes its k-th real token."""
    order_BM = jnp.argsort(~valid_BM, axis=1, stable=True)
    return jnp.take_along_axis(tokens_BMD, order_BM[..., None], axis=1)


def train_flops(cfg, rows: int) -> float:
    """The tower's training FLOPs over `rows` packed rows' image budgets (every row full), as
    `vision_train` trains it: frozen, its forward only (nothing upstream of its output needs a
    gradient); projector, the forward and the projector's two backward matmuls; all, 3 × the forward.
    qwen_vit: `max_image_patches` per row, attention counted within images of the pixel budget's
    largest size (`image_max_pixels`; the tower attends within an image); siglip: `max_images_per_row`
    images of vision_image_size; gemma4_vit: `max_images_per_row` images at their full patch budget."""
    if not cfg.vision_encoder:
        return 0.0
    if cfg.vision_encoder == "qwen_vit":
        from maxlite.models.vision.qwen_vit import flops_per_patch, projector_flops_per_patch

        spec = qwen_spec(cfg)
        frame = min(cfg.max_image_patches, spec.max_frame_patches)
        units = rows * cfg.max_image_patches
        forward, projector = flops_per_patch(spec, frame), projector_flops_per_patch(spec)
    elif cfg.vision_encoder == "gemma4_vit":
        from maxlite.models.vision.gemma4_vit import flops_per_image, projector_flops_per_image

        spec = gemma4_spec(cfg)
        units = rows * cfg.max_images_per_row
        forward, projector = flops_per_image(spec), projector_flops_per_image(spec)
    else:
        from maxlite.models.vision.siglip import flops_per_image, projector_flops_per_image

        spec = siglip_spec(cfg)
        units = rows * cfg.max_images_per_row
        forward, projector = flops_per_image(spec), projector_flops_per_image(spec)
    per_unit = {"frozen": forward, "projector": forward + 2 * projector, "all": 3 * forward}[cfg.vision_train]
    return float(units * per_unit)


def batch_images(cfg, batch: dict) -> dict | None:
    """The image arrays of a batch (None for a text-only model)."""
    if not cfg.vision_encoder:
        return None
    return {k: batch[k] for k in IMAGE_KEYS[cfg.vision_encoder] if k in batch} or None
