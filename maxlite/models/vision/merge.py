"""Images into the decoder: the encoder's tokens take the places of the image placeholders, and
DeepStack's features (Qwen3-VL) are added to the first layers' outputs at those places.

A row's image tokens come in the order of its placeholders: the k-th placeholder token
(`image_token_id`) of a row takes the k-th token the encoder made for that row (its images in
order, each image's tokens in the encoder's order). Placeholders and image tokens are counted to
match when the data is built (maxlite/data/images.py); here a placeholder past the encoder's tokens
would read a padding token, so the count is the data's contract.

Shape legend as in layers.py, plus M image tokens per row, K DeepStack layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxlite.models.layers import BTD, constrain
from maxlite.models.vision import towers


def placeholder_index(inputs_BT, image_token_id: int):
    """(mask_BT: the placeholders, index_BT: which of the row's image tokens each one takes)."""
    mask_BT = inputs_BT == image_token_id
    index_BT = jnp.maximum(jnp.cumsum(mask_BT, axis=1) - 1, 0)
    return mask_BT, index_BT


def scatter(tokens_BMD, mask_BT, index_BT, x_BTD):
    """x_BTD with each placeholder's row replaced by its image token."""
    picked_BTD = jnp.take_along_axis(tokens_BMD, index_BT[..., None], axis=1).astype(x_BTD.dtype)
    return jnp.where(mask_BT[..., None], picked_BTD, x_BTD)


def merge(model, inputs_BT, x_BTD, images: dict):
    """(x_BTD with the images' tokens in place, what the layers' sides read: {"deepstack": [K, B, T, D]}
    where the encoder has DeepStack layers)."""
    tokens_BMD, deep_KBMD = towers.encode(model.vision, model.cfg, images)
    mask_BT, index_BT = placeholder_index(inputs_BT, model.cfg.image_token_id)
    x_BTD = constrain(scatter(tokens_BMD, mask_BT, index_BT, x_BTD), BTD)
    if deep_KBMD is None:
        return x_BTD, {}
    zeros_BTD = jnp.zeros_like(x_BTD)
    deep_KBTD = jax.vmap(lambda t_BMD: scatter(t_BMD, mask_BT, index_BT, zeros_BTD))(deep_KBMD)
    return x_BTD, {"deepstack": deep_KBTD}


def deepstack_inputs(model, inputs_BT, x_BTD, seen: dict):
    """The "deepstack" side's per-layer inputs [L, B, T, D]: layer k < K adds the k-th DeepStack
    features at the image tokens, the later layers zeros; none without images (text only, or a
    decoding step)."""
    deep_KBTD = seen.get("deepstack")
    if deep_KBTD is None:
        return None
    L, K = model.cfg.base_num_decoder_layers, deep_KBTD.shape[0]
    return jnp.concatenate([deep_KBTD, jnp.zeros((L - K, *deep_KBTD.shape[1:]), deep_KBTD.dtype)])


def deepstack_finish(part, x_BTD, carry):
    """The "deepstack" side's step after the feed-forward: + this layer's features, if any."""
    deep_BTD = carry.inputs.get("deepstack")
    return x_BTD if deep_BTD is None else x_BTD + deep_BTD.astype(x_BTD.dtype)


def image_blocks(inputs_BT, image_token_id: int):
    """Each token's image block [B, T]: every run of placeholders is one block (numbered 0, 1, ... in
    the row), −1 outside; transformers' get_block_sequence_ids_for_mask of token_type_ids."""
    is_image_BT = inputs_BT == image_token_id
    before_BT = jnp.pad(is_image_BT[:, :-1], ((0, 0), (1, 0)))
    block_BT = jnp.cumsum(is_image_BT & ~before_BT, axis=1) - 1
    return jnp.where(is_image_BT, block_BT, -1).astype(jnp.int32)


def image_block_inputs(model, inputs_BT, x_BTD, seen: dict):
    """The "image_blocks" side's per-layer inputs [L, B, T]: the same blocks for every layer, from the
    token ids alone (a batch needs no array of its own for them)."""
    block_BT = image_blocks(inputs_BT, model.cfg.image_token_id)
    return jnp.broadcast_to(block_BT, (model.cfg.base_num_decoder_layers, *block_BT.shape))
