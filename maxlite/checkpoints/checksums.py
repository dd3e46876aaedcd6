"""Checksums of every checkpoint: written with it, checked on every restore.

What is checksummed, and why so:
- every array, as the CRC32C of each saved shard's bytes in C order, keyed by the shard's box in
  the global array: the host bytes each process hands to tensorstore (the host copy of an async
  save, read where it lies: no second read of the files). Orbax's zarr3 chunks carry no checksum of
  their own (only the shard index has one), so flipped bytes in a data file restore silently.
  On restore each process checksums the bytes it read; a box read onto another mesh contributes
  its part of each saved shard's CRC (CRC is linear: `crc.piece_crc0`), so one record serves any
  mesh and any number of processes, and with the same mesh it costs one plain CRC per shard;
- the `data` and `meta` items, as the CRC32C of their content as canonical JSON.

Each process writes its own record, `checksums/process_<i>` in the step (one small JSON file);
the primary's also holds the JSON items'. A checkpoint written before checksums has no such item
and is restored unverified.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import re
import sys
import threading
import time
from typing import Any, Iterator

import numpy as np

from maxlite import config as C
from maxlite.checkpoints import crc
from maxlite.checkpoints.storage import complete_steps, error_chain, fs_of

ITEM = "checksums"
MARKER = "corrupt.json"  # in a step found corrupt: never restored; `list` shows it
FORMAT = 1


class CheckpointCorrupt(C.ConfigError):
    """A checkpoint whose bytes are not what was written: never restored. A user's explicit load
    of it is one line (exit 2); a run's own resume falls back to the newest intact one."""

    def __init__(self, where: str, damaged: list[str], detail: str = ""):
        self.where, self.damaged, self.detail = where, sorted(set(damaged)), detail
        root = where.rsplit("/", 1)[0]
        super().__init__(f"checkpoint {where} is corrupt: {self.what()}; never restored "
                         f"(`python -m maxlite.checkpoints verify {root}` checks every step)")

    def what(self) -> str:
        names = ", ".join(self.damaged[:6]) + (f" and {len(self.damaged) - 6} more" if len(self.damaged) > 6 else "")
        return f"{names or 'unreadable'} failed verification" + (f" ({self.detail})" if self.detail else "")


# ---- names and boxes ----

def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def name_of(path, item: str) -> str:
    """An array's name from its tree path: `params/layers/attn/q`, `optimizer/opt_state/1/0/mu/...`."""
    keys = [_key(k) for k in path]
    if keys and keys[-1] == "value":  # nnx.Variable's own level
        keys = keys[:-1]
    return "/".join([item, *keys])


def leaves(tree, item: str) -> Iterator[tuple[str, Any]]:
    """(name, array) of every array leaf of an item."""
    import jax

    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):  # not Orbax's PLACEHOLDER
            yield name_of(path, item), leaf


def _box(index: tuple, shape: tuple) -> crc.Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _host(data) -> np.ndarray:
    return np.asarray(data)  # a view for CPU and pinned-host buffers; a transfer from an accelerator


def regions(leaf, primary_only: bool) -> list[tuple[crc.Box, np.ndarray]]:
    """This process's distinct boxes of an array and their host values. `primary_only`: only the
    boxes whose first replica lives here (what a save writes once across processes)."""
    if isinstance(leaf, np.ndarray) or not hasattr(leaf, "addressable_shards"):
        return [(tuple((0, n) for n in np.shape(leaf)), np.asarray(leaf))]
    out = {}
    for shard in leaf.addressable_shards:
        if primary_only and shard.replica_id != 0:
            continue
        box = _box(shard.index, leaf.shape)
        if box not in out:
            out[box] = _host(shard.data)
    return list(out.items())


