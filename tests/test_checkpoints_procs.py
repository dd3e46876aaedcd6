"""Checkpoints written and checked by several processes (jax.distributed over gloo on CPU)."""

from __future__ import annotations

import json
import shutil

import pytest

from maxlite import checkpoints as ck
from tests.helpers import SMALL, changed, flip, largest_data_file, run_module


def _train(run_dir, name, *extra, processes=2, devices=2):
    args = [*SMALL, f"base_output_directory={run_dir}", f"run_name={name}", "max_num_checkpoints_to_keep=0", *extra]
    codes, outs = run_module("maxlite.train", args, processes=processes, devices=devices)
    assert codes == [0] * processes, outs[0][-3000:] + outs[-1][-3000:]
    with open(f"{run_dir}/{name}/status.json") as f:
        return json.load(f)


def test_two_processes_each_check_what_they_read(run_dir):
    """Two processes (jax.distributed, gloo): flipped bytes in a file only process 1 wrote and
    reads; both reach the verdict and resume from the older step; one process (another layout)
    checking the same checkpoint finds the same array."""
    _train(run_dir, "p", "steps=4", "checkpoint_period=2")
    root = f"{run_dir}/p/checkpoints"
    before = ck.load_numpy(root, "optimizer", step=4)
    flip(largest_data_file(f"{root}/4", "optimizer", process=1), 64)
    damaged = changed(root, 4, "optimizer", before)
    assert damaged
    shutil.copytree(f"{run_dir}/p", f"{run_dir}/copy")
    resumed = _train(run_dir, "p", "steps=6", "checkpoint_period=2")["resumed_from"]
    assert resumed["step"] == 2 and set(resumed["corrupt"][0]["damaged"]) == damaged
    with pytest.raises(ck.CheckpointCorrupt) as e:  # one process, whole arrays: the pieces of both
        ck.load_numpy(f"{run_dir}/copy/checkpoints", "optimizer", step=4)
    assert set(e.value.damaged) == damaged
