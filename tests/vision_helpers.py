"""What the vision tests share (not a test module): random images, the small Qwen image processor of
tests/hf_models.py's towers (patch 8, 2 × 2 merge) and maxlite's logits of a prompt with its images."""

from __future__ import annotations

import numpy as np
from PIL import Image

# the small Qwen towers' pixel budget (tests/hf_models.py: patch 8, merge 2)
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 32 * 32, 96 * 96


def random_image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def qwen_processor():
    """transformers' own image processor for the small Qwen towers (what their images are checked against)."""
    import transformers

    return transformers.Qwen2VLImageProcessorPil(
        patch_size=8, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS})


def logits_with_images(cfg, pure, ids, positions, arrays):
    """maxlite's float32 logits [T, V] of one prompt `ids` at `positions` ([T], or [T, 3] with multimodal
    RoPE) with its image arrays (`arrays`: the encoder kind's, one prompt's; empty: text only)."""
    from flax import nnx

    from maxlite.state import abstract_params

    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    T = len(ids)
    images = {k: v[None] for k, v in arrays.items()} or None
    run = nnx.jit(lambda m, i, p, s, im: m(i, p, s, images=im))
    return np.asarray(run(model, np.asarray(ids)[None], np.asarray(positions)[None], np.ones((1, T), np.int32),
                          images))[0]
