"""CRC32C of array boxes, and how the CRCs of pieces add up to the CRC of the whole.

A checkpoint records the CRC32C (hardware-accelerated: ISA-L's, or google_crc32c's libcrc32c) of
every saved shard's bytes in C order. A restore onto another mesh reads other boxes; CRC is linear over GF(2), so the
CRC of a saved shard is the XOR of what each box read contributes to it, each piece shifted to its
place: `piece_crc0` computes that contribution from the piece's bytes alone, and any number of
processes can add theirs. With the same mesh a read box is a saved shard and this is one plain CRC.

`crc0` is the CRC with a zero initial register and no final XOR (the linear part):
std(M) = crc0(M) ^ std(zeros(len M)), crc0(A || B) = shift(crc0(A), len B) ^ crc0(B).
"""

from __future__ import annotations

import ctypes
import functools

import google_crc32c
import numpy as np

_POLY = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected
_MASK = 0xFFFFFFFF

Box = tuple[tuple[int, int], ...]  # ((start, stop) per dimension)


def as_bytes(data) -> np.ndarray:
    """The bytes of an array in C order (a view when it is C-contiguous), or of a bytes-like object,
    as a flat uint8 array (what google_crc32c reads without a copy)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, np.uint8)


@functools.cache
def _native() -> tuple[str, object]:
    """(name, function (data address, nbytes) -> standard CRC32C) of the fastest CRC32C at hand,
    called through ctypes, which releases the GIL for the call: CRCs on a thread pool run beside
    Orbax's and tensorstore's Python threads, and on every core at once.

    - "isa-l": ISA-L's `crc32_iscsi` (CRC32C folded with carry-less multiplies; python-isal's
      extension links it): 56 GB/s over a buffer in cache on this project's 2-core AMD EPYC, 30
      from memory (bound by it);
    - "libcrc32c": its `crc32c_extend` (the library google_crc32c's extension links; three
      interleaved `crc32` instructions): 19.5 and 13 GB/s on the same buffers;
    - "google_crc32c": its `value`, where neither symbol is found; it holds the GIL for anything
      but `bytes` of 1 MiB or more (a Python loop beside it ran at 4-15% of its speed)."""
    try:
        from isal import isal_zlib
        iscsi = ctypes.CDLL(isal_zlib.__file__).crc32_iscsi  # exported by the extension module
        iscsi.restype, iscsi.argtypes = ctypes.c_uint32, (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32)

        def isal_crc(address: int, nbytes: int) -> int:
            reg = _MASK
            for at in range(0, nbytes, _MAX_CALL):  # its length is a C int
                reg = iscsi(address + at, min(_MAX_CALL, nbytes - at), reg)
            return reg ^ _MASK
        return "isa-l", isal_crc
    except (ImportError, OSError, AttributeError):
        pass
    try:
        from google_crc32c import _crc32c
        extend = ctypes.CDLL(_crc32c.__file__).crc32c_extend  # dlsym searches the extension's libraries too
        extend.restype, extend.argtypes = ctypes.c_uint32, (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
        return "libcrc32c", lambda address, nbytes: extend(0, address, nbytes)
    except (ImportError, OSError, AttributeError):
        return "google_crc32c", None


_MAX_CALL = 1 << 30  # bytes per ISA-L call


def implementation() -> str:
    """Which CRC32C `value` runs: "isa-l", "libcrc32c" (both off the GIL) or "google_crc32c"."""
    return _native()[0]


def releases_gil() -> bool:
    return _native()[1] is not None


def value(data) -> int:
    """The standard CRC32C of an array's bytes in C order, or of a bytes-like object."""
    data, fn = as_bytes(data), _native()[1]
    return fn(data.ctypes.data, data.nbytes) if fn is not None else google_crc32c.value(data)


def _mult(a: int, b: int) -> int:
    """a(x) * b(x) mod P, bit-reflected (zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache
def _x2n(k: int) -> int:
    """x^(2^k) mod P."""
    return 1 << 30 if k == 0 else _mult(_x2n(k - 1), _x2n(k - 1))


@functools.lru_cache(maxsize=4096)
def _x8n(n: int) -> int:
    """x^(8n) mod P: what appending n zero bytes multiplies a CRC register by."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _mult(_x2n(k), p)
        n >>= 1
        k += 1
    return p


def shift(crc: int, nbytes: int) -> int:
    """crc0(M) -> crc0(M || zeros(nbytes))."""
    return _mult(_x8n(nbytes), crc) if nbytes else crc


@functools.lru_cache(maxsize=4096)
def zeros_crc(nbytes: int) -> int:
    """The standard CRC32C of `nbytes` zero bytes, without allocating them."""
    return shift(_MASK, nbytes) ^ _MASK


def crc0(data) -> int:
    data = as_bytes(data)
    return value(data) ^ zeros_crc(data.nbytes)


def concat(parts) -> int:
    """crc0 of consecutive pieces' bytes from each piece's (crc0, nbytes), in order."""
    acc = 0
    for c, n in parts:
        acc = shift(acc, n) ^ c
    return acc


@functools.lru_cache(maxsize=64)
def _shift_table(nbytes: int) -> tuple[list[int], ...]:
    """Byte tables for shift(·, nbytes): four lookups instead of 32 steps (runs of many rows)."""
    m = _x8n(nbytes)
    return tuple([_mult(m, b << (8 * i)) for b in range(256)] for i in range(4))


def _shift_fast(crc: int, table) -> int:
    t0, t1, t2, t3 = table
    return t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(s0, s1), min(e0, e1)) for (s0, e0), (s1, e1) in zip(a, b))
    return None if any(s >= e for s, e in out) else out


def volume(box: Box) -> int:
    return int(np.prod([e - s for s, e in box], dtype=np.int64))


def piece_crc0(shard: Box, piece: Box, data: np.ndarray) -> int:
    """What the bytes of `piece` (a box inside the saved shard `shard`, its values `data`) add to
    crc0 of the shard's bytes in C order. XOR the pieces of a shard together to get its crc0."""
    data = np.ascontiguousarray(data)
    if piece == shard:
        return crc0(data)
    item = data.dtype.itemsize
    extent = [e - s for s, e in shard]
    size = [e - s for s, e in piece]
    offset = [p - s for (p, _), (s, _) in zip(piece, shard)]
    stride = [item * int(np.prod(extent[d + 1:], dtype=np.int64)) for d in range(len(shard))]
    total = item * int(np.prod(extent, dtype=np.int64))
    # k: the last dimension the piece does not span; a run = the piece's data for fixed leading
    # coordinates (dims < k), contiguous both in the piece and in the shard's C order
    k = max(d for d in range(len(shard)) if size[d] != extent[d])
    run = size[k] * stride[k]
    if k:
        starts = np.indices(size[:k]).reshape(k, -1).T @ np.asarray(stride[:k], np.int64)
        starts += int(np.dot(offset[:k], stride[:k])) + offset[k] * stride[k]
    else:
        starts = np.asarray([offset[k] * stride[k]], np.int64)
    flat, zero = as_bytes(data), zeros_crc(run)
    acc = value(flat[:run]) ^ zero
    for r, gap in enumerate(np.diff(starts).tolist(), 1):
        table = _shift_table(gap)
        acc = _shift_fast(acc, table) ^ value(flat[r * run:(r + 1) * run]) ^ zero
    last_end = int(starts[-1]) + run
    return shift(acc, total - last_end)


def shard_crc0(std_crc: int, shard: Box, itemsize: int) -> int:
    """The crc0 of a saved shard from its recorded standard CRC."""
    return std_crc ^ zeros_crc(itemsize * volume(shard))
