"""The run directory `{base_output_directory}/{run_name}/`: resolved config and status.json.

status.json tells launchers (Slurm requeue, Ray restarts, `maxlite.launch status`) what happened:
state = running | finished | preempted | failed, with the step reached, and once the attempt ends
its exit code and `next` (done | requeue | restart | fail: `resilience.exit_codes.next_action`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import fsspec

from maxlite import config as C


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
    def __init__(self, cfg, primary: bool):
        self.path, self.primary = cfg.run_dir, primary
        self.sticky: dict[str, Any] = {}  # fields every later status.json of this attempt repeats
        if not primary:
            return
        fs, _, _ = fsspec.get_fs_token_paths(self.path)
        try:
            fs.makedirs(self.path, exist_ok=True)
        except (PermissionError, OSError) as e:
            raise C.ConfigError(f"cannot create run directory {self.path}: {e}") from None
        write_text(f"{self.path}/config.yml", C.to_yaml(cfg))

    def set_status(self, state: str, **fields: Any) -> None:
        if not self.primary:
            return
        record = {"state": state, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  **self.sticky, **fields}
        if "exit_code" in fields:  # what every launcher does next: the one rule, answered here
            from maxlite.resilience import exit_codes  # (the resilience package imports this module)
            record["next"] = exit_codes.next_action(fields["exit_code"], record)
        text = json.dumps(record, indent=1, default=str)
        write_text(f"{self.path}/status.json", text)
        launch_dir = os.environ.get("MAXLITE_EXPERIMENT_DIR")  # set by the Slurm launcher's batch script
        if launch_dir:  # a local copy it reads with bash, wherever the run directory is (gs:// too)
            write_text(f"{launch_dir}/run_status.json", text)

    def append_jsonl(self, name: str, record: dict[str, Any]) -> None:
        """One line more in `{run_dir}/name`, from the primary only."""
        if self.primary:
            append_jsonl(f"{self.path}/{name}", record)


def read_status(run_dir: str) -> dict[str, Any] | None:
    try:
        with fsspec.open(f"{run_dir}/status.json", "r") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