def json_crc(obj: Any) -> int:
    """A JSON item's checksum: its content as canonical JSON (the same whoever formats the file)."""
    return crc.value(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


# ---- save ----

@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads CRCs run on: a save's hashing overlaps tensorstore's writes, and a restore's the
    next item's reads (C++ threads). The CRC releases the GIL (`crc.value`), so Orbax's Python
    threads run beside it."""
    return concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 2), thread_name_prefix="maxlite-crc")


CHUNK = 8 << 20  # bytes per CRC task: a big shard is hashed by every pool thread at once


def _crc(data: np.ndarray, standard: bool) -> concurrent.futures.Future:
    """A future of the CRC32C (`standard`) or crc0 of an array's bytes in C order, hashed in CHUNK
    pieces on the pool and combined (`crc.concat`): the last shards a save or a restore waits for
    use every core."""
    flat = crc.as_bytes(data)
    starts = range(0, flat.nbytes, CHUNK) or range(1)
    futures = [_pool().submit(crc.crc0, flat[s:s + CHUNK]) for s in starts]
    last = crc.zeros_crc(flat.nbytes) if standard else 0
    return _all(futures, lambda values: crc.concat(zip(values, [min(CHUNK, flat.nbytes - s) for s in starts])) ^ last)


def _all(futures: list, then) -> concurrent.futures.Future:
    """A future of `then([results])` once every future in the list is done."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    left, lock = [len(futures)], threading.Lock()

    def finish(_=None):
        with lock:  # callbacks run on whichever threads finish: exactly one sees the count reach 0
            left[0] -= 1
            if left[0] > 0:
                return
        try:
            out.set_result(then([f.result() for f in futures]))
        except BaseException as e:  # noqa: BLE001 — handed to whoever waits on `out`
            out.set_exception(e)
    if futures:
        for f in futures:
            f.add_done_callback(finish)
    else:
        left[0] = 1
        finish()
    return out


def record(trees: dict[str, Any], json_items: dict[str, Any], process_index: int,
           process_count: int) -> concurrent.futures.Future:
    """A future of this process's checksum record of a save: its shards of every array of `trees`
    ({item: tree}), and (given, on the primary) the JSON items'. The CRCs run on a thread pool;
    the arrays must not change until it is done."""
    layout, tasks = [], []
    for item, tree in trees.items():
        for name, leaf in leaves(tree, item):
            boxes = []
            for box, data in regions(leaf, primary_only=True):
                boxes.append([list(b) for b in box])
                tasks.append(_crc(data, standard=True))
            layout.append((name, list(leaf.shape), np.dtype(leaf.dtype).name, boxes))
    items = {name: json_crc(obj) for name, obj in json_items.items()}

    def assemble(values: list[int]) -> dict:
        it = iter(values)
        arrays = {name: {"shape": shape, "dtype": dtype, "shards": [[box, next(it)] for box in boxes]}
                  for name, shape, dtype, boxes in layout}
        out = {"format": FORMAT, "process_index": process_index, "process_count": process_count, "arrays": arrays}
        if items:
            out["items"] = items
        return out
    return _all(tasks, assemble)


@functools.cache
def _orbax_item():
    """(handler class, save args class) of the checksums item: Orbax's JSON handler, writing its
    record once the future it was given (the CRCs run while the arrays are written) is done."""
    import asyncio
    import dataclasses

    import orbax.checkpoint as ocp

    class ChecksumsHandler(ocp.JsonCheckpointHandler):
        async def _save_fn(self, x, directory):  # orbax <0.13: where the item is written
            if isinstance(x, concurrent.futures.Future):
                x = await asyncio.wrap_future(x)
            return await super()._save_fn(x, directory)

    @ocp.args.register_with_handler(ChecksumsHandler, for_save=True)
    @dataclasses.dataclass
    class ChecksumsSave(ocp.args.CheckpointArgs):
        item: Any  # the record, or a future of it

    @ocp.args.register_with_handler(ChecksumsHandler, for_restore=True)
    @dataclasses.dataclass
    class ChecksumsRestore(ocp.args.CheckpointArgs):
        item: Any = None

    return ChecksumsHandler, ChecksumsSave


def handler():
    """The Orbax handler of the checksums item: every process writes its own file."""
    import jax
    import orbax.checkpoint as ocp
    return _orbax_item()[0](filename=f"process_{jax.process_index()}",
                            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None))


def save_args(record) -> Any:
    """Orbax's save args of the checksums item: a record, or a future of one."""
    return _orbax_item()[1](record)


# ---- restore ----

class Records:
    """Every process's record of one checkpoint, merged."""

    def __init__(self, arrays: dict[str, dict], items: dict[str, int]):
        self.arrays, self.items = arrays, items

    def dtype(self, name: str) -> str | None:
        return self.arrays.get(name, {}).get("dtype")


