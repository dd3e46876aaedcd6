"""Eval: the same batches every time, token-weighted loss, perplexity in every metric output."""

from __future__ import annotations

import json
import math

import jax
import numpy as np

from maxlite import checkpoints as ck, config as C, data, mesh as mesh_lib, optim, state as state_lib, step as step_lib
from maxlite.evaluation import Evaluator
from maxlite.train import train
from tests.helpers import SMALL


def test_eval_repeats_the_same_batches_and_matches_a_plain_computation():
    # float32: the sharded, jitted eval and the plain sums then agree to rounding (bf16 differs by ~1e-5)
    cfg = C.resolve(C.load([*SMALL, "ici_fsdp_parallelism=2", "eval_steps=3", "dtype=float32"]), 2)
    mesh = mesh_lib.make_mesh(cfg, jax.devices()[:2])
    tx = optim.make_optimizer(cfg)
    graphdef, _, shardings = state_lib.abstract_state(cfg, mesh, tx)
    state = state_lib.create_state(cfg, mesh, tx, shardings)
    ev = Evaluator(cfg, graphdef, shardings.params, mesh_lib.batch_sharding(mesh), 0, 1)
    first, second = ev.run(state.params), ev.run(state.params)
    assert first == second and first["batches"] == 3
    # Reference: plain, unjitted sums over the first 3 eval batches.
    params = jax.device_get(state.params)
    it = data.make_iterator(cfg, "eval", 0, 1)
    sums = [step_lib.eval_step(params, next(it), graphdef=graphdef) for _ in range(3)]
    loss = sum(float(s["loss_sum"]) for s in sums) / sum(float(s["total_weights"]) for s in sums)
    assert np.isclose(first["loss"], loss, rtol=1e-5)
    assert first["perplexity"] == math.exp(first["loss"])
    # The eval split is not the training data.
    train_loss = step_lib.eval_step(params, next(data.make_iterator(cfg, "train", 0, 1)), graphdef=graphdef)
    first_eval = sums[0]
    assert float(train_loss["loss_sum"]) != float(first_eval["loss_sum"])


def test_eval_in_the_loop_reaches_metrics_and_checkpoint_names(tmp_path):
    cfg = C.load([*SMALL, "steps=4", "eval_interval=2", "eval_steps=1", "checkpoint_period=2",
                  "run_name=ev", f"base_output_directory={tmp_path}"])
    train(cfg)
    records = [json.loads(line) for line in open(f"{tmp_path}/ev/metrics.jsonl")]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(np.isclose(r["eval_perplexity"], math.exp(r["eval_loss"])) for r in evals)
    names = {r["step"]: r["name"] for r in ck.list_checkpoints(f"{tmp_path}/ev/checkpoints")}
    assert f"val_loss={evals[-1]['eval_loss']:.2f}" in names[4]  # the step-4 checkpoint is named by it

