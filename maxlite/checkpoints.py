"""Orbax checkpoints, local or gs://: save (async), retention, resume, params-only load, listing.

One `ocp.CheckpointManager` writes four items per step, together and crash-consistently:
`params` (nnx.State), `optimizer` ({step, opt_state}), `data` (every process's data-iterator
state, gathered: a resumed run sees the very batch it would have seen next) and `meta` (readable
JSON: step, consumed samples, tokens seen, val loss, resolved config, mesh, version).
A save killed half-way leaves `<step>.orbax-checkpoint-tmp*` (local) or a step without
`commit_success.txt` (GCS); Orbax never picks those, and the next start deletes them.

    python -m maxlite.checkpoints list PATH     # PATH: a checkpoint dir, local or gs://
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from typing import Any

import fsspec

from maxlite import config as C

ITEMS = ("params", "optimizer", "data", "meta")
TMP_STEP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


def checkpoint_dir(cfg) -> str:
    return cfg.checkpoint_dir.rstrip("/") or f"{cfg.run_dir}/checkpoints"


@functools.cache
def maxlite_version() -> str:
    """The installed maxlite's version (read once: ~3 ms of package metadata parsing per call)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("maxlite")
    except PackageNotFoundError:
        return "dev"


def fs_of(path: str):
    """The filesystem of `path`, with no stale listing (gcsfs caches directory listings)."""
    fs, _, _ = fsspec.get_fs_token_paths(path)
    fs.invalidate_cache()
    return fs


# ---------------------------------------------------------------- storage checks and errors

def storage_error(path: str, e: BaseException) -> C.ConfigError:
    """The one-line user error for a storage failure at `path` (never echoes credentials)."""
    name = type(e).__name__
    text = str(e).splitlines()[0] if str(e) else name
    code = getattr(e, "code", None)  # google.api_core exceptions carry the HTTP status
    if code is None:
        found = re.search(r"(?<![\d:.])(40[134])(?![\d.])", text)  # not inside a port or an address
        code = int(found.group(1)) if found else None
    if name in ("Forbidden", "PermissionError", "Unauthorized") or code in (401, 403):
        return C.ConfigError(f"no permission to use {path}: grant the job's service account "
                             f"storage access (roles/storage.objectAdmin) or pick another path")
    if name == "NotFound" or code == 404 or "bucket does not exist" in text.lower():
        return C.ConfigError(f"{path}: bucket or path does not exist; create it first "
                             f"(gcloud storage buckets create gs://BUCKET) or fix the path")
    return C.ConfigError(f"cannot use checkpoint path {path}: {name}: {text[:300]}")


def check_storage(cfg) -> None:
    """Before the run directory is made: the gs:// buckets it and the checkpoints use exist and are ours."""
    for path in dict.fromkeys((cfg.run_dir, checkpoint_dir(cfg))):
        if path.startswith("gs://"):
            check_bucket(path)


def check_bucket(path: str) -> None:
    bucket = path[5:].split("/", 1)[0]
    if not bucket:
        raise C.ConfigError(f"{path}: a gs:// path needs a bucket name (gs://BUCKET/dir)")
    try:
        from google.cloud import storage
        storage.Client().get_bucket(bucket)  # 404 / 403 tell the two user mistakes apart
    except Exception as e:  # noqa: BLE001 — turned into one user-facing line
        raise storage_error(f"gs://{bucket}", e) from None


def load_numpy(path: str, item: str, step: int | None = None):
    """One array item (`params`, `optimizer`) as saved, as host numpy arrays; no model config needed."""
    import jax
    import numpy as np

    root, step = resolve_step_dir(path, step)
    mngr = open_manager(root, manager_options(read_only=True))
    try:
        saved = mngr.item_metadata(step)[item]
    finally:
        mngr.close()
    if saved is None:
        raise C.ConfigError(f"{root}/{step} has no item {item!r}")
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), saved)
    return restore_items(root, step, {item: target})[item]


def check_path(path: str, must_exist: bool = False) -> None:
    """Fail fast, before any training, when `path` cannot hold (or hold no) checkpoints."""
    if path.startswith("gs://"):
        check_bucket(path)
    elif "://" in path:
        raise C.ConfigError(f"{path}: checkpoints support local paths and gs:// only")
    fs = fs_of(path)
    if must_exist and not fs.exists(path):
        raise C.ConfigError(f"{path}: no such checkpoint directory")
    if not path.startswith("gs://") and not must_exist:
        import os
        try:
            os.makedirs(path, exist_ok=True)
            probe = f"{path}/.maxlite-write-probe"
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise C.ConfigError(f"cannot write checkpoints to {path}: {e.strerror}; "
                                f"set checkpoint_dir= or base_output_directory= to a writable path") from None


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


