"""Restoring items of a step onto any mesh, with one-line errors for a checkpoint of another model."""

from __future__ import annotations

from typing import Any

from maxlite import config as C
from maxlite.checkpoints.layout import manager_options, open_manager, array_restore
from maxlite.checkpoints.storage import fs_of, storage_error


def _flat_shapes(tree) -> dict[str, tuple]:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        if keys and keys[-1] == "value":
            keys = keys[:-1]
        out["/".join(keys)] = tuple(leaf.shape)
    return out


def check_compatible(saved_meta_tree, target, where: str) -> None:
    """A one-line error naming the first parameter whose shape differs (or that is missing)."""
    saved, want = _flat_shapes(saved_meta_tree), _flat_shapes(target)
    for name, shape in want.items():
        if name not in saved:
            raise C.ConfigError(f"checkpoint {where} has no parameter '{name}' that this model "
                                f"needs: it was saved from a different model; check model_name")
        if saved[name] != shape:
            raise C.ConfigError(f"checkpoint {where} does not fit this model: parameter '{name}' is "
                                f"{saved[name]} there but {shape} here; check model_name and the model keys")
    extra = sorted(set(saved) - set(want))
    if extra:
        raise C.ConfigError(f"checkpoint {where} has parameter '{extra[0]}' that this model lacks: "
                            f"it was saved from a different model; check model_name")


def restore_items(root: str, step: int, targets: dict[str, Any]) -> dict[str, Any]:
    """Restore the named items; array targets are ShapeDtypeStructs (with shardings) or numpy arrays."""
    import orbax.checkpoint as ocp

    fs = fs_of(root)
    missing = [name for name in targets if not fs.exists(f"{root}/{step}/{name}")]
    if missing:
        raise C.ConfigError(
            f"{root}/{step} holds parameters only (no {', '.join(missing)}); use load_parameters_path= for it"
            if "params" not in missing else f"{root}/{step} has no {', '.join(missing)}: not a maxlite checkpoint")
    mngr = open_manager(root, manager_options(read_only=True))
    try:
        if "params" in targets:
            check_compatible(mngr.item_metadata(step)["params"], targets["params"], f"{root}/{step}")
        args = {name: (ocp.args.JsonRestore() if name in ("data", "meta") else array_restore(t))
                for name, t in targets.items()}
        try:
            return dict(mngr.restore(step, args=ocp.args.Composite(**args)).items())
        except C.ConfigError:
            raise
        except Exception as e:  # noqa: BLE001
            raise storage_error(f"{root}/{step}", e) from None
    finally:
        mngr.close()


def sharded_target(abstract, shardings):
    import jax

    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
