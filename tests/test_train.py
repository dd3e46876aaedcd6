import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from maxlite import config as C
from maxlite.train import train
from tests.helpers import SMALL
from tests.xla_flags import cpu_xla_flags

LINE = re.compile(r"^completed step: (\d+), seconds: [\d.]+, TFLOP/s/device: [\d.]+, "
                  r"Tokens/s/device: [\d.]+, total_weights: (\d+), loss: [\d.]+$")


def test_cli_trains_sharded_and_fills_the_run_directory(run_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(8))
    r = subprocess.run(
        [sys.executable, "-m", "maxlite.train", "base.yml", "model_name=tiny", "ici_fsdp_parallelism=4",
         "ici_tensor_parallelism=2", "steps=4", "max_target_length=64", "run_name=t1",
         f"base_output_directory={run_dir}"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [m for m in map(LINE.match, r.stdout.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == [1, 2, 3, 4]
    assert all(int(m.group(2)) == 16 * 64 for m in lines)  # 2 per device × 8 devices × 64 tokens
    assert "maxlite summary: 4 steps" in r.stdout and "MFU" in r.stdout
    out = os.path.join(run_dir, "t1")
    assert "model_name: tiny" in open(os.path.join(out, "config.yml")).read()
    records = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [rec["step"] for rec in records if "loss" in rec] == [1, 2, 3, 4]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(out, "tensorboard")))
    status = json.load(open(os.path.join(out, "status.json")))
    assert status["state"] == "finished"
    chosen = status["cpu_matmul"]  # the bf16 model's CPU product: timed here or cached by an earlier run
    assert chosen["how"] in ("measured", "cached") and chosen["path"] == min(chosen["seconds"], key=chosen["seconds"].get)
    assert f"cpu matmul {chosen['path']} ({chosen['how']}: " in r.stdout.splitlines()[0]
    page = open(os.path.join(out, "report.html")).read()  # write_report: the run's own report
    assert "run_name: t1" in page and os.path.getsize(os.path.join(out, "report.png")) > 10_000


def test_preemption_notice_saves_at_once_and_training_goes_on(tmp_path):
    """A launcher's notice (Ray: a node drain) → a checkpoint at the agreed step, then the run goes on."""
    calls = []

    def notice():
        calls.append(len(calls))
        return "test: node n1 is being drained" if len(calls) >= 3 else None

    cfg = C.load([*SMALL, "steps=6", "checkpoint_period=0", "run_name=nt", f"base_output_directory={tmp_path}"])
    summary = train(cfg, preemption_notice=notice)
    assert len(calls) == 3  # polled each step until seen, then never again in this attempt
    assert summary["exit_code"] == 0 and summary["steps"] == 6
    assert json.load(open(f"{tmp_path}/nt/status.json"))["state"] == "finished"
    # the notice's save at step 4 (seen at step 3, read one sync step late), then the final one
    assert sorted(int(d) for d in os.listdir(f"{tmp_path}/nt/checkpoints") if d.isdigit()) == [4, 6]


FAMILY_SHAPES = {  # tiny, with each family's traits; the bundled tokenizer's 4096 ids
    "qwen3": ["decoder_block=qwen3", "head_dim=32", "base_num_decoder_layers=2", "logits_via_embedding=true",
              "rope_max_timescale=1000000"],
    "gemma3": ["decoder_block=gemma3", "head_dim=16", "base_num_decoder_layers=6", "sliding_window=8",
               "local_rope_max_timescale=10000", "rope_scaling_type=linear", "rope_scaling_factor=8",
               "query_pre_attn_scalar=24", "logits_via_embedding=true", "attention=blockwise",
               "attention_block_size=8"],
    # three gated delta-net layers (chunks of 8: four per row) to one gated full-attention layer
    "qwen3_5": ["decoder_block=qwen3_5", "head_dim=16", "base_num_decoder_layers=4", "partial_rotary_factor=0.25",
                "gdn_num_key_heads=2", "gdn_num_value_heads=4", "gdn_key_head_dim=16", "gdn_value_head_dim=16",
                "gdn_chunk_size=8"],
    # the tiny twin's layer (sinks, biases, YaRN, the clamped experts) run blockwise with a window of one block
    "gpt_oss": ["model_name=tiny-gpt-oss", "head_dim=16", "base_num_decoder_layers=2", "sliding_window=8",
                "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "attention=blockwise",
                "attention_block_size=8"],
    # per-layer embeddings, wide globals, the last 2 layers sharing keys/values (4 layers of the twin's 6:
    # the same kinds of layer; its unlike layers are unrolled, so each one costs compile time)
    "gemma4": ["model_name=gemma4-tiny", "sliding_window=8", "base_num_decoder_layers=4",
               "layer_types=[sliding_attention, full_attention, sliding_attention, full_attention]"],
    "qwen3_moe": ["decoder_block=qwen3_moe", "head_dim=16", "base_num_decoder_layers=3", "first_num_dense_layers=1",
                  "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "load_balance_loss_weight=0.01"],
}


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_family_shaped_models_learn_the_bundled_corpus_and_resume_bitwise(family, tmp_path):
    """6 steps straight vs 3 steps, then resumed to 6 (same schedule): the same parameters,
    optimizer state and losses, bit for bit; the loss falls. Gemma 3's scanned stack mixes local and
    global layers (attention branches per layer) and runs blockwise with a window of one block; the
    mixture of experts keeps a dense first layer apart and reports its auxiliary loss."""
    import jax

    from maxlite import checkpoints as ck

    argv = ["base.yml", "model_name=tiny", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2",
            "base_mlp_dim=128", "dataset_type=text", "max_target_length=32", "per_device_batch_size=1",
            "steps=6", "learning_rate_schedule_steps=6", "learning_rate=3e-3", "checkpoint_period=3",
            "enable_tensorboard=false", "write_report=false", f"base_output_directory={tmp_path}",
            *FAMILY_SHAPES[family]]
    train(C.load([*argv, "run_name=ref"]))
    train(C.load([*argv, "run_name=cut", "steps=3"]))
    train(C.load([*argv, "run_name=cut"]))
    resumed = json.load(open(f"{tmp_path}/cut/status.json"))["resumed_from"]
    assert resumed["step"] == 3

    def final(run):
        root, step = ck.resolve_step_dir(f"{tmp_path}/{run}/checkpoints", 6)
        params, opt = ck.load_params(root, step=step)[1], ck.load_numpy(root, "optimizer", step=step)
        losses = {r["step"]: r["loss"] for r in map(json.loads, open(f"{tmp_path}/{run}/metrics.jsonl")) if "loss" in r}
        return [np.asarray(x) for x in jax.tree.leaves(params) + jax.tree.leaves(opt)], losses

    (ref, ref_losses), (cut, cut_losses) = final("ref"), final("cut")
    assert len(ref) == len(cut) and all(np.array_equal(a, b) for a, b in zip(ref, cut))
    assert ref_losses == cut_losses and ref_losses[6] < ref_losses[1] - 0.3, ref_losses  # from ln 4096 = 8.3
    if family == "qwen3_moe":  # the balancing loss is reported, ≥ 1 (1: perfectly balanced)
        records = [r for r in map(json.loads, open(f"{tmp_path}/ref/metrics.jsonl")) if "loss" in r]
        assert all(r["moe_lb_loss"] >= 1.0 and 0 < r["moe_load_max/1"] <= 1 for r in records), records[-1]
