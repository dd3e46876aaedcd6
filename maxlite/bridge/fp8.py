"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1, Kimi K2 as published): each quantized weight W
[out, in] is float8_e4m3 beside `W_scale_inv` [⌈out/128⌉, ⌈in/128⌉] float32, one scale per 128 × 128
block, the weight's value being fp8 × scale. An import reads them through `dequantized`, so every
adapter sees plain float tensors (and the scales are no tensors of the model)."""

from __future__ import annotations

import sys

import numpy as np

BLOCK = 128
SUFFIX = "_scale_inv"


class Dequantized:
    """A SafetensorsDir whose block-scaled FP8 weights read as float32."""

    def __init__(self, source):
        self.source, self.path = source, source.path
        names = source.names()
        self.scaled = {n[:-len(SUFFIX)] for n in names if n.endswith(SUFFIX)}

    def names(self) -> list[str]:
        return [n for n in self.source.names() if not n.endswith(SUFFIX)]

    def __contains__(self, name: str) -> bool:
        return name in self.source and not name.endswith(SUFFIX)

    def get(self, name: str) -> np.ndarray:
        raw = self.source.get(name)
        if name not in self.scaled:
            return raw
        scale = np.asarray(self.source.get(name + SUFFIX), np.float32)
        blocks = np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)[:raw.shape[0], :raw.shape[1]]
        return np.asarray(raw, np.float32) * blocks


def dequantized(source):
    """`source` itself, or its FP8 weights dequantized (said in one line) when it has block scales."""
    wrapped = Dequantized(source)
    if not wrapped.scaled:
        return source
    print(f"maxlite: {len(wrapped.scaled)} FP8 weights with 128x128 block scales (weight_scale_inv) dequantized "
          f"on import", file=sys.stderr)
    return wrapped
