"""Multimodal RoPE positions of a Qwen3-VL prompt (numpy; the data pipeline and `generate` build
them): each token's (time, height, width) position, as transformers' `get_rope_index` gives them.

Text tokens count up by one, all three equal. An image's tokens (its `<|image_pad|>` run,
(h / merge) × (w / merge) of them, row by row) share the time position where the image starts and
take height and width positions from that start; the text after the image starts at that start +
max(h, w) / merge.
"""

from __future__ import annotations

import numpy as np


def mrope_positions(ids, grids, merge: int, image_token_id: int, start: int = 0) -> np.ndarray:
    """[T, 3] int32 positions of one document's token ids; `grids`: its images' (t, h, w) patch grids
    in order (the placeholder runs must hold their token counts: maxlite/data/images.py checks it)."""
    ids = np.asarray(ids)
    out = np.zeros((len(ids), 3), np.int32)
    images, pos, i = iter(grids), start, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out[i] = pos
            pos, i = pos + 1, i + 1
            continue
        t, h, w = next(images)
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[i:i + n] = np.stack([tt.ravel() + pos, hh.ravel() + pos, ww.ravel() + pos], axis=-1)
        pos, i = pos + max(gh, gw), i + n
    return out
