"""A sequence split across processes: context=4 over 2 processes × 2 devices (jax.distributed over
gloo) trains as context=4 on one process's 4 devices; one process's context runs:
tests/test_context_train.py."""

from __future__ import annotations

import json

from tests.helpers import SMALL, run_module

ARGV = [a for a in SMALL if not a.startswith(("max_target_length=", "per_device_batch_size="))] + [
    "max_target_length=32", "per_device_batch_size=0.5", "ici_context_parallelism=4", "steps=4",
    "dtype=float32", "attention=dot_product", "enable_checkpointing=false", "eval_interval=4", "eval_steps=1"]


def _metrics(run_dir, name: str, processes: int, devices: int) -> tuple[dict, dict, dict]:
    """step → (loss, batch_hash) of the training steps and step → eval loss, from metrics.jsonl."""
    codes, outs = run_module("maxlite.train", [*ARGV, f"base_output_directory={run_dir}", f"run_name={name}"],
                             processes=processes, devices=devices)
    assert codes == [0] * processes, outs[0][-3000:] + outs[-1][-3000:]
    with open(f"{run_dir}/{name}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["batch_hash"] for r in records if "batch_hash" in r},
            {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r})


def test_a_sequence_split_over_two_processes_trains_as_on_one(run_dir):
    """Each process holds half of every sequence's columns: both read the same whole rows (one row
    group), so the global batches (batch_hash), the losses and the eval loss equal one process's.
    Reading each process's own rows (reader = process index) made step 1's batch_hash differ."""
    one = _metrics(run_dir, "one", processes=1, devices=4)
    two = _metrics(run_dir, "two", processes=2, devices=2)
    assert sorted(one[0]) == [1, 2, 3, 4] and list(one[2]) == [4]
    assert two[1] == one[1]  # the same global batch at every step
    assert len(set(one[1].values())) == 4
    # f32, the same 4-device program: only the collectives' transport differs (gloo across processes)
    for got, want in zip(two[0::2], one[0::2]):
        assert got.keys() == want.keys()
        for step in want:
            assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got[step], want[step])
