"""Parameter loading and saving for the PyTorch bridge and Python users: no training loop needed."""

from __future__ import annotations

from maxlite import config as C
from maxlite.checkpoints import checksums
from maxlite.checkpoints.layout import (array_save, manager_options, maxlite_version, open_manager,
                                        resolve_step_dir)
from maxlite.checkpoints.restore import read_json_item, restore_items, saved_tree
from maxlite.checkpoints.storage import check_path, storage_error


def load_numpy(path: str, item: str, step: int | None = None):
    """One array item (`params`, `optimizer`) as saved, as host numpy arrays; no model config needed."""
    import jax
    import numpy as np

    root, step = resolve_step_dir(path, step)
    saved = saved_tree(root, step, item)
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), saved)
    return restore_items(root, step, {item: target})[item]


def load_params(path: str, cfg=None, step: int | None = None):
    """(cfg, params as an nnx.State of host numpy arrays) from a checkpoint dir or one step dir."""
    import numpy as np
    import jax
    from maxlite.state import abstract_params

    root, step = resolve_step_dir(path, step)
    if cfg is None:
        meta = verified_meta(root, step)
        if "config" not in meta:
            raise C.ConfigError(f"{root}/{step}: no saved config in its metadata; pass cfg=")
        cfg = C.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()
                          if k in C.Config.__dataclass_fields__})
    _, abstract = abstract_params(cfg)
    target = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    return cfg, restore_items(root, step, {"params": target}, model=C.to_plain_dict(cfg))["params"]


def verified_meta(root: str, step: int) -> dict:
    """The step's `meta` item, checked against its checksum before anything is built from it."""
    records = checksums.read(root, step)
    try:
        meta = read_json_item(root, step, "meta")
    except FileNotFoundError:
        return {}
    except ValueError:
        raise checksums.CheckpointCorrupt(f"{root}/{step}", ["meta"], "it does not parse") from None
    if records is not None and "meta" in records.items and checksums.json_crc(meta) != records.items["meta"]:
        raise checksums.CheckpointCorrupt(f"{root}/{step}", ["meta"], "checksum mismatch")
    return meta


def save_params(path: str, cfg, params, step: int = 0) -> str:
    """Write a params-only checkpoint (same layout) that `load_parameters_path=path` accepts."""
    import orbax.checkpoint as ocp
    from maxlite.state import nbytes

    path = C.resolve_path(path).rstrip("/")
    check_path(path)
    mngr = open_manager(path, manager_options(async_save=False))
    meta = {"step": step, "consumed_samples": 0, "tokens_seen": 0, "val_loss": None,
            "config": C.to_plain_dict(cfg), "maxlite_version": maxlite_version(),
            "params_only": True}
    record = checksums.record({"params": params}, {"meta": meta}, 0, 1)
    try:
        mngr.save(step, args=ocp.args.Composite(params=array_save(params, nbytes(params)),
                                                meta=ocp.args.JsonSave(meta),
                                                **{checksums.ITEM: checksums.save_args(record)}), force=True)
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
        raise storage_error(path, e) from None
    finally:
        mngr.close()
    return f"{path}/{step}"
