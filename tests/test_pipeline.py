"""Pipeline parallelism (maxlite/models/pipeline.py) on 8 CPU devices: 10 steps of packed text at
pipeline 4 × fsdp 2 (GPipe) and pipeline 2 × fsdp 4 (circular, 2 repeats) give one device's losses; a
checkpoint saved with 4 stages resumes with 1 and 2 to the same next-step loss; the schedule and its
bubble in status.json; bad layouts refused before anything is written; the context axis inside the stages, and DPO with
LoRA adapters over pipeline × fsdp, give one device's losses."""

import functools
import json

import jax
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C, mesh as mesh_lib
from maxlite.data import make_iterator
from helpers import build

STEPS = 10
ARGV = ["base.yml", "model_name=tiny", "base_emb_dim=32", "base_mlp_dim=64", "base_num_query_heads=2",
        "base_num_kv_heads=2", "head_dim=16", "base_num_decoder_layers=4", "dataset_type=text",
        "max_target_length=32", "dtype=float32", "learning_rate=3e-3", f"steps={STEPS}",
        "enable_tensorboard=false", "write_report=false"]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    """Documents shorter than a row, so that rows pack several (the bundled corpus's do not)."""
    words = "in the beginning god created the heaven and the earth and the earth was without form".split()
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(600):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, 20)))}) + "\n")
    return f"dataset_path={path}"


@functools.cache  # the one-device reference, computed once for both splits
def _losses(argv: tuple, devices: int) -> np.ndarray:
    cfg, mesh, state, step, sharding = build(list(argv), devices)
    data = make_iterator(cfg, "train", 0, 1)  # packed rows: several documents per row
    losses = []
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(STEPS):
            batch = next(data)
            state, metrics = step(state, {k: jax.device_put(v, sharding) for k, v in batch.items()})
            losses.append(float(metrics["loss"]))
    assert (batch["segment_ids"].max(axis=1) > 1).any()  # the rows really are packed
    return np.array(losses)


GEMMA4 = ("model_name=gemma4-tiny", "layer_types=[sliding_attention,full_attention,sliding_attention,full_attention]")
MOE = ("model_name=tiny-moe", "num_experts=4", "base_moe_mlp_dim=32", "load_balance_loss_weight=0.1")


@pytest.mark.parametrize("model,pipeline", [
    ((), ("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2")),
    ((), ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2")),
    # each micro-batch's sequences split over the context axis inside a stage
    ((), ("ici_pipeline_parallelism=2", "ici_context_parallelism=2", "ici_fsdp_parallelism=2")),
    # the routing statistics (auxiliary losses) gathered per layer over micro-batches and repeats
    (MOE, ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2",
           "num_pipeline_repeats=2")),
    # each iteration's stage input in host memory, the stage's layers recomputed from it
    ((), ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2",
          "remat_policy=offload_layer_inputs")),
], ids=["gpipe-4x2", "circular-2x4", "gpipe-2x2context2", "moe-circular-2x2x2expert", "circular-2x4-offload"])
def test_pipelined_training_equals_one_device(short_docs, model, pipeline):
    reference = _losses((*ARGV, *model, short_docs, "per_device_batch_size=8"), 1)
    pipelined = _losses((*ARGV, *model, short_docs, "per_device_batch_size=1", *pipeline), 8)
    # f32: summation order only (2e-7 seen). With the gradient between stages cut on purpose (a
    # stop_gradient on the shift from one stage to the next) the losses part from step 2 on.
    np.testing.assert_allclose(pipelined, reference, rtol=1e-5)