def read(root: str, step: int) -> Records | None:
    """The checkpoint's checksum records; None when it was written without them. A damaged or
    missing record is a corrupt checkpoint."""
    where, folder = f"{root}/{step}", f"{root}/{step}/{ITEM}"
    fs = fs_of(root)
    if not fs.exists(folder):
        return None
    files = sorted(f for f in fs.ls(folder, detail=False) if f.rstrip("/").rsplit("/", 1)[-1].startswith("process_"))
    arrays: dict[str, dict] = {}
    items: dict[str, int] = {}
    count = None
    try:
        for f in files:
            rec = json.loads(fs.cat_file(f))
            count = rec["process_count"]
            items.update(rec.get("items", {}))
            for name, a in rec["arrays"].items():
                entry = arrays.setdefault(name, {"shape": a["shape"], "dtype": a["dtype"], "shards": []})
                entry["shards"].extend((tuple(tuple(b) for b in box), int(c)) for box, c in a["shards"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(where, [ITEM], f"a checksum record does not parse: {type(e).__name__}") from None
    if count is None or len(files) != count:
        raise CheckpointCorrupt(where, [ITEM], f"{len(files)} of {count} processes' checksum records found")
    return Records(arrays, items)


def pieces(records: Records, tree, item: str) -> concurrent.futures.Future:
    """A future of (what this process's reads contribute to each saved shard's CRC: {name:
    [[shard number, box, crc0], ...]}, the arrays with no checksum recorded). The CRCs run on a
    thread pool."""
    keys, tasks, unknown = [], [], []
    for name, leaf in leaves(tree, item):
        saved = records.arrays.get(name)
        if saved is None or list(leaf.shape) != saved["shape"]:
            unknown.append(name)
            continue
        for region, data in regions(leaf, primary_only=False):
            for i, (shard, _) in enumerate(saved["shards"]):
                piece = crc.intersect(shard, region)
                if piece is not None:
                    local = tuple(slice(s - r, e - r) for (s, e), (r, _) in zip(piece, region))
                    keys.append((name, i, [list(b) for b in piece]))
                    tasks.append(_crc(data[local], standard=False) if piece == shard  # the same mesh
                                 else _pool().submit(crc.piece_crc0, shard, piece, data[local]))

    def assemble(values: list[int]):
        out: dict[str, list] = {}
        for (name, i, box), value in zip(keys, values):
            out.setdefault(name, []).append([i, box, value])
        return out, unknown
    return _all(tasks, assemble)


def damaged(records: Records, gathered: list[dict[str, list]]) -> list[str]:
    """The arrays whose pieces, from every process, do not add up to what was written (or whose
    copies read by two processes differ)."""
    bad = []
    for name in sorted({name for g in gathered for name in g}):
        saved = records.arrays[name]
        item = np.dtype(saved["dtype"]).itemsize
        by_shard: dict[int, dict[tuple, int]] = {}
        ok = True
        for g in gathered:
            for i, box, value in g.get(name, []):
                seen = by_shard.setdefault(i, {})
                if seen.setdefault(tuple(tuple(b) for b in box), value) != value:
                    ok = False  # two processes read the same box and got different bytes
        for i, (shard, std) in enumerate(saved["shards"]):
            parts = by_shard.get(i, {})
            acc = 0
            for value in parts.values():
                acc ^= value
            if sum(crc.volume(box) for box in parts) != crc.volume(shard) or acc != crc.shard_crc0(std, shard, item):
                ok = False
        if not ok:
            bad.append(name)
    return bad


# ---- markers and error classification ----

def mark(root: str, step: int, err: CheckpointCorrupt, by: str) -> None:
    """Record in the step that it is corrupt (best effort: the storage may be read-only; then it is
    said, and the step is found corrupt again by the next restore that tries it)."""
    from maxlite.rundir import write_text
    try:
        write_text(f"{root}/{step}/{MARKER}", json.dumps(
            {"damaged": err.damaged, "detail": err.detail, "found_by": by,
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    except Exception as e:  # noqa: BLE001 — telling the user matters more than the marker
        print(f"maxlite: warning: could not mark checkpoint step {step} in {root} corrupt ({type(e).__name__}: "
              f"{str(e).strip()[:200]}); a later restore checks it again", file=sys.stderr, flush=True)


def marked(path: str) -> dict[int, dict]:
    """{step: marker} of the complete steps found corrupt earlier (by a restore or `verify`)."""
    return {s: m for s in complete_steps(path) if (m := marker(path, s)) is not None}


def marker(root: str, step: int) -> dict | None:
    fs = fs_of(root)
    path = f"{root}/{step}/{MARKER}"
    if not fs.exists(path):
        return None
    try:
        return json.loads(fs.cat_file(path))
    except ValueError:
        return {"damaged": [], "detail": "corrupt (its marker is unreadable)"}


# What a read of damaged bytes raises (seen here: flipped, truncated and removed files of every
# kind in a step): tensorstore's DATA_LOSS (a CRC of its own, a short zarr shard), OUT_OF_RANGE (a
# truncated file), NOT_FOUND (a removed one), "Error decoding" (a b-tree node), "Invalid JSON" and
# Python's JSON/UTF-8 errors (Orbax's metadata files), a missing file. Storage that cannot be
# reached (UNAVAILABLE, DEADLINE_EXCEEDED, PERMISSION_DENIED) and a wrong target (INVALID_ARGUMENT)
# are not the checkpoint's fault and must never send a run back to an older one.
_DAMAGE = re.compile(r"\b(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND)\b|Error decoding|checksum|Invalid JSON|"
                     r"JSONDecodeError|UnicodeDecodeError|FileNotFoundError")
_ARRAY = re.compile(r'"([^"/]+)/c/[^"]*" in OCDBT database at [^"]*"[^"]*/(params|optimizer)/"')


def damage_of(e: BaseException) -> list[str] | None:
    """The arrays a restore error names, when it means damaged bytes; None when it does not."""
    text = "\n".join(f"{type(x).__name__}: {x}" for x in error_chain(e))
    if not _DAMAGE.search(text):
        return None
    names = set()
    for key, item in _ARRAY.findall(text):
        parts = key.split(".")
        if parts and parts[-1] == "value":
            parts = parts[:-1]
        names.add("/".join([item, *parts]))
    return sorted(names)
