"""MXFP4 expert weights (the published gpt-oss checkpoints): dequantized on import, written on
`hf export --dtype mxfp4`.

A checkpoint stores a matrix W [E, in, out] as `NAME_blocks` [E, out, in/32, 16] (uint8: two 4-bit
E2M1 values per byte, the low nibble first) and `NAME_scales` [E, out, in/32] (uint8: a shared
power-of-two exponent per 32 values, biased by 127). W = value · 2^(scale − 127), transposed to
[E, in, out]: what transformers' `convert_moe_packed_tensors` gives (every value is exact in
bfloat16 and float32 alike). Quantizing takes each block's shared exponent as the OCP MX rule does,
floor(log2(max |w|)) − 2 (6 = 1.5·2², the largest value, then fits), and each value to the nearest
of the 16 (saturating at ±6): lossy for trained weights, exact for values that came from MXFP4.
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


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [E, in, out] (in a multiple of 32) → (blocks [E, out, in/32, 16], scales [E, out, in/32])."""
    E, n_in, n_out = w.shape
    x = np.asarray(w, np.float32).transpose(0, 2, 1).reshape(E, n_out, n_in // 32, 32)
    amax = np.abs(x).max(axis=-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    scaled = np.clip(np.ldexp(x, -exponent[..., None]), -6.0, 6.0)
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)  # the nearest value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponent + 127).astype(np.uint8)


def quantized_entries(entries: list, names: tuple[str, ...], dtype) -> list:
    """Float32 entries: each named `X` ending in one of `names` as `X_blocks` and `X_scales` (uint8),
    quantized once when the first of the two is written and freed after the second; the others
    cast to `dtype`."""
    from maxlite.bridge.safetensors_io import Entry

    out = []
    for e in entries:
        if not e.name.endswith(names):
            out.append(Entry(e.name, e.shape, np.dtype(dtype), lambda e=e: e.produce().astype(dtype)))
            continue
        E, n_in, n_out = e.shape
        cache: dict = {}

        def part(i, e=e, cache=cache):
            if not cache:
                cache.update(both=quantize(e.produce()), left=2)
            value, cache["left"] = cache["both"][i], cache["left"] - 1
            if not cache["left"]:
                cache.clear()
            return value

        out += [Entry(e.name + "_blocks", (E, n_out, n_in // 32, 16), np.dtype(np.uint8), lambda part=part: part(0)),
                Entry(e.name + "_scales", (E, n_out, n_in // 32), np.dtype(np.uint8), lambda part=part: part(1))]
    return out


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
