"""The on-disk format: one Orbax step directory per checkpoint, five items written together.

`<step>/params` (nnx.State), `<step>/optimizer` ({step, opt_state}), `<step>/data` (every
process's data-iterator state), `<step>/meta` (readable JSON: step, consumed samples, tokens
seen, val loss, resolved config, mesh, version) and `<step>/checksums` (one JSON record per
process: checksums.py). Arrays are zarr3 inside OCDBT. A step is complete
when Orbax finalised it (`_CHECKPOINT_METADATA` locally, `commit_success.txt` on GCS:
storage.complete_steps); anything else is incomplete, never restored, and removed at the next start.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import fsspec

from maxlite import config as C
from maxlite.checkpoints import checksums
from maxlite.checkpoints.storage import check_path, complete_steps, fs_of, quiet_orbax, storage_error


ITEMS = ("params", "optimizer", "data", "meta", "checksums")
TMP_STEP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
ASIDE_STEP = re.compile(r"^(\d+)\.corrupt-(\d+)$")  # a step kept aside (set_aside): never restored, never listed by Orbax


@functools.cache
def maxlite_version() -> str:
    """The installed maxlite's version (read once: ~3 ms of package metadata parsing per call)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("maxlite")
    except PackageNotFoundError:
        return "dev"


def _incomplete(path: str, fs, newest: int) -> list[tuple[str, str, int]]:
    """(entry, name, step) of every incomplete step: local tmp dirs, GCS steps without commit_success.txt.

    Saves run one after another, so an incomplete one is newer than every complete step; an older
    step is never called incomplete (a transient storage error could make a complete one look so)."""
    out = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        tmp = TMP_STEP.match(name)
        if tmp or (name.isdigit() and int(name) > newest and path.startswith("gs://")
                   and not fs.exists(f"{entry}/commit_success.txt")):
            out.append((entry, name, int(tmp.group(1) if tmp else name)))
    return out


def remove_failed_save(path: str, step: int) -> bool:
    """Delete what a failed save of `step` left behind; False when the storage will not let us."""
    try:
        fs = fs_of(path)
        for entry, _, s in _incomplete(path, fs, max(complete_steps(path), default=-1)):
            if s == step:
                fs.rm(entry, recursive=True)
        return True
    except Exception:  # noqa: BLE001 — the storage that failed the save may still be down
        return False


def set_aside(path: str, step: int) -> str:
    """Rename a complete step found corrupt to `<step>.corrupt-<unix time>` (kept, in case the damaged
    file was the checksum record and the weights are good; `python -m maxlite.checkpoints
    remove-corrupt PATH` deletes such steps); returns the new name."""
    import time

    fs = fs_of(path)
    name = f"{step}.corrupt-{int(time.time())}"
    fs.mv(f"{path}/{step}", f"{path}/{name}", recursive=True)
    return name


def aside_steps(path: str) -> list[str]:
    """The names of the steps kept aside in a checkpoint directory."""
    fs = fs_of(path)
    names = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False)] if fs.exists(path) else []
    return sorted(n for n in names if ASIDE_STEP.match(n))


def clean_leftovers(path: str, failed: dict[int, str] | None = None) -> list[tuple[str, str]]:
    """Delete incomplete steps; returns (directory name, what left it) for each.

    `failed` maps the steps whose saves an earlier attempt reported as failed (status.json's
    `checkpoint_failures`) to their error; any other incomplete step was being written when its
    process ended (killed, crashed, or lost its machine)."""
    fs = fs_of(path)
    if not fs.exists(path):
        return []
    removed = []
    for entry, name, step in _incomplete(path, fs, max(complete_steps(path), default=-1)):
        fs.rm(entry, recursive=True)
        why = (f"a save that failed ({failed[step]})" if failed and step in failed
               else "a save whose process ended while writing it (killed or crashed)")
        removed.append((name, why))
    return removed


def temporary_path_with_hook(path: str, before_commit):
    """Orbax's own temporary-path class for `path` (rename on local disk, commit file on gs://),
    calling `before_commit(step)` after every file of the step is written and before it is made
    complete — through Orbax's `temporary_path_class` option, not by patching Orbax."""
    from etils import epath
    from orbax.checkpoint._src.path import atomicity_defaults

    base = atomicity_defaults.get_default_temporary_path_class(epath.Path(path))

    class HookedTemporaryPath(base):
        async def finalize(self, *args, **kwargs):
            name = self._final_path.name
            if name.isdigit():
                before_commit(int(name))
            return await super().finalize(*args, **kwargs)

    return HookedTemporaryPath


