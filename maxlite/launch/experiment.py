"""Experiment directories: `$MAXLITE_HOME/experiments/NAME/NAME_TIMESTAMP/`, one per launch.

A launch directory holds what a user needs to find a job again, NeMo-style:

    sbatch.sh          the exact script that was submitted
    experiment.json    launch metadata written once (command, job id, partition, paths)
    status.json        the job's own record, rewritten by sbatch.sh at each attempt's start and end
    log-NAME_<job>.out stdout+stderr of every attempt (--open-mode=append keeps requeued attempts)
    cancelled          present once `python -m maxlite.launch cancel` asked for a cancel
    runs/NAME/         the trainer's run directory, unless base_output_directory was given
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import time
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class LaunchError(ValueError):
    """A user mistake at launch time (bad name, partition, missing Slurm); printed as one line."""


def home() -> pathlib.Path:
    """The root of all experiments: $MAXLITE_HOME, default ~/.maxlite."""
    return pathlib.Path(os.environ.get("MAXLITE_HOME") or "~/.maxlite").expanduser().absolute()


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise LaunchError(f"experiment name '{name}': use letters, digits, '.', '_' or '-' "
                          "(it names directories and the job)")
    return name


def create(name: str) -> pathlib.Path:
    """Make a fresh launch directory NAME_<unix time> (bumped by one second if taken)."""
    root = home() / "experiments" / check_name(name)
    root.mkdir(parents=True, exist_ok=True)
    stamp = int(time.time())
    while True:
        path = root / f"{name}_{stamp}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            stamp += 1


def launches(name: str) -> list[pathlib.Path]:
    """All launch directories of NAME, oldest first."""
    root = home() / "experiments" / check_name(name)
    found = []
    for p in root.glob(f"{name}_*"):
        suffix = p.name[len(name) + 1:]
        if suffix.isdigit() and p.is_dir():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def latest(name: str) -> pathlib.Path:
    """The newest launch of NAME, or a LaunchError naming what exists."""
    found = launches(name)
    if not found:
        root = home() / "experiments"
        known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        hint = f"; known experiments: {', '.join(known)}" if known else f"; no experiments under {root}"
        raise LaunchError(f"no experiment named '{name}'{hint}")
    return found[-1]


def write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    """Write atomically so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def read_json(path: pathlib.Path | str) -> dict[str, Any] | None:
    """A JSON file's mapping, or None if absent/unreadable (the job may be writing it)."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
