"""Weights & Biases: one W&B run per maxlite run, resumed when the maxlite run resumes.

The W&B run id is kept in `{run_dir}/wandb_id.txt`: every attempt of the run (a restart, a Slurm
requeue, a Ray retry) logs into the same W&B run (`resume="allow"`). Project, entity, group, mode and
directory are W&B's: the `wandb_*` keys when the recipe sets them, else WANDB_PROJECT, WANDB_ENTITY,
WANDB_RUN_GROUP, WANDB_MODE, WANDB_DIR, else W&B's defaults, except the directory: `{run_dir}`, so
local files go under `{run_dir}/wandb/` (offline runs: `wandb sync {run_dir}/wandb/offline-run-*`).
"""

from __future__ import annotations

import uuid
from typing import Any

import fsspec

from maxlite import config as C
from maxlite.loggers import Sink, scalars, setting
from maxlite.rundir import write_text


def run_id(run_dir: str) -> str:
    """The W&B id of this maxlite run: read from the run directory, or made and stored there."""
    path = f"{run_dir}/wandb_id.txt"
    fs, _, _ = fsspec.get_fs_token_paths(path)
    if fs.exists(path):
        with fsspec.open(path, "r") as f:
            return f.read().strip()
    new = uuid.uuid4().hex[:16]
    write_text(path, new + "\n")
    return new


class WandbSink(Sink):
    name, optional = "wandb", True

    def __init__(self, cfg, run_dir: str):
        import wandb

        local_run_dir = run_dir if "://" not in run_dir else None  # W&B writes local files only
        self.run = wandb.init(
            project=setting(cfg.wandb_project, "WANDB_PROJECT"), entity=setting(cfg.wandb_entity, "WANDB_ENTITY"),
            group=setting(cfg.wandb_group, "WANDB_RUN_GROUP"), mode=setting(cfg.wandb_mode, "WANDB_MODE"),
            dir=setting(cfg.wandb_dir, "WANDB_DIR", local_run_dir), name=cfg.run_name, id=run_id(run_dir),
            resume="allow", config=C.to_plain_dict(cfg))  # config: once, here

    def write(self, record: dict[str, Any], group: str) -> None:
        self.run.log(scalars(record, group), step=record["step"])

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in summary.items()
                                 if isinstance(v, (int, float, str)) and not isinstance(v, bool)})

    def close(self) -> None:
        self.run.finish()