def manager_options(cfg=None, read_only: bool = False, async_save: bool = True):
    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_managers as pol

    if read_only or cfg is None:
        return ocp.CheckpointManagerOptions(read_only=read_only, enable_async_checkpointing=async_save,
                                            create=not read_only,
                                            save_interval_steps=0 if read_only else 1)  # else Orbax warns
    latest = pol.LatestN(cfg.max_num_checkpoints_to_keep or None)  # 0 → keep all
    policy, best_fn = latest, None
    if cfg.checkpoint_keep_best_k > 0:
        # best_fn only makes Orbax persist (and re-read after a restart) the metrics BestN ranks by.
        best_fn = lambda m: m["val_loss"]  # noqa: E731
        # NeMo's save_top_k + save_last: the k lowest val losses, plus the latest ones.
        best = pol.BestN(get_metric_fn=lambda m: m["val_loss"], reverse=True,
                         n=cfg.checkpoint_keep_best_k, keep_checkpoints_without_metrics=False)
        policy = pol.AnyPreservationPolicy([latest, best])
    return ocp.CheckpointManagerOptions(
        enable_async_checkpointing=cfg.async_checkpointing and async_save, preservation_policy=policy,
        # Directories made inside save(): a failed mkdir then fails that save at once, instead of
        # leaving writer threads waiting (up to 20 min) for a signal that never comes. It costs
        # the loop ~1 ms per local save (benchmarks/bench_checkpoint.py, docs/checkpoints.md).
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        best_fn=best_fn, best_mode="min", cleanup_tmp_directories=True)


@functools.cache
def _register_array_handler() -> None:
    """Replica-parallel saving splits every replicated array between its replicas with one jitted
    slice per shape. For our replicated leaves (norm scales, step: a few KiB) that split buys
    nothing and costs ~0.6 s of XLA compiles inside the first save's blocking part (then a dispatch
    per slice on every save); only arrays whose per-replica part is >= 1 MiB (pure data
    parallelism's big replicated arrays) are still split. Orbax offers this knob only through its
    type-handler registry; the array metadata store is the one its default jax.Array handler has."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata import array_metadata_store  # pinned: orbax <0.13

    from absl import logging as absl_logging

    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # the "overriding jax.Array" warning is this, on purpose
    try:
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            array_metadata_store=array_metadata_store.Store(), min_slice_bytes_for_replica_parallel=1 << 20),
            override=True)
    finally:
        absl_logging.set_verbosity(level)


# Array items are written as zarr3 arrays inside OCDBT (few objects on gs://), uncompressed, into
# data files of about 1/32 of a process's state (16 MiB..400 MiB): a trained state is near-random
# floats that zstd shrinks by ~8% at 2.5x the save time, and one 2 GiB data file (Orbax's local
# default) is written by one thread. On this project's 2-core VM a 0.8 GiB save went from
# 0.87 to 2.5 GB/s (benchmarks/bench_checkpoint.py; docs/checkpoints.md). Restores read whatever
# format a checkpoint was written in (older zarr2+zstd ones included).
_DATA_FILES_PER_PROCESS = 32
_DATA_FILE_BYTES = (16 << 20, 400 << 20)


def data_file_bytes(process_state_bytes: int) -> int:
    """OCDBT target data-file size for a process saving `process_state_bytes`."""
    low, high = _DATA_FILE_BYTES
    return int(min(max(process_state_bytes // _DATA_FILES_PER_PROCESS, low), high))


def array_save(tree, process_state_bytes: int):
    """Orbax save args for an array item (params, optimizer)."""
    import orbax.checkpoint as ocp
    return ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=data_file_bytes(process_state_bytes))


def array_restore(target):
    """Orbax restore args: every leaf restored as its target (sharded jax.Array, or numpy)."""
    import orbax.checkpoint as ocp
    return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def array_handler():
    """The handler of an array item (params, optimizer)."""
    import orbax.checkpoint as ocp
    _register_array_handler()
    quiet_orbax()
    return ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False)


def open_manager(path: str, options):
    import orbax.checkpoint as ocp

    handlers = {"params": array_handler(), "optimizer": array_handler(),
                "data": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                checksums.ITEM: checksums.handler()}
    try:
        return ocp.CheckpointManager(path, options=options, item_handlers=handlers)
    except Exception as e:  # noqa: BLE001
        raise storage_error(path, e) from None


def resolve_step_dir(path: str, step: int | None = None) -> tuple[str, int]:
    """(checkpoint root, step) for a run's checkpoint dir (latest step unless given) or one step dir."""
    path = C.resolve_path(path).rstrip("/")
    check_path(path, must_exist=True)
    fs = fs_of(path)
    head, _, tail = path.rpartition("/")
    if tail.isdigit() and fs.exists(f"{path}/_CHECKPOINT_METADATA"):
        return head, int(tail)
    steps = complete_steps(path)
    if not steps:
        raise C.ConfigError(f"{path}: no complete checkpoint there "
                            f"(see `python -m maxlite.checkpoints list {path}`)")
    if step is None:
        return path, steps[-1]
    if step not in steps:
        raise C.ConfigError(f"{path}: no complete checkpoint at step {step}; complete steps: {steps}")
    return path, step


def read_meta(root: str, step: int) -> dict[str, Any]:
    try:
        with fsspec.open(f"{root}/{step}/meta/metadata", "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
