"""`python -m maxlite.checkpoints verify PATH [STEP]`: every array of a step read back and checked
against the checksums written with it, one array at a time (host memory for the largest array
only); a damaged step is marked corrupt (`list` shows it, a resume never restores it)."""

from __future__ import annotations

import time
from typing import Any

from maxlite import config as C
from maxlite.checkpoints import checksums
from maxlite.checkpoints.layout import resolve_step_dir
from maxlite.checkpoints.restore import ARRAY_ITEMS, JSON_ITEMS, read_json_item, restore_array_item, saved_tree
from maxlite.checkpoints.storage import complete_steps, error_line, fs_of


def _leaf_target(tree, index: int):
    """The item's tree with numpy zeros at leaf `index` and Orbax's skip marker everywhere else."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    flat, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [np.zeros(m.shape, m.dtype) if i == index else ocp.PLACEHOLDER for i, m in enumerate(flat)])


def verify_step(root: str, step: int) -> dict[str, Any]:
    """{step, verified, damaged: {name: why}, arrays, bytes, seconds}; `verified` False when the
    step was written without checksums."""
    import jax

    where, start = f"{root}/{step}", time.perf_counter()
    try:
        records = checksums.read(root, step)
    except checksums.CheckpointCorrupt as e:
        return {"step": step, "verified": True, "damaged": {n: e.detail for n in e.damaged}, "arrays": 0,
                "bytes": 0, "seconds": time.perf_counter() - start}
    if records is None:
        return {"step": step, "verified": False, "damaged": {}, "arrays": 0, "bytes": 0, "seconds": 0.0}
    fs = fs_of(root)
    damaged: dict[str, str] = {}
    seen: set[str] = set()
    arrays = nbytes = 0
    for item in ARRAY_ITEMS:
        if not fs.exists(f"{where}/{item}"):
            continue
        try:
            tree = saved_tree(root, step, item)
        except checksums.CheckpointCorrupt as e:
            damaged.update({n: e.detail for n in e.damaged})
            continue
        for index, (path, meta) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
            name = checksums.name_of(path, item)
            seen.add(name)
            try:
                got = restore_array_item(f"{where}/{item}", _leaf_target(tree, index))
            except Exception as e:  # noqa: BLE001 — each array's own verdict
                if checksums.damage_of(e) is None:
                    raise
                damaged[name] = error_line(e)
                continue
            pieces, unknown = checksums.pieces(records, got, item).result()
            for bad in [*unknown, *checksums.damaged(records, [pieces])]:
                damaged[bad] = "checksum mismatch" if bad not in unknown else "no checksum recorded"
            arrays += 1
            nbytes += sum(leaf.nbytes for _, leaf in checksums.leaves(got, item))
    damaged.update({n: "recorded but not in the checkpoint" for n in set(records.arrays) - seen - set(damaged)})
    for item in JSON_ITEMS:
        if item not in records.items:
            continue
        try:
            if checksums.json_crc(read_json_item(root, step, item)) != records.items[item]:
                damaged[item] = "checksum mismatch"
        except (ValueError, FileNotFoundError) as e:
            damaged[item] = f"unreadable: {type(e).__name__}"
    return {"step": step, "verified": True, "damaged": damaged, "arrays": arrays, "bytes": nbytes,
            "seconds": time.perf_counter() - start}


def run(path: str, step: int | None = None) -> list[dict[str, Any]]:
    """Verify one step, or every complete step of a checkpoint directory; marks the corrupt ones
    (and clears the mark of a step that now verifies intact)."""
    path = C.resolve_path(path).rstrip("/")
    if step is None:
        root, _ = resolve_step_dir(path)  # one-line errors for a missing or empty directory
        steps = complete_steps(root) if root == path else [resolve_step_dir(path)[1]]
    else:
        root, _ = resolve_step_dir(path, step)
        steps = [step]
    results = []
    for s in steps:
        result = verify_step(root, s)
        if result["damaged"]:
            detail = "; ".join(f"{n}: {why}" for n, why in sorted(result["damaged"].items())[:3])
            err = checksums.CheckpointCorrupt(f"{root}/{s}", list(result["damaged"]), detail)
            checksums.mark(root, s, err, by="verify")
        elif result["verified"] and checksums.marker(root, s) is not None:
            fs_of(root).rm(f"{root}/{s}/{checksums.MARKER}")
        results.append(result)
    return results
