import json
import os
import re
import subprocess
import sys

from maxlite import config as C
from maxlite.train import train
from tests.helpers import SMALL

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
    page = open(os.path.join(out, "report.html")).read()  # write_report: the run's own report
    assert "run_name: t1" in page and os.path.getsize(os.path.join(out, "report.png")) > 10_000


def test_preemption_notice_saves_at_once_and_training_goes_on(tmp_path, capsys):
    """A launcher's notice (Ray: a node drain) → a checkpoint at the agreed step, then the run goes on."""
    calls = []

    def notice():
        calls.append(len(calls))
        return "test: node n1 is being drained" if len(calls) >= 3 else None

    cfg = C.load([*SMALL, "steps=6", "checkpoint_period=0", "run_name=nt", f"base_output_directory={tmp_path}"])
    summary = train(cfg, preemption_notice=notice)
    out = capsys.readouterr().out
    assert len(calls) == 3  # polled each step until seen, then never again in this attempt
    assert "maxlite: test: node n1 is being drained: saving a checkpoint at the next agreed step" in out
    assert "maxlite: preemption notice: saving step 4 and waiting for it" in out  # read one sync step late
    assert summary["exit_code"] == 0 and summary["steps"] == 6
    assert json.load(open(f"{tmp_path}/nt/status.json"))["state"] == "finished"
    assert sorted(int(d) for d in os.listdir(f"{tmp_path}/nt/checkpoints") if d.isdigit()) == [4, 6]
