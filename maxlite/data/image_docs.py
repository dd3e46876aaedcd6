"""Images in token rows: a prompt's (or a conversation's) image placeholders expanded to the encoder's
tokens, its multimodal positions, and the image arrays a batch row carries beside its tokens — one
rule for SFT data (data/vision_sft.py) and for `generate --image`.

A chat template writes ONE placeholder token per image (Qwen's `<|image_pad|>` between
`<|vision_start|>` and `<|vision_end|>`); here each becomes as many as the encoder makes for that image
(qwen_vit: the image's patches / merge², set by its size within the pixel budget), never counted by
hand. A document whose placeholders and images differ in number is refused, naming the record.

The image arrays of one document (the qwen_vit kind's, maxlite/models/vision/towers.py): its images'
patch rows [Np, C·tp·p·p] (Np: all its patches), and per patch its image's number within the document
(1, 2, ...), the 2-D RoPE position, and the learned-position interpolation's indices and weights.
Packed rows concatenate documents' patches like their tokens (grain's packing, every patch array
its own length `max_image_patches`); `relabel` numbers the images of a row apart.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from maxlite.config import ConfigError

PATCH_KEYS = ("image_pixels", "image_segment", "image_rope_hw", "image_pos_index", "image_pos_weight")


def image_refs(messages: Sequence[dict]) -> list[Any]:
    """The images of a conversation, in order (content items {"type": "image", "image": ref})."""
    return [item.get("image") for m in messages if isinstance(m.get("content"), list)
            for item in m["content"] if item.get("type") == "image"]


def expand(ids: np.ndarray, mask: np.ndarray, counts: Sequence[int], token_id: int, where: str):
    """(ids, mask) with the k-th placeholder repeated counts[k] times (never supervised)."""
    at = np.flatnonzero(ids == token_id)
    if len(at) != len(counts):
        raise ConfigError(f"{where}: {len(counts)} image(s) but {len(at)} image placeholder(s) in the rendered "
                          f"text: each image needs its own placeholder (the chat template writes one per image item)")
    reps = np.ones(len(ids), np.int64)
    reps[at] = counts
    return np.repeat(ids, reps), np.repeat(mask, reps) & (np.repeat(ids, reps) != token_id)


class QwenImages:
    """The qwen_vit kind's side of a document: pixels and their layout, token counts, positions."""

    def __init__(self, cfg):
        from maxlite.models.vision.towers import qwen_spec

        self.cfg, self.spec = cfg, qwen_spec(cfg)

    def encode(self, images: Sequence[Any]) -> tuple[list[tuple[int, int, int]], dict[str, np.ndarray]]:
        """(each image's patch grid (t, h, w), the document's patch arrays: PATCH_KEYS) of PIL images."""
        from maxlite.data.images import qwen_patches
        from maxlite.models.vision.qwen_vit import patch_layout

        cfg, rows, grids = self.cfg, [], []
        for image in images:
            pixels, grid = qwen_patches(image, patch_size=cfg.vision_patch_size,
                                        temporal_patch_size=cfg.vision_temporal_patch_size,
                                        merge_size=cfg.vision_merge_size, min_pixels=cfg.image_min_pixels,
                                        max_pixels=cfg.image_max_pixels, mean=cfg.image_mean, std=cfg.image_std)
            rows.append(pixels)
            grids.append(tuple(int(g) for g in grid))
        n = sum(len(r) for r in rows)
        width = cfg.vision_temporal_patch_size * cfg.vision_patch_size ** 2 * 3
        layout = patch_layout(grids, self.spec, n) if n else _empty_layout()
        out = {"image_pixels": np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, width), np.float32)}
        out.update({f"image_{k}": np.asarray(v) for k, v in layout.items()})
        return grids, out

    def tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.cfg.vision_merge_size ** 2

    def positions(self, ids: np.ndarray, grids) -> np.ndarray:
        from maxlite.models.vision.positions import mrope_positions

        return mrope_positions(ids, grids, self.cfg.vision_merge_size, self.cfg.image_token_id)


def _empty_layout() -> dict[str, np.ndarray]:
    return {"segment": np.zeros(0, np.int32), "rope_hw": np.zeros((0, 2), np.int32),
            "pos_index": np.zeros((0, 4), np.int32), "pos_weight": np.zeros((0, 4), np.float32)}


def relabel(doc_segment: np.ndarray, image_segment: np.ndarray) -> np.ndarray:
    """A packed row's image numbers, unique across its documents (0: padding): documents number
    their images from 1 each, so (document, image) pairs are renumbered in order."""
    key = doc_segment.astype(np.int64) * 65536 + image_segment
    real = image_segment > 0
    new = np.concatenate([[True], key[1:] != key[:-1]]) & real
    return np.where(real, np.cumsum(new), 0).astype(np.int32)


def doc_arrays(kind: QwenImages, ids: np.ndarray, mask: np.ndarray, images: Sequence[Any], where: str):
    """One document's token ids, loss mask, [T, 3] positions and patch arrays."""
    grids, arrays = kind.encode(images)
    ids, mask = expand(ids, mask, [kind.tokens(g) for g in grids], kind.cfg.image_token_id, where)
    return ids, mask, kind.positions(ids, grids), arrays
