"""A rollback that looks further back (real processes): a state that is bad in itself (a NaN
weight, saved with valid checksums, as a state poisoned in device memory would be) gives a
non-finite loss at its first step whatever the batch; the second rollback goes to an older state
and the run finishes, and with no older state the run stops without calling the loss diverged."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp

from maxlite import checkpoints as ck
from maxlite import outcome
from tests.helpers import SMALL, run_module, start


def _train(run_dir, name, *extra, code=0):
    args = [*SMALL, f"base_output_directory={run_dir}", f"run_name={name}", "max_num_checkpoints_to_keep=0", *extra]
    codes, outs = run_module("maxlite.train", args, devices=2)
    assert codes == [code], outs[0][-3000:]
    with open(f"{run_dir}/{name}/status.json") as f:
        return json.load(f), outs[0]


def _poison(tmp_path, run_dir, name, step):
    """Checkpoint `step` rewritten with a NaN final-norm scale: its checksums are valid."""
    _, state, data, saver = start(tmp_path, [f"run_name={name}", "max_num_checkpoints_to_keep=0"], 2)
    state = state.state  # where the run starts (maxlite.resume.Start)
    assert int(state.step) == step
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * jnp.nan if "final_norm" in jax.tree_util.keystr(path) else x, state.params)
    shutil.rmtree(f"{run_dir}/{name}/checkpoints/{step}")
    saver.mngr.reload()
    assert saver.save(step, state.replace(params=params), data)
    saver.close()
    assert ck.main(["verify", f"{run_dir}/{name}/checkpoints", str(step)]) == 0  # the bytes are as written


def test_a_bad_state_sends_the_second_rollback_to_an_older_state(tmp_path, run_dir):
    _train(run_dir, "b", "steps=6", "checkpoint_period=2")
    _poison(tmp_path, run_dir, "b", 6)
    st, _ = _train(run_dir, "b", "steps=10", "checkpoint_period=2")
    assert st["state"] == "finished" and st["step"] == 10 and st["rollbacks"] == 2
    with open(f"{run_dir}/b/rollbacks.jsonl") as f:
        first, second = map(json.loads, f)
    assert (first["to_step"], first["suspect"], first["bad_state_step"]) == (6, "data", None)
    assert (second["to_step"], second["suspect"], second["bad_state_step"]) == (4, "state", 6)


def test_with_no_older_state_the_run_stops_without_a_diverged_verdict(tmp_path, run_dir):
    _train(run_dir, "n", "steps=4", "checkpoint_period=4")
    _poison(tmp_path, run_dir, "n", 4)
    st, out = _train(run_dir, "n", "steps=8", "checkpoint_period=4", code=outcome.BAD_STATE)
    assert (st["state"], st["reason"], st["next"]) == ("failed", "bad_state", "fail")  # not `diverged`
    errors = [line for line in out.splitlines() if line.startswith("maxlite: error:")]
    assert len(errors) == 1 and "Traceback" not in out
    assert "at the first step after rolling back to step 4: that state goes bad with other batches too" in errors[0]
    assert "that state goes bad with other batches too" in st["error"]
