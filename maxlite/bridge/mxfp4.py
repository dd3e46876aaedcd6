"""MXFP4 expert weights (the published gpt-oss checkpoints) dequantized on import.

A checkpoint stores a matrix W [E, in, out] as `NAME_blocks` [E, out, in/32, 16] (uint8: two 4-bit
E2M1 values per byte, the low nibble first) and `NAME_scales` [E, out, in/32] (uint8: a shared
power-of-two exponent per 32 values, biased by 127). W = value · 2^(scale − 127), transposed to
[E, in, out]: what transformers' `convert_moe_packed_tensors` gives (every value is exact in
bfloat16 and float32 alike).
"""

from __future__ import annotations

import sys

import numpy as np

# the 16 values of a 4-bit E2M1 number, by its bits (sign in the high bit)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[E, out, G, 16] uint8 blocks and [E, out, G] uint8 scales → float32 [E, in = 32·G, out]."""
    blocks = np.asarray(blocks, np.uint8)
    E, out, G, B = blocks.shape
    values = np.empty((E, out, G, 2 * B), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, np.asarray(scales, np.int32)[..., None] - 127)
    return np.ascontiguousarray(values.reshape(E, out, G * 2 * B).transpose(0, 2, 1))


class _Dequantizing:
    """A safetensors directory whose `X_blocks` + `X_scales` pairs read as one tensor `X`."""

    def __init__(self, source):
        self.source, self.path = source, source.path
        names = set(source.names())
        self.packed = sorted(n[: -len("_blocks")] for n in names
                             if n.endswith("_blocks") and n[: -len("_blocks")] + "_scales" in names)
        hidden = {f"{n}_{part}" for n in self.packed for part in ("blocks", "scales")}
        self._names = sorted(names - hidden) + self.packed

    def names(self) -> list[str]:
        return self._names

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> np.ndarray:
        if name in self.packed:
            return dequantize(self.source.get(name + "_blocks"), self.source.get(name + "_scales"))
        return self.source.get(name)


def dequantizing(source):
    """`source` as float tensors: MXFP4 pairs dequantized (said once, on stderr), others as stored."""
    view = _Dequantizing(source)
    if view.packed:
        print(f"{source.path}: dequantizing {len(view.packed)} MXFP4 expert tensors to float32", file=sys.stderr)
    return view
