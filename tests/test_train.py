import json
import os
import re
import subprocess
import sys

LINE = re.compile(r"^completed step: (\d+), seconds: [\d.]+, TFLOP/s/device: [\d.]+, "
                  r"Tokens/s/device: [\d.]+, total_weights: (\d+), loss: [\d.]+$")


def test_cli_trains_sharded_and_fills_the_run_directory(run_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
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
    assert json.load(open(os.path.join(out, "status.json")))["state"] == "finished"
