"""Streaming safetensors writer and lazy reader in plain numpy (no torch needed).

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw bytes. Writing it ourselves lets us compute every header from shapes
alone and then stream tensors one at a time, so an export holds one tensor in memory, not a shard.
Files are read through `np.memmap`: a tensor is paged in only when it is converted.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn}  # F8: DeepSeek's block-scaled checkpoints (fp8.py)
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class Entry:
    """One tensor to write: its shape and dtype now, its values only when `produce()` is called."""
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def parse_size(text: str | int) -> int:
    """'5GB' / '500MiB' / 1000 → bytes (HF convention: GB = 10⁹, GiB = 2³⁰)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {text!r}: use a size like 5GB, 500MB or 2GiB")
    unit = (m.group(2) or "B").upper()
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base**power)


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Greedy in order: a new shard when the next tensor would overflow (a big tensor gets its own)."""
    shards, size = [[]], 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header, offset = {"__metadata__": metadata}, 0
    for e in entries:
        header[e.name] = {"dtype": CODES[np.dtype(e.dtype)], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does


def _write_file(path: pathlib.Path, entries: list[Entry], metadata: dict[str, str],
                progress: Callable[[str], None] | None) -> None:
    header = _header(entries, metadata)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for e in entries:
            value = np.asarray(e.produce(), dtype=e.dtype, order="C")  # a scalar stays 0-D
            if value.shape != tuple(e.shape):
                raise AssertionError(f"{e.name}: produced {value.shape}, planned {e.shape}")
            f.write(memoryview(value.reshape(-1).view(np.uint8)))
            del value  # freed before the next tensor is produced
            if progress:
                progress(e.name)
    os.replace(tmp, path)  # a killed export never leaves a half file under the final name


def write_sharded(out_dir: str | os.PathLike, entries: Iterable[Entry], max_shard_bytes: int,
                  metadata: dict[str, str] | None = None,
                  progress: Callable[[str], None] | None = None) -> list[str]:
    """Write HF-style `model.safetensors` or `model-0000i-of-0000n.safetensors` + index json."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = list(entries)
    shards = plan_shards(entries, max_shard_bytes)
    metadata = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        names = [SINGLE_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_file(out / name, shard, metadata, progress)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: n for n, shard in zip(names, shards) for e in shard}}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names


class SafetensorsDir:
    """Lazy access to every tensor of an HF model directory (single file or sharded)."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if (self.path / INDEX_NAME).is_file():
            weight_map = json.loads((self.path / INDEX_NAME).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_NAME).is_file():
            files = [SINGLE_NAME]
        else:
            raise FileNotFoundError(
                f"{self.path}: no {SINGLE_NAME} or {INDEX_NAME} (is this a Hugging Face safetensors directory?)")
        self._where: dict[str, tuple[pathlib.Path, dict, int]] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise FileNotFoundError(f"{self.path}: {name}, named by {INDEX_NAME}, is missing")
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for tensor, info in header.items():
                self._where[tensor] = (file, info, 8 + n)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from its file's header (nothing read)."""
        return tuple(self._where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view; copy or convert it to keep it past the file."""
        if name not in self._where:
            raise KeyError(f"{self.path}: tensor {name!r} not found")
        file, info, start = self._where[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(file, dtype=dtype, mode="r", offset=start + begin, shape=shape)
