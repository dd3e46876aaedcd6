"""Restoring items of a step onto any mesh, each checked against the checksums written with it;
one-line errors for a checkpoint of another model."""

from __future__ import annotations

import json
from typing import Any

from maxlite import config as C
from maxlite.checkpoints import checksums
from maxlite.checkpoints.layout import array_handler, array_restore
from maxlite.checkpoints.storage import error_line, fs_of, storage_error
from maxlite.schema import MODEL_KEYS

ARRAY_ITEMS = ("params", "optimizer")
JSON_ITEMS = ("data", "meta")


def _flat_shapes(tree) -> dict[str, tuple]:
    return {name.split("/", 1)[1]: tuple(leaf.shape) for name, leaf in checksums.leaves(tree, "_")}


def check_compatible(saved_meta_tree, target, where: str, model: dict[str, Any] | None = None) -> None:
    """A one-line error naming the first parameter whose shape differs (or that is missing), and the
    model keys (schema.MODEL_KEYS) in which the checkpoint's saved config differs from `model` (this
    run's, config.to_plain_dict), when given: what to set for the checkpoint to fit."""
    saved, want = _flat_shapes(saved_meta_tree), _flat_shapes(target)
    for name, shape in want.items():
        if name not in saved:
            raise C.ConfigError(f"checkpoint {where} has no parameter '{name}' that this model needs: it was "
                                f"saved from a different model{_model_differences(where, model)}")
        if saved[name] != shape:
            raise C.ConfigError(f"checkpoint {where} does not fit this model: parameter '{name}' is {saved[name]} "
                                f"there but {shape} here{_model_differences(where, model)}")
    extra = sorted(set(saved) - set(want))
    if extra:
        raise C.ConfigError(f"checkpoint {where} has parameter '{extra[0]}' that this model lacks: it was "
                            f"saved from a different model{_model_differences(where, model)}")


def _model_differences(where: str, model: dict[str, Any] | None) -> str:
    """How the error goes on: the model keys the checkpoint's meta records otherwise than `model`,
    or the keys to check when it records none."""
    try:
        with fs_of(where).open(f"{where}/meta/metadata", "rb") as f:
            saved = json.loads(f.read()).get("config") or {}
    except (OSError, ValueError):  # no meta, or a damaged one: the shapes said enough
        saved = {}
    keys = [k for k in MODEL_KEYS if model is not None and k in saved and k in model
            and _plain(saved[k]) != _plain(model[k])]
    if not keys:
        return "; check model_name and the model keys"
    shown = ", ".join(f"{k}={json.dumps(_plain(saved[k]))} there, {json.dumps(_plain(model[k]))} here" for k in keys)
    return f"; its model keys differ ({shown}): set them as the checkpoint's"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def item_metadata(path: str):
    """The saved tree of an array item (shapes, dtypes) without reading its arrays."""
    from etils import epath
    handler = array_handler()
    try:
        meta = handler.metadata(epath.Path(path))
    finally:
        handler.close()
    return getattr(meta, "tree", meta)


def saved_tree(root: str, step: int, item: str):
    """The saved tree of an array item of a step, with one-line errors."""
    where = f"{root}/{step}"
    if not fs_of(root).exists(f"{where}/{item}"):
        raise C.ConfigError(f"{where} has no item {item!r}")
    try:
        return item_metadata(f"{where}/{item}")
    except Exception as e:  # noqa: BLE001
        raise _read_error(where, e, item) from None


def restore_array_item(path: str, target):
    """One array item as `target` (ShapeDtypeStructs with shardings, numpy arrays, or Orbax's
    PLACEHOLDER for leaves to skip). Straight through the item's handler: no cross-process barrier,
    so a process whose read fails cannot leave the others waiting in one."""
    from etils import epath
    handler = array_handler()
    try:
        return handler.restore(epath.Path(path), args=array_restore(target))
    finally:
        handler.close()


def read_json_item(root: str, step: int, name: str) -> Any:
    with fs_of(root).open(f"{root}/{step}/{name}/metadata", "rb") as f:
        return json.loads(f.read())


def _nbytes(tree) -> int:
    import jax
    import numpy as np
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _as_saved(target, records, item: str):
    """`target` with the dtypes the arrays were saved in: the bytes read are checked as written,
    and cast afterwards (a run that changed weight_dtype)."""
    import jax
    import numpy as np

    def saved(path, leaf):
        dtype = records.dtype(checksums.name_of(path, item))
        if dtype is None or np.dtype(dtype) == np.dtype(leaf.dtype):
            return leaf
        if isinstance(leaf, np.ndarray):
            return np.zeros(leaf.shape, dtype)
        return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
    return jax.tree_util.tree_map_with_path(saved, target)


