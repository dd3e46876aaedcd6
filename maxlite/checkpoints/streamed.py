"""Parameters written and read piece by piece: a checkpoint as big as a model, with host memory of
a few tensors (the HF bridge's import and export).

Writing: `save_streamed` makes a normal params-only checkpoint (the same items, Orbax's commit
protocol, checksums) whose arrays are filled from an iterator of pieces — one layer's (or one
expert's) slice of a stacked leaf at a time — instead of from arrays in memory. Each array is a
zarr3 array in the step's OCDBT store whose write chunk is one piece, so every piece is written
whole, once; each piece is a shard of the checksum record, so restores verify it as they verify any
other checkpoint. In a multi-process JAX run every process writes the pieces it is given (its own
OCDBT files and checksum record; Orbax merges them at commit).

Reading: `ParamsReader` opens the arrays of a step and reads any box of any leaf, checking what it
read against the checkpoint's checksums once every box of a saved shard has been read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Callable, Iterator

import numpy as np

from maxlite import config as C
from maxlite.checkpoints import checksums, crc
from maxlite.checkpoints.layout import manager_options, maxlite_version, remove_failed_save, resolve_step_dir
from maxlite.checkpoints.params import verified_meta
from maxlite.checkpoints.storage import check_path, fs_of, storage_error

Path = tuple  # a leaf's keys in the pure params tree: ('layers', 'attn', 'q')
Piece = tuple[Path, tuple[int, ...], np.ndarray]  # (leaf, leading indices, values of that slice)


@dataclasses.dataclass(frozen=True)
class Streamed:
    """A leaf to be written piece by piece: its shape, dtype and pieces' shape (the write chunk)."""
    path: Path
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _box(shape: tuple, index: tuple[int, ...], piece_shape: tuple) -> crc.Box:
    return tuple((k, k + 1) for k in index) + tuple((0, n) for n in shape[len(index):])


@functools.cache
def _handler_class():
    """The Orbax type handler of `Streamed` leaves: each item's leaves are opened as tensorstores,
    then filled from the writer's pieces one at a time (each written and hashed before the next is
    made). Its typestr is jax.Array's: the saved metadata is what a training run's save writes."""
    import asyncio

    import tensorstore as ts
    from orbax.checkpoint import future
    from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils as ts_utils, type_handlers

    class StreamedHandler(type_handlers.NumpyHandler):
        def __init__(self, writer: "_Writer"):
            super().__init__()
            self.writer = writer

        def typestr(self) -> str:
            return "jax.Array"

        async def serialize(self, values, infos, args=None):
            return [future.CommitFutureAwaitingContractedSignals(self._write(values, infos, args),
                                                                 name="maxlite_streamed")]

        async def _write(self, values, infos, args):
            stores = {}
            for value, info, arg in zip(values, infos, args or [None] * len(values)):
                await info.await_path_creation()
                spec = ts_utils.build_array_write_spec(
                    info=info, arg=arg, global_shape=value.shape, local_shape=value.chunk, dtype=value.dtype,
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint))
                stores[value.path] = (value, ts.open(ts.Spec(spec.json), create=True, open=True,
                                                     context=info.ts_context))
            stores = {p: (v, await opening) for p, (v, opening) in stores.items()}
            try:
                for path, index, data in self.writer.pieces():
                    leaf, store = stores[path]
                    data = np.ascontiguousarray(data, dtype=leaf.dtype)
                    box = _box(leaf.shape, index, data.shape)
                    block = data.reshape(tuple(e - s for s, e in box))
                    hashed = asyncio.wrap_future(checksums._crc(block, standard=True))
                    await store[tuple(slice(s, e) for s, e in box)].write(block)
                    self.writer.written(leaf, box, await hashed)
                    del data, block  # freed before the next piece is made
            except BaseException as e:
                self.writer.fail(e)
                raise
            self.writer.finish()

    return StreamedHandler


class _Writer:
    """The pieces of one save, and the checksum record they add up to (a future the checksums
    item waits for)."""

    def __init__(self, leaves: list[Streamed], pieces: Callable[[], Iterator[Piece]], json_items: dict,
                 process_index: int, process_count: int, progress: Callable[[str], None] | None):
        self.leaves, self._pieces, self.progress = leaves, pieces, progress
        self.json_items, self.process_index, self.process_count = json_items, process_index, process_count
        self.shards: dict[Path, list] = {leaf.path: [] for leaf in leaves}
        self.record: concurrent.futures.Future = concurrent.futures.Future()

    def pieces(self) -> Iterator[Piece]:
        return self._pieces()

    def written(self, leaf: Streamed, box: crc.Box, value: int) -> None:
        self.shards[leaf.path].append([[list(b) for b in box], value])

    def fail(self, e: BaseException) -> None:
        if not self.record.done():
            self.record.set_exception(e)

    def finish(self) -> None:
        arrays = {checksums.name_of(leaf.path, "params"): {"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name,
                                                           "shards": self.shards[leaf.path]}
                  for leaf in self.leaves}
        out = {"format": checksums.FORMAT, "process_index": self.process_index,
               "process_count": self.process_count, "arrays": arrays}
        if self.json_items:
            out["items"] = {name: checksums.json_crc(obj) for name, obj in self.json_items.items()}
        self.record.set_result(out)


