"""Checkpoint storage, local or gs://: one-line user errors, access checks, the steps it holds
complete, quiet Orbax logs."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
import tempfile

import fsspec

from maxlite.schema import ConfigError


def checkpoint_dir(cfg) -> str:
    """Where a run's checkpoints go (absolute or gs://: config paths are resolved when loaded)."""
    return checkpoint_root(cfg.checkpoint_dir, cfg.run_dir)


def checkpoint_root(checkpoint_dir: str, run_dir: str) -> str:
    """Where the checkpoints of a run with these two keys' values go (a saved config.yml's too)."""
    return checkpoint_dir.rstrip("/") or f"{run_dir}/checkpoints"


def fs_of(path: str):
    """The filesystem of `path`, with no stale listing (gcsfs caches directory listings)."""
    fs, _, _ = fsspec.get_fs_token_paths(path)
    fs.invalidate_cache()
    return fs


def complete_steps(path: str) -> list[int]:
    """The steps under a checkpoint root that Orbax finalised (maxlite/checkpoints/layout.py)."""
    fs = fs_of(path)
    steps = []
    for entry in fs.ls(path, detail=False) if fs.exists(path) else []:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.isdigit() and fs.exists(f"{entry}/commit_success.txt" if path.startswith("gs://")
                                        else f"{entry}/_CHECKPOINT_METADATA"):
            steps.append(int(name))
    return sorted(steps)


def storage_error(path: str, e: BaseException) -> ConfigError:
    """The one-line user error for a storage failure at `path` (never echoes credentials)."""
    name = type(e).__name__
    text = str(e).splitlines()[0] if str(e) else name
    code = getattr(e, "code", None)  # google.api_core exceptions carry the HTTP status
    if code is None:
        found = re.search(r"(?<![\d:.])(40[134])(?![\d.])", text)  # not inside a port or an address
        code = int(found.group(1)) if found else None
    if name in ("Forbidden", "PermissionError", "Unauthorized") or code in (401, 403):
        return ConfigError(f"no permission to use {path}: grant the job's service account "
                             f"storage access (roles/storage.objectAdmin) or pick another path")
    if name == "NotFound" or code == 404 or "bucket does not exist" in text.lower():
        return ConfigError(f"{path}: bucket or path does not exist; create it first "
                             f"(gcloud storage buckets create gs://BUCKET) or fix the path")
    return ConfigError(f"cannot use checkpoint path {path}: {name}: {text[:300]}")


def error_chain(e: BaseException) -> list[BaseException]:
    out = []
    while e is not None and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def error_line(e: BaseException) -> str:
    """An error in short: tensorstore's status code and its last clause (`RESOURCE_EXHAUSTED: Failed
    to write 4472832 bytes to file 27: No space left on device`), else the first line."""
    chain = error_chain(e)
    text = next((str(x) for x in chain if re.search(r"\b[A-Z]+_[A-Z_]+: ", str(x))), str(chain[-1]))
    text = (text.splitlines() or [""])[0].split(" [tensorstore_spec=")[0].split(" [source locations=")[0]
    code = re.search(r"\b([A-Z]+_[A-Z_]+): ", text)
    tail = text.rsplit('": ', 1)[-1]
    return (f"{code.group(1)}: {tail}" if code and not tail.startswith(code.group(1)) else tail)[:300]


def check_storage(cfg) -> None:
    """Before the run directory is made: the gs:// buckets it and the checkpoints use exist and are
    ours; a local one has no regular file on its way (reads only)."""
    for path in dict.fromkeys((cfg.run_dir, checkpoint_dir(cfg))):
        if path.startswith("gs://"):
            check_bucket(path)
        elif "://" not in path:
            on_the_way = path
            while not os.path.exists(on_the_way):
                on_the_way = os.path.dirname(on_the_way)
            if not os.path.isdir(on_the_way):
                raise ConfigError(f"cannot create {path}: {on_the_way} is a file, not a directory; set "
                                    f"base_output_directory= (or checkpoint_dir=) to a directory")


def check_bucket(path: str) -> None:
    bucket = path[5:].split("/", 1)[0]
    if not bucket:
        raise ConfigError(f"{path}: a gs:// path needs a bucket name (gs://BUCKET/dir)")
    try:
        from google.cloud import storage
        storage.Client().get_bucket(bucket)  # 404 / 403 tell the two user mistakes apart
    except Exception as e:  # noqa: BLE001 — turned into one user-facing line
        raise storage_error(f"gs://{bucket}", e) from None


def check_path(path: str, must_exist: bool = False) -> None:
    """Fail fast, before any training, when `path` cannot hold (or hold no) checkpoints."""
    if path.startswith("gs://"):
        check_bucket(path)
    elif "://" in path:
        raise ConfigError(f"{path}: checkpoints support local paths and gs:// only")
    fs = fs_of(path)
    if must_exist and not fs.exists(path):
        raise ConfigError(f"{path}: no such checkpoint directory")
    if not path.startswith("gs://") and not must_exist:
        try:
            os.makedirs(path, exist_ok=True)
            # a name of its own: every process of a several-host import (save_streamed) probes the one
            # (shared) directory at once, and one whose probe of a shared name a peer had removed failed
            # with ENOENT (2 processes: process 0 said "cannot write", its peer waited in Orbax's barrier)
            fd, probe = tempfile.mkstemp(prefix=".maxlite-write-probe-", dir=path)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"cannot write checkpoints to {path}: {e.strerror}; "
                                f"set checkpoint_dir= or base_output_directory= to a writable path") from None


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def check_room(path: str, checkpoint_bytes: int, keep: int, saves: int) -> str | None:
    """Before the first save to a local path: a ConfigError when not even one checkpoint of
    `checkpoint_bytes` fits in the free space (no save of this run could succeed); a warning line
    when the most the retention holds at once (`keep` complete ones and one being written; all
    `saves` when keep is 0) will not fit, counting what the retention will delete. On gs:// there
    is no free space to ask: the first write's failure is the check."""
    gib = 2**30
    need = int(checkpoint_bytes * 1.01) + (1 << 20)  # + Orbax's metadata and the JSON items
    free = shutil.disk_usage(path).free
    if free < need:
        raise ConfigError(f"{path} has {free / gib:,.2f} GiB free but one checkpoint of this state takes "
                            f"~{need / gib:,.2f} GiB: no save can succeed; free space, set checkpoint_dir= to a "
                            f"larger disk, or enable_checkpointing=false")
    held = min(keep + 1, saves) if keep else saves
    room = free + (_du(path) if keep else 0)  # the retention deletes this run's older ones
    if room < held * need:
        fits = room // need
        return (f"maxlite: warning: {path} has {free / gib:,.2f} GiB free: this run holds up to {held} checkpoints "
                f"of ~{need / gib:,.2f} GiB at once (max_num_checkpoints_to_keep={keep}, one more while a save "
                f"runs) but only {fits} fit: a later save will fail (disk full) unless space is freed")
    return None


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


def _closed_loop_callback(unraisable) -> bool:
    """A tensorstore future that completes after Orbax's event loop has closed (the other writes
    or reads of a save or restore that already failed) calls back into that closed loop: the error
    is already reported, this only adds a traceback per pending chunk (~20 on a full disk)."""
    e = unraisable.exc_value
    if not isinstance(e, RuntimeError) or str(e) != "Event loop is closed":
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


@functools.cache
def quiet_orbax() -> None:
    logging.getLogger("absl").addFilter(_OrbaxNoise())
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _closed_loop_callback(unraisable):
            previous(unraisable)
    sys.unraisablehook = hook
