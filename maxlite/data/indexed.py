"""Megatron's MMIDIDX `.bin/.idx` format: writer, memory-mapped reader, merge.

Byte-compatible with Megatron-LM / NeMo in both directions:
  .idx = b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q N sequences | <Q D (documents + 1)
         | int32[N] sequence lengths | int64[N] byte offsets into .bin | int64[D] document indices
  .bin = the tokens of every sequence, concatenated, little-endian.
"""

from __future__ import annotations

import os
import pathlib
import struct
from typing import Iterable, Sequence

import numpy as np

from maxlite.config import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


def best_dtype(vocab_size: int) -> type:
    """Megatron's rule: uint16 when the vocabulary has < 65,500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return f"{prefix}.idx"


def bin_path(prefix: str) -> str:
    return f"{prefix}.bin"


class IndexedWriter:
    """Appends documents to `{prefix}.bin` and writes `{prefix}.idx` on `finalize()`."""

    def __init__(self, prefix: str, dtype: type = np.uint16):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        pathlib.Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(bin_path(prefix), "wb")
        self._lengths: list[int] = []
        self._doc_idx: list[int] = [0]
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray | Sequence[int]) -> None:
        """One document made of one sequence (what preprocess with --append-eod writes)."""
        self.add_sequences([tokens])

    def add_sequences(self, sequences: Iterable[np.ndarray | Sequence[int]]) -> None:
        """One document made of several sequences (e.g. sentences)."""
        for seq in sequences:
            arr = np.asarray(seq, dtype=self.dtype)
            self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
            self._lengths.append(len(arr))
            self.num_tokens += len(arr)
        self._doc_idx.append(len(self._lengths))

    def add_documents_flat(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: their tokens concatenated, and their lengths."""
        self._bin.write(np.asarray(tokens, self.dtype.newbyteorder("<")).tobytes())
        first = len(self._lengths)
        self._lengths.extend(int(n) for n in lengths)
        self._doc_idx.extend(range(first + 1, first + len(lengths) + 1))
        self.num_tokens += int(np.sum(lengths))

    def finalize(self) -> None:
        self._bin.close()
        write_index(idx_path(self.prefix), self.dtype, np.asarray(self._lengths, np.int32),
                    np.asarray(self._doc_idx, np.int64))

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()


def write_index(path: str, dtype: np.dtype, lengths: np.ndarray, doc_idx: np.ndarray) -> None:
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())
    os.replace(tmp, path)  # a crash never leaves a half-written index behind


class IndexedDataset:
    """Memory-mapped reader; validates the header and the `.bin` size on open."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                raise ConfigError(f"indexed data: {p} not found (data_prefix is the path without .bin/.idx)")
        size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            head = f.read(_HEADER)
        if len(head) < _HEADER or head[:9] != MAGIC:
            raise ConfigError(f"{ipath}: not a Megatron MMIDIDX index (bad magic or truncated header)")
        version, = struct.unpack("<Q", head[9:17])
        code = head[17]
        n, d = struct.unpack("<QQ", head[18:34])
        if version != VERSION or code not in DTYPES:
            raise ConfigError(f"{ipath}: unsupported index version {version} or dtype code {code}")
        want = _HEADER + n * 4 + n * 8 + d * 8
        if size < want:
            raise ConfigError(f"{ipath}: truncated ({size} bytes, header says {want}); re-run preprocess")
        self.dtype = np.dtype(DTYPES[code])
        idx = np.memmap(ipath, mode="r", dtype=np.uint8)
        self.lengths = np.frombuffer(idx, "<i4", n, _HEADER)
        self.pointers = np.frombuffer(idx, "<i8", n, _HEADER + n * 4)
        self.doc_idx = np.frombuffer(idx, "<i8", d, _HEADER + n * 12)
        expected = int(self.lengths.astype(np.int64).sum()) * self.dtype.itemsize
        actual = os.path.getsize(bpath)
        if actual != expected:
            raise ConfigError(
                f"{bpath}: size {actual} bytes does not match its index ({expected} bytes); "
                f"the .bin/.idx pair is truncated or mismatched")
        if n and (self.pointers[-1] + int(self.lengths[-1]) * self.dtype.itemsize != expected):
            raise ConfigError(f"{ipath}: sequence offsets are inconsistent; re-run preprocess")
        self.tokens = (np.memmap(bpath, mode="r", dtype=self.dtype.newbyteorder("<"))
                       if actual else np.zeros(0, self.dtype))
        # Offsets in tokens, for slicing the flat token array.
        self.starts = self.pointers // self.dtype.itemsize

    def __reduce__(self):  # worker processes re-open the files instead of copying the data
        return (IndexedDataset, (self.prefix,))

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.astype(np.int64).sum())

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.starts[i])
        return np.asarray(self.tokens[start:start + int(self.lengths[i])])

    def document(self, j: int) -> list[np.ndarray]:
        return [self[i] for i in range(int(self.doc_idx[j]), int(self.doc_idx[j + 1]))]


def merge(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Concatenate several `.bin/.idx` pairs (same dtype) into one, documents in order."""
    if not prefixes:
        raise ConfigError("merge: no input prefixes given")
    parts = [IndexedDataset(p) for p in prefixes]
    dtypes = {p.dtype for p in parts}
    if len(dtypes) != 1:
        raise ConfigError(f"merge: inputs have different token dtypes {sorted(map(str, dtypes))}")
    pathlib.Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    lengths, docs, offset = [], [np.zeros(1, np.int64)], 0
    with open(bin_path(output_prefix), "wb") as out:
        for part in parts:
            with open(bin_path(part.prefix), "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
            lengths.append(np.asarray(part.lengths))
            docs.append(np.asarray(part.doc_idx[1:]) + offset)
            offset += part.num_sequences
    write_index(idx_path(output_prefix), parts[0].dtype,
                np.concatenate(lengths).astype(np.int32), np.concatenate(docs))
    return IndexedDataset(output_prefix)