# ---------------------------------------------------------------- the manager

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


class _OrbaxNoise(logging.Filter):
    """Orbax log records that tell a maxlite user nothing: the read-only notices of every load and
    export, and the tracebacks of a failed save, which the Checkpointer reports itself in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname:
            return True
        text = record.getMessage()
        if record.levelno == logging.WARNING and ("read_only" in text or "read only" in text):
            return False
        return not (record.levelno >= logging.ERROR and (record.exc_info or "raised an exception" in text))


@functools.cache
def _quiet_orbax() -> None:
    logging.getLogger("absl").addFilter(_OrbaxNoise())


def open_manager(path: str, options):
    import orbax.checkpoint as ocp
    _register_array_handler()
    _quiet_orbax()
    arrays = lambda: ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False)  # noqa: E731
    handlers = {"params": arrays(), "optimizer": arrays(),
                "data": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
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


def complete_steps(path: str) -> list[int]:
    fs = fs_of(path)
    steps = []
    for entry in fs.ls(path, detail=False) if fs.exists(path) else []:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.isdigit() and fs.exists(f"{entry}/commit_success.txt" if path.startswith("gs://")
                                        else f"{entry}/_CHECKPOINT_METADATA"):
            steps.append(int(name))
    return sorted(steps)


def read_meta(root: str, step: int) -> dict[str, Any]:
    try:
        with fsspec.open(f"{root}/{step}/meta/metadata", "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


# ---------------------------------------------------------------- restore helpers

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


# ---------------------------------------------------------------- PyTorch bridge API

def load_params(path: str, cfg=None, step: int | None = None):
    """(cfg, params as an nnx.State of host numpy arrays) from a checkpoint dir or one step dir."""
    import numpy as np
    import jax
    from maxlite.state import abstract_params

    root, step = resolve_step_dir(path, step)
    if cfg is None:
        meta = read_meta(root, step)
        if "config" not in meta:
            raise C.ConfigError(f"{root}/{step}: no saved config in its metadata; pass cfg=")
        cfg = C.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()
                          if k in C.Config.__dataclass_fields__})
    _, abstract = abstract_params(cfg)
    target = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    return cfg, restore_items(root, step, {"params": target})["params"]


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
    try:
        mngr.save(step, args=ocp.args.Composite(params=array_save(params, nbytes(params)),
                                                meta=ocp.args.JsonSave(meta)), force=True)
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
        raise storage_error(path, e) from None
    finally:
        mngr.close()
    return f"{path}/{step}"


# ---------------------------------------------------------------- listing

def checkpoint_name(meta: dict[str, Any], step: int) -> str:
    """NeMo-like: step=50000-consumed_samples=25600000-val_loss=1.76."""
    name = f"step={step}-consumed_samples={meta.get('consumed_samples', '?')}"
    if meta.get("val_loss") is not None:
        name += f"-val_loss={meta['val_loss']:.2f}"
    return name


def list_checkpoints(path: str) -> list[dict[str, Any]]:
    path = C.resolve_path(path).rstrip("/")
    fs = fs_of(path)
    if not fs.exists(path):
        raise C.ConfigError(f"{path}: no such checkpoint directory")
    complete = set(complete_steps(path))
    rows = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        tmp = TMP_STEP.match(name)
        if not (name.isdigit() or tmp):
            continue
        step = int(tmp.group(1) if tmp else name)
        ok = bool(not tmp and step in complete)
        meta = read_meta(path, step) if ok else {}
        rows.append({"step": step, "name": checkpoint_name(meta, step), "dir": name,
                     "bytes": fs.du(entry), "complete": ok, **{k: meta.get(k) for k in
                     ("consumed_samples", "tokens_seen", "val_loss")}})
    return sorted(rows, key=lambda r: (r["step"], r["complete"]))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "list":
        print("usage: python -m maxlite.checkpoints list PATH   (a checkpoint dir, local or gs://)",
              file=sys.stderr)
        return 2
    try:
        rows = list_checkpoints(argv[1])
    except C.ConfigError as e:
        print(f"maxlite: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        print(f"maxlite: error: {storage_error(argv[1], e)}", file=sys.stderr)
        return 2
    if not rows:
        print(f"no checkpoints in {argv[1]}")
    for r in rows:
        state = "complete" if r["complete"] else "INCOMPLETE (ignored; removed at the next start)"
        print(f"{r['name']:<56} {_human(r['bytes']):>11}  {state}  [{r['dir']}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
