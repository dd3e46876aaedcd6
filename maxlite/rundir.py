"""The run directory `{base_output_directory}/{run_name}/`: resolved config, status.json and the
run's other files (every write goes through here or maxlite.checkpoints).

status.json tells launchers (Slurm requeue, Ray restarts, `maxlite.launch status`) what happened:
state = running | finished | preempted | stopped | failed, with the step reached, and once the
attempt ends its exit code, `next` and `reason` (maxlite.outcome decides them).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import fsspec

from maxlite import config as C


def make_dir(path: str) -> None:
    """Create the run directory (and its parents); a path the user cannot have (a regular file on
    the way, no permission) is their mistake: one line."""
    fs, _, _ = fsspec.get_fs_token_paths(path)
    try:
        fs.makedirs(path, exist_ok=True)
    except OSError as e:
        raise C.ConfigError(f"cannot create run directory {path}: {e.strerror or e}") from None


def set_aside(run_dir: str, keep: tuple[str, ...], now: float | None = None) -> str:
    """Move what an earlier run left in `run_dir` (its config, status, metrics, goodput and restart
    count, TensorBoard files: all but `keep` and the checkpoints) into `run_dir/replaced-<UTC time>/`,
    so that a run replacing it neither appends to nor counts the earlier run's records; the folder."""
    fs = fsspec.get_fs_token_paths(run_dir)[0]
    fs.invalidate_cache()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    aside = f"{run_dir.rstrip('/')}/replaced-{stamp}"
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(run_dir, detail=False)]
    moved = [n for n in names if n not in keep and n != "checkpoints" and not n.startswith("replaced-")]
    fs.makedirs(aside, exist_ok=True)
    for name in moved:
        fs.mv(f"{run_dir.rstrip('/')}/{name}", f"{aside}/{name}", recursive=True)
    return aside


def print_primary(primary: bool, line: str, err: bool = False) -> None:
    """A progress line from process 0 only (an error line from every process, to stderr)."""
    if primary or err:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)


def write_text(path: str, text: str) -> None:
    """Whole-file write; atomic on local disk (readers never see half a file)."""
    write_bytes(path, text.encode())


def write_bytes(path: str, data: bytes) -> None:
    """Whole-file write; atomic on local disk, one object on gs:// (readers never see half a file)."""
    if "://" in path:
        with fsspec.open(path, "wb") as f:
            f.write(data)
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    """One JSON line more in `path`; on gs:// the object is rewritten whole (no appends there)."""
    line = json.dumps(record, default=str) + "\n"
    if "://" not in path:
        with open(path, "a") as f:
            f.write(line)
        return
    fs, _, _ = fsspec.get_fs_token_paths(path)
    write_bytes(path, (fs.cat_file(path) if fs.exists(path) else b"") + line.encode())


class RunDir:
    def __init__(self, cfg, primary: bool, on_status: Callable[[str], None] | None = None):
        """`on_status(text)`: a launcher's copy of every status.json written (Slurm's batch script
        reads a local one)."""
        self.path, self.primary, self.on_status = cfg.run_dir, primary, on_status
        self.sticky: dict[str, Any] = {}  # fields every later status.json of this attempt repeats
        if not primary:
            return
        make_dir(self.path)
        write_text(f"{self.path}/config.yml", C.to_yaml(cfg))

    def set_status(self, state: str, outcome=None, **fields: Any) -> None:
        """status.json: `state` and `fields`; once the attempt ends, its `outcome` (maxlite.outcome)."""
        if not self.primary:
            return
        if outcome is not None:
            state, fields = outcome.state, {**fields, **outcome.fields()}
        record = {"state": state, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  **self.sticky, **fields}
        text = json.dumps(record, indent=1, default=str)
        write_text(f"{self.path}/status.json", text)
        if self.on_status is not None:
            self.on_status(text)

    def append_jsonl(self, name: str, record: dict[str, Any]) -> None:
        """One line more in `{run_dir}/name`, from the primary only."""
        if self.primary:
            append_jsonl(f"{self.path}/{name}", record)

    def write_file(self, name: str, data: bytes) -> None:
        """`{run_dir}/name`, whole, from the primary only (a reader never sees half a file)."""
        if self.primary:
            write_bytes(f"{self.path}/{name}", data)

    def read_file(self, name: str) -> bytes | None:
        """`{run_dir}/name` as written, or None when there is none (every process may read)."""
        try:
            with fsspec.open(f"{self.path}/{name}", "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None


def status_copy() -> Callable[[str], None] | None:
    """Where a launcher asked for a local copy of every status.json (MAXLITE_EXPERIMENT_DIR, set by
    the Slurm batch script, which reads it wherever the run directory is, gs:// too): the callable
    that keeps it; None elsewhere."""
    launch_dir = os.environ.get("MAXLITE_EXPERIMENT_DIR")
    if not launch_dir:
        return None
    return lambda text: write_text(f"{launch_dir}/run_status.json", text)


def read_status(run_dir: str) -> dict[str, Any] | None:
    try:
        with fsspec.open(f"{run_dir}/status.json", "r") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
