"""End to end, real subprocesses: train N steps vs. train, crash (inside a save), resume to N.

The resumed run must end bitwise where the uninterrupted one did (same mesh, CPU): parameters,
optimizer state and the step-N loss; on local disk and on gs:// (fake-gcs-server).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxlite import checkpoints as ck
from tests.gcs_emulator import gcs_emulator, emulator_env, make_bucket  # noqa: F401
from tests.xla_flags import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(900)  # training processes run, killed and rerun one after another
ARGS = ["base.yml", "model_name=tiny", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=2",
        "base_num_kv_heads=2", "head_dim=32", "base_num_decoder_layers=2", "vocab_size=256",
        "max_target_length=16", "per_device_batch_size=2", "enable_tensorboard=false", "write_report=false", "steps=6",
        "checkpoint_period=2", "max_num_checkpoints_to_keep=0", "eval_interval=3", "eval_steps=1"]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(2),
               PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    env.update(extra or {})
    return env


def train(args, env, kill_on: str | None = None, timeout: float = 600, code: int = 0) -> str:
    """Run the trainer (its exit code must be `code`); with `kill_on`, SIGKILL it as soon as a
    stdout line matches that regex."""
    proc = subprocess.Popen([sys.executable, "-m", "maxlite.train", *ARGS, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if kill_on and re.search(kill_on, line):
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines)
    if kill_on:
        assert proc.returncode == -signal.SIGKILL, out[-3000:]
    else:
        assert proc.returncode == code, out[-3000:]
    return out


# Dies right after the step-4 save started (resilience/faults.py): its files half written, never complete.
TORN_SAVE = ["fault_type=crash_in_checkpoint", "fault_step=4"]


def _torn(run_dir: str) -> None:
    """The injected crash fired (its once-per-run marker, local or gs://)."""
    import fsspec
    marker = f"{run_dir}/.fault_crash_in_checkpoint_4_p0"
    assert fsspec.url_to_fs(marker)[0].exists(marker), marker


def _final(run_dir: str):
    """(params, opt_state as host arrays, loss at step 6, eval records) of a finished run."""
    import fsspec
    root, step = ck.resolve_step_dir(f"{run_dir}/checkpoints", 6)
    cfg, params = ck.load_params(root, step=6)
    opt = ck.load_numpy(root, "optimizer", step=6)
    with fsspec.open(f"{run_dir}/metrics.jsonl") as f:
        records = [json.loads(x) for x in f.read().decode().splitlines()]
    loss = [r["loss"] for r in records if r.get("step") == 6 and "loss" in r][-1]
    evals = [r for r in records if "eval_loss" in r]
    return jax.tree.leaves(params), [np.asarray(x) for x in jax.tree.leaves(opt)], loss, evals


def _assert_same(a, b):
    params_a, opt_a, loss_a, _ = a
    params_b, opt_b, loss_b, _ = b
    assert loss_a == loss_b
    assert len(params_a) == len(params_b) and all(np.array_equal(x, y) for x, y in zip(params_a, params_b))
    assert len(opt_a) == len(opt_b) and all(np.array_equal(x, y) for x, y in zip(opt_a, opt_b))


def test_kill_during_save_then_resume_is_bitwise_identical_local(tmp_path):
    base = f"base_output_directory={tmp_path}/runs"
    env = _env()
    train([base, "run_name=ref"], env)
    # A crash inside the step-4 save: its partial write must never be picked, and goes away.
    train([base, "run_name=cut", *TORN_SAVE], env, code=1)
    _torn(f"{tmp_path}/runs/cut")
    rows = ck.list_checkpoints(f"{tmp_path}/runs/cut/checkpoints")
    assert [(r["step"], r["complete"]) for r in rows if r["complete"]] == [(2, True)]
    assert any(d.startswith("4.") and "tmp" in d for d in os.listdir(f"{tmp_path}/runs/cut/checkpoints"))
    train([base, "run_name=cut", *TORN_SAVE], env)  # the fault fired once: the run goes through
    assert not [d for d in os.listdir(f"{tmp_path}/runs/cut/checkpoints") if "tmp" in d]  # the torn save removed
    resumed = json.load(open(f"{tmp_path}/runs/cut/status.json"))["resumed_from"]
    assert (resumed["step"], resumed["source"]) == (2, "checkpoint"), resumed
    ref, cut = _final(f"{tmp_path}/runs/ref"), _final(f"{tmp_path}/runs/cut")
    _assert_same(ref, cut)
    assert [r["eval_loss"] for r in ref[3]] == [r["eval_loss"] for r in cut[3]][-len(ref[3]):]
    leftovers = [d for d in os.listdir(f"{tmp_path}/runs/cut/checkpoints") if "tmp" in d]
    assert leftovers == []
    # Running again with the same run_name: resumes from step 6 and ends at once.
    out = train([base, "run_name=cut"], env)
    status = json.load(open(f"{tmp_path}/runs/cut/status.json"))
    assert status["resumed_from"]["step"] == 6 and status["state"] == "finished" and "completed step" not in out
    listed = subprocess.run([sys.executable, "-m", "maxlite.checkpoints", "list",
                             f"{tmp_path}/runs/cut/checkpoints"], cwd=ROOT, env=env, text=True,
                            capture_output=True, check=True).stdout
    assert "step=6-consumed_samples=24-val_loss=" in listed and "complete" in listed


@pytest.mark.gcs
def test_kill_then_resume_is_bitwise_identical_on_gcs(tmp_path, gcs_emulator):  # noqa: F811
    bucket = make_bucket(gcs_emulator.url, "resume-test")
    base = f"base_output_directory={bucket}/runs"
    env = _env(emulator_env(gcs_emulator.url, str(tmp_path / "gcloud")))
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    train([base, "run_name=ref"], env)
    train([base, "run_name=cut", *TORN_SAVE], env, code=1)
    _torn(f"{bucket}/runs/cut")
    train([base, "run_name=cut", *TORN_SAVE], env)  # the fault's marker is in the gs:// run dir
    import fsspec
    with fsspec.open(f"{bucket}/runs/cut/status.json", "r") as f:
        assert json.load(f)["resumed_from"]["step"] == 2
    _assert_same(_final(f"{bucket}/runs/ref"), _final(f"{bucket}/runs/cut"))
    rows = ck.list_checkpoints(f"{bucket}/runs/cut/checkpoints")
    assert [r["step"] for r in rows if r["complete"]][-1] == 6 and all(r["complete"] for r in rows)


@pytest.mark.gcs
def test_bad_bucket_is_one_line_error(tmp_path, gcs_emulator):  # noqa: F811
    env = _env(emulator_env(gcs_emulator.url, str(tmp_path / "gcloud")))
    proc = subprocess.run([sys.executable, "-m", "maxlite.train", *ARGS, "run_name=x",
                           "base_output_directory=gs://no-such-bucket/runs"], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("maxlite: error: ")
    assert "does not exist" in proc.stderr


@pytest.mark.gcs
def test_policy_stop_ends_the_run_cleanly_when_storage_dies(tmp_path, gcs_emulator):  # noqa: F811
    bucket = make_bucket(gcs_emulator.url, "stop-test")
    env = _env(emulator_env(gcs_emulator.url, str(tmp_path / "gcloud")))
    proc = subprocess.Popen([sys.executable, "-m", "maxlite.train", *ARGS, "run_name=s", "steps=40",
                             f"checkpoint_dir={bucket}/s", f"base_output_directory={tmp_path}/runs",
                             "checkpoint_error_policy=stop"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "saved checkpoint step 2" in line and gcs_emulator.proc is not None:
                gcs_emulator.proc.kill()  # storage dies; the next save (step 4) fails
                gcs_emulator.proc.wait()
                gcs_emulator.proc = None
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        if gcs_emulator.proc is None:
            gcs_emulator.start()
    out = "".join(lines)
    assert proc.returncode == 74, out[-3000:]
    # text is the contract: the line that tells the user the earlier save still stands
    assert "previous checkpoint (step 2) is intact; stopping (checkpoint_error_policy=stop)" in out
    assert "completed step: 40" not in out and "Traceback" not in out.split("stopping")[-1]
    status = json.load(open(f"{tmp_path}/runs/s/status.json"))
    assert status["state"] == "failed" and "CheckpointSaveError" in status["error"]
    assert [f["step"] for f in status["checkpoint_failures"]] == [4]
    assert ck.complete_steps(f"{bucket}/s") == [2]