def _cast_to(restored, target):
    import jax
    return jax.tree.map(lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype), restored, target)


def restore_items(root: str, step: int, targets: dict[str, Any], verify: bool = True,
                  model: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restore the named items: array items onto their targets (ShapeDtypeStructs with shardings,
    or numpy arrays), JSON items (`data`) for a None target; `model`: the config (to_plain_dict) the
    params target was built from, named in the error when they do not fit. Every byte read is checked against
    the checkpoint's checksums (`maxlite.checkpoints.checksums`), and so is the `meta` item; a
    mismatch, or an error reading damaged bytes, raises CheckpointCorrupt naming the arrays.
    Collective in a multi-process run: every process checks what it read and all reach the same
    verdict."""
    where = f"{root}/{step}"
    fs = fs_of(root)
    missing = [name for name in targets if not fs.exists(f"{where}/{name}")]
    if missing:
        raise C.ConfigError(
            f"{where} holds parameters only (no {', '.join(missing)}); use load_parameters_path= for it"
            if "params" not in missing else f"{where} has no {', '.join(missing)}: not a maxlite checkpoint")
    records = checksums.read(root, step) if verify else None
    if "params" in targets:
        check_compatible(saved_tree(root, step, "params"), targets["params"], where, model)
    restored: dict[str, Any] = {}
    checking = []  # the CRCs of an item read run while the next item is read
    # what this process found: storage it could not reach, bytes it could not read (a damaged
    # file), bytes read that its checksums do not match, and its reads' parts of each shard's CRC
    outcome: dict[str, Any] = {"error": None, "unreadable": [], "detail": "", "mismatch": [], "pieces": {}}
    reading = ""
    # the biggest item first: the CRCs of each item run while the next is read, and the last
    # item's are what the restore waits for (optimizer before params: a third of the state)
    order = sorted(targets, key=lambda n: -_nbytes(targets[n]) if n in ARRAY_ITEMS else 0)
    try:
        for name in order:
            target, reading = targets[name], name
            if name in ARRAY_ITEMS:
                saved = _as_saved(target, records, name) if records is not None else target
                restored[name] = restore_array_item(f"{where}/{name}", saved)
                if records is not None:
                    checking.append(checksums.pieces(records, restored[name], name))
            else:
                restored[name] = read_json_item(root, step, name)
        if records is not None and "meta" in records.items and "meta" not in restored:
            reading = "meta"
            restored["meta"] = read_json_item(root, step, "meta")
    except Exception as e:  # noqa: BLE001 — damaged bytes, or storage we cannot reach
        names = checksums.damage_of(e)
        if names is None:
            outcome["error"] = str(storage_error(where, e))
        else:
            outcome["unreadable"] = names or [reading]
            outcome["detail"] = error_line(e)
    if records is not None and not outcome["error"] and not outcome["unreadable"]:
        for future in checking:
            got, unknown = future.result()
            outcome["pieces"].update(got)
            outcome["mismatch"].extend(unknown)
        outcome["mismatch"].extend(name for name in JSON_ITEMS if name in restored and name in records.items
                                   and checksums.json_crc(restored[name]) != records.items[name])
    _agree(where, records, outcome)
    return {name: _cast_to(restored[name], target) if name in ARRAY_ITEMS else restored[name]
            for name, target in targets.items()}


def _agree(where: str, records, outcome: dict) -> None:
    """Every process's outcome gathered (one small allgather), the same verdict raised everywhere."""
    import jax
    if jax.process_count() > 1:
        from maxlite.checkpoints.saver import gather_json
        outcomes = gather_json(outcome)
    else:
        outcomes = [outcome]
    errors = [o["error"] for o in outcomes if o["error"]]
    if errors:  # storage we could not reach: not the checkpoint's fault
        raise C.ConfigError(errors[0])
    unreadable = [name for o in outcomes for name in o["unreadable"]]
    if unreadable:
        raise checksums.CheckpointCorrupt(where, unreadable, next(o["detail"] for o in outcomes if o["detail"]))
    if records is not None:
        bad = [name for o in outcomes for name in o["mismatch"]]
        bad += checksums.damaged(records, [o["pieces"] for o in outcomes])
        if bad:
            raise checksums.CheckpointCorrupt(where, bad, "checksum mismatch")


def _read_error(where: str, e: BaseException, item: str) -> C.ConfigError:
    names = checksums.damage_of(e)
    if names is None:
        return storage_error(where, e)
    return checksums.CheckpointCorrupt(where, names or [item], error_line(e))


def sharded_target(abstract, shardings):
    import jax

    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