def _state_of(cfg, leaves: list[Streamed]):
    """`leaves` in the structure of the model's nnx.State (what save_params saves)."""
    from maxlite.bridge import params as P
    pure: dict = {}
    for leaf in leaves:
        P.put(pure, leaf.path, leaf)
    return P.to_state(cfg, pure)


def save_streamed(path: str, cfg, leaves: list[Streamed], pieces: Callable[[], Iterator[Piece]],
                  extra_meta: dict[str, Any] | None = None, step: int = 0) -> str:
    """Write a params-only checkpoint (save_params' layout) of `cfg`'s model whose leaves are
    `leaves`, filled from `pieces()`: this process's pieces, each a leaf's slice at leading indices.
    Collective in a multi-process JAX run (every process calls it with its own pieces); the primary
    writes the meta. The step is complete only once every piece of every process is written."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.serialization import type_handler_registry as registry

    from maxlite.checkpoints.layout import _DATA_FILE_BYTES, array_handler, quiet_orbax

    path = C.resolve_path(path).rstrip("/")
    check_path(path)
    primary = jax.process_index() == 0
    meta = {"step": step, "consumed_samples": 0, "tokens_seen": 0, "val_loss": None,
            "config": C.to_plain_dict(cfg), "maxlite_version": maxlite_version(), "params_only": True,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra_meta or {})}
    writer = _Writer(leaves, pieces, {"meta": meta} if primary else {}, jax.process_index(), jax.process_count(),
                     None)
    array_handler()  # maxlite's Orbax settings (logging, array handler) as every save has them
    quiet_orbax()
    from absl import logging as absl_logging
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # "No jax.Array in TypeHandlerRegistry": none to save
    try:
        params_handler = ocp.PyTreeCheckpointHandler(
            use_zarr3=True, use_compression=False,
            type_handler_registry=registry.create_type_handler_registry((Streamed, _handler_class()(writer))))
    finally:
        absl_logging.set_verbosity(level)
    handlers = {"params": params_handler, "meta": ocp.JsonCheckpointHandler(), checksums.ITEM: checksums.handler()}
    try:
        mngr = ocp.CheckpointManager(path, options=manager_options(async_save=False), item_handlers=handlers)
    except Exception as e:  # noqa: BLE001
        raise storage_error(path, e) from None
    items = {"params": ocp.args.PyTreeSave(_state_of(cfg, leaves), ocdbt_target_data_file_size=_DATA_FILE_BYTES[1]),
             checksums.ITEM: checksums.save_args(writer.record)}
    if primary:
        items["meta"] = ocp.args.JsonSave(meta)
    try:
        mngr.save(step, args=ocp.args.Composite(**items), force=True)
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
        remove_failed_save(path, step)  # never complete, and not left for the next writer
        made = writer.record.exception() if writer.record.done() else None
        if made is not None:  # the pieces' own error (the user's tensors, or a converter bug): as it is
            raise made from None
        raise storage_error(path, e) from None
    finally:
        mngr.close()
    return f"{path}/{step}"


class ParamsReader:
    """Any box of any params leaf of a checkpoint step, read on demand and verified: `check()` at the
    end raises CheckpointCorrupt when the boxes read of a saved shard do not add up to its checksum."""

    def __init__(self, path: str, step: int | None = None):
        self.root, self.step = resolve_step_dir(path, step)
        self.where = f"{self.root}/{self.step}"
        self.meta = verified_meta(self.root, self.step)
        self.records = checksums.read(self.root, self.step)
        self._stores: dict[str, Any] = {}
        self._pieces: dict[str, list] = {}  # name → [[shard number, box, crc0], ...]: damaged()'s input
        self._futures: list[concurrent.futures.Future] = []

    def config(self):
        if "config" not in self.meta:
            raise C.ConfigError(f"{self.where}: no saved config in its metadata")
        return C.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.meta["config"].items()
                           if k in C.Config.__dataclass_fields__})

    @functools.cached_property
    def _shared_context(self):
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
        return ts_utils.get_ts_context(use_ocdbt=True)

    def _context(self):
        return self._shared_context

    def _store(self, name: str):
        """The tensorstore of a params leaf (`params/layers/attn/q`), opened once."""
        if name not in self._stores:
            import tensorstore as ts
            from etils import epath
            from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils, types

            key = ".".join(name.split("/")[1:]) + ".value"
            directory = epath.Path(f"{self.where}/params")
            info = types.ParamInfo(name=key, parent_dir=directory, is_ocdbt_checkpoint=True, use_zarr3=True,
                                   ts_context=self._context())
            spec = ts_utils.build_array_read_spec(info, use_ocdbt=True).json
            try:
                self._stores[name] = ts.open(ts.Spec(spec), open=True, context=info.ts_context).result()
            except Exception as e:  # noqa: BLE001
                names = checksums.damage_of(e)
                if names is None:
                    raise storage_error(self.where, e) from None
                raise checksums.CheckpointCorrupt(self.where, [name], str(e).splitlines()[0][:200]) from None
        return self._stores[name]

    def read(self, path: Path, index: tuple[int, ...] = ()) -> np.ndarray:
        """The leaf at `path` (pure-tree keys), or its slice at leading `index` (without those axes)."""
        name = "/".join(["params", *map(str, path)])
        store = self._store(name)
        shape = tuple(store.shape)
        box = tuple((k, k + 1) for k in index) + tuple((0, n) for n in shape[len(index):])
        try:
            data = store[tuple(slice(s, e) for s, e in box)].read().result()
        except Exception as e:  # noqa: BLE001
            if checksums.damage_of(e) is None:
                raise storage_error(self.where, e) from None
            raise checksums.CheckpointCorrupt(self.where, [name], str(e).splitlines()[0][:200]) from None
        if self.records is not None:
            saved = self.records.arrays.get(name)
            if saved is None or list(saved["shape"]) != list(shape):
                raise checksums.CheckpointCorrupt(self.where, [name], "no checksum recorded for it")
            for i, (shard, _) in enumerate(saved["shards"]):
                piece = crc.intersect(shard, box)
                if piece is not None:
                    local = tuple(slice(s - r, e - r) for (s, e), (r, _) in zip(piece, box))
                    future = checksums._pool().submit(crc.piece_crc0, shard, piece, data[local])
                    self._futures.append(future)
                    future.add_done_callback(functools.partial(self._add, name, i, [list(b) for b in piece]))
        return data.reshape(shape[len(index):])

    def _add(self, name, i, box, future) -> None:
        if future.exception() is None:
            self._pieces.setdefault(name, []).append([i, box, future.result()])

    def check(self) -> list[str]:
        """Raise CheckpointCorrupt when what was read does not match its checksums; returns the leaves
        not wholly read (so not verified)."""
        concurrent.futures.wait(self._futures)
        for f in self._futures:
            f.result()
        if self.records is None:
            return sorted(self._pieces)
        whole, partial = {}, []
        for name, got in self._pieces.items():
            shards = self.records.arrays[name]["shards"]
            covered = {}
            for i, box, _ in got:
                covered.setdefault(i, set()).add(tuple(map(tuple, box)))
            if all(sum(crc.volume(b) for b in covered.get(i, ())) == crc.volume(s) for i, (s, _) in enumerate(shards)):
                whole[name] = got
            else:
                partial.append(name)
        bad = checksums.damaged(self.records, [whole])
        if bad:
            raise checksums.CheckpointCorrupt(self.where, bad, "checksum mismatch")
        return sorted(partial)


class LazyLeaf:
    """A params leaf of a checkpoint that reads only what is indexed: `leaf[i]` / `leaf[i, j]` is that
    slice, `np.asarray(leaf)` the whole leaf."""
    lazy = True

    def __init__(self, reader: ParamsReader, path: Path, shape: tuple[int, ...], dtype):
        self.reader, self.path, self.shape, self.dtype = reader, path, tuple(shape), np.dtype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(k, (int, np.integer)) for k in index):
            raise TypeError(f"LazyLeaf reads slices at integer leading indices, not {index!r}")
        return self.reader.read(self.path, tuple(int(k) for k in index))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        data = self.reader.read(self.path)
        return data if dtype is None else data.astype(dtype)


def lazy_params(reader: ParamsReader, cfg) -> dict:
    """The model's params (cfg's tree) as LazyLeafs of the checkpoint `reader` opened."""
    from flax import nnx

    from maxlite.bridge import params as P
    from maxlite.state import abstract_params

    out: dict = {}
    for path, a in P.leaves(nnx.to_pure_dict(abstract_params(cfg)[1])):
        P.put(out, path, LazyLeaf(reader, path, a.shape, a.dtype))
    return out