def test_each_stage_computes_the_output_head_for_its_share_of_the_rows():
    """Every stage holds the pipeline's output for its batch shard's rows; the output head and the
    loss take them split over `stage` too, so a device's logits have the rows of a device without
    stages (global batch / devices), not P times as many. Read from the compiled step's shapes."""
    import re

    import jax.numpy as jnp

    V, T = 256, 32
    from maxlite.build import build as wire
    from maxlite.step import loss_sums

    built = wire(C.load([*ARGV, "base_num_decoder_layers=2", f"vocab_size={V}", "num_vocab_tiling=1",
                         "per_device_batch_size=1", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"]),
                 jax.devices()[:8], num_processes=1)
    B = built.cfg.global_batch_size
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.float32 if k == "weights" else jnp.int32, sharding=built.batch_sharding)
             for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), built.abstract.params,
                          built.shardings.params)
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):  # the loss's forward pass is enough
        text = jax.jit(functools.partial(loss_sums, graphdef=built.graphdef)).lower(params, batch=batch).compile().as_text()
    rows = {int(r) for r in re.findall(rf"f32\[(\d+),{T},{V}\]", text)}  # the logits
    assert rows == {B // 8}, rows


def _objective_losses(argv: list, devices: int, steps: int) -> np.ndarray:
    """Losses of `steps` steps of the recipe's objective (its reference log-probabilities included)."""
    from maxlite.build import build as wire

    built = wire(C.load(argv), jax.devices()[:devices], num_processes=1)
    state, data, losses = built.init_state(), make_iterator(built.cfg, "train", 0, 1), []
    try:
        with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
            for s in range(steps):
                state, metrics = built.objective(state, {k: jax.device_put(v, built.batch_sharding)
                                                         for k, v in next(data).items()}, s)
                losses.append(float(metrics["loss"]))
    finally:
        data.close()
    return np.array(losses)


def test_dpo_with_lora_over_pipeline_and_fsdp_equals_one_device():
    """The alignment objectives run the model through the same pipeline (each side of a pair, and
    the reference); LoRA adapters are stacked like the layers they adapt, so they split into the
    stages with them. 3 steps: the third's loss depends on two updates of the adapters through the
    stages. (Context parallelism is for train_objective=lm, pipeline or not: refused in one line.)"""
    argv = [*ARGV[:7], "base_num_decoder_layers=2", "vocab_size=4096", "dtype=float32", "learning_rate=1e-2", "warmup_steps_fraction=0",
            "enable_tensorboard=false", "write_report=false", "train_objective=dpo", "dataset_type=preference",
            "max_target_length=64", "lora_rank=4", "lora_alpha=8"]
    reference = _objective_losses([*argv, "per_device_batch_size=8"], 1, 3)
    pipelined = _objective_losses([*argv, "per_device_batch_size=1", "ici_pipeline_parallelism=2",
                                   "ici_fsdp_parallelism=4"], 8, 3)
    assert reference[0] == pytest.approx(np.log(2))  # adapters start at zero: policy = reference
    assert abs(reference[2] - reference[0]) > 1e-3  # the adapters did learn
    np.testing.assert_allclose(pipelined, reference, rtol=1e-5)


def _run(tmp_path, name: str, steps: int, *extra) -> dict:
    from maxlite.train import train

    train(C.load([*ARGV, "per_device_batch_size=1", f"base_output_directory={tmp_path}", f"run_name={name}",
                  f"steps={steps}", f"learning_rate_schedule_steps={STEPS}", "checkpoint_period=2",
                  "ici_fsdp_parallelism=-1", *extra]))
    with open(f"{tmp_path}/{name}/metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    with open(f"{tmp_path}/{name}/status.json") as f:
        return {"losses": losses, "status": json.load(f)}


def test_checkpoint_saved_with_four_stages_resumes_with_one_and_two(tmp_path):
    saved = _run(tmp_path, "src", 3, "ici_pipeline_parallelism=4")  # saves steps 2 and 3
    pipeline = saved["status"]["pipeline"]
    P, R, M = pipeline["stages"], pipeline["repeats"], pipeline["microbatches"]
    assert (P, R, pipeline["schedule"]) == (4, 1, "gpipe")
    assert pipeline["bubble_fraction"] == pytest.approx((P - 1) / (R * M + P - 1))
    assert saved["status"]["summary"]["pipeline"] == pipeline
    for stages in (1, 2):  # the full state of step 2 (weights, optimizer, data position) with other stages
        run = _run(tmp_path, f"p{stages}", 3, f"ici_pipeline_parallelism={stages}",
                   f"load_full_state_path={tmp_path}/src/checkpoints/2")
        assert run["status"]["resumed_from"]["step"] == 2
        assert ("pipeline" in run["status"]) == (stages > 1)
        # the layers are stored in model order: the same weights whatever the stages
        np.testing.assert_allclose(run["losses"][3], saved["losses"][3], rtol=1e-5)


@pytest.mark.parametrize("extra,message", [
    (("ici_pipeline_parallelism=4", "num_pipeline_repeats=2"), "does not split into 4 pipeline stages × 2 repeats"),
    (("ici_pipeline_parallelism=4", "num_pipeline_microbatches=2"), "fewer than the 4 pipeline stages"),
    (("ici_pipeline_parallelism=2", "num_pipeline_microbatches=4"), "do not split into num_pipeline_microbatches=4"),
    (("ici_pipeline_parallelism=2", "scan_layers=false"), "set scan_layers=true"),
    # sides that ride with the hidden states in the layers' carry (maxlite/models/sides.py) are named
    (("ici_pipeline_parallelism=2", *GEMMA4), "not Gemma 4's shared keys/values .* or Gemma 4's per-layer embeddings"),
    (("ici_pipeline_parallelism=2", *GEMMA4, "num_kv_shared_layers=0"), "not Gemma 4's per-layer embeddings"),
])
def test_bad_pipeline_layouts_are_refused_before_anything_is_written(tmp_path, extra, message):
    from maxlite.train import train

    cfg = C.load([*ARGV, "per_device_batch_size=1", f"base_output_directory={tmp_path}", "run_name=bad", *extra])
    with pytest.raises(C.ConfigError, match=message):
        train(cfg)
    assert not (tmp_path / "bad").exists()


def test_kill_9_during_a_pipelined_run_resumes_bit_for_bit(tmp_path):
    """A pipelined run (circular schedule, 2 stages × fsdp 2) SIGKILLed after step 5 and run again
    resumes from its last complete checkpoint and recomputes the steps the killed run had done with
    the same batches to the same bits: loss and gradient norm."""
    import os
    import signal

    from tests import procs

    run_dir = str(tmp_path)
    args = [*ARGV[1:8], "vocab_size=256", "dtype=float32", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2",
            "num_pipeline_repeats=2", "checkpoint_period=2", "steps=7"]
    started, logs = procs.start(run_dir, "cut", args, devices=4)
    try:
        procs.wait_for(lambda: procs.steps_logged(run_dir, "cut") >= 5, started[0])
    finally:
        os.kill(started[0].pid, signal.SIGKILL)
        started[0].wait()
    with open(f"{run_dir}/cut/metrics.jsonl") as f:
        killed = [json.loads(line) for line in f]
    (code,), _ = procs.run(run_dir, "cut", args, devices=4)
    assert code == 0, open(logs[0]).read()[-2000:]
    with open(f"{run_dir}/cut/metrics.jsonl") as f:
        rerun = {r["step"]: r for r in map(json.loads, list(f)[len(killed):]) if "loss" in r}
    step, source = procs.resumed(run_dir, "cut")
    assert source == "checkpoint" and step in (2, 4) and procs.status(run_dir, "cut")["pipeline"]["repeats"] == 2
    again = [r for r in killed if "loss" in r and r["step"] in rerun]
    assert [r["step"] for r in again] == list(range(step + 1, max(r["step"] for r in killed if "loss" in r) + 1))
    for r in again:
        assert {k: r[k] for k in ("batch_hash", "loss", "grad_norm")} == \
            {k: rerun[r["step"]][k] for k in ("batch_hash", "loss", "grad_norm")}, r["step"]
