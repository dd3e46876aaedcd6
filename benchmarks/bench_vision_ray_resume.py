"""A vision-language SFT run on Ray killed with -9 and resumed → benchmarks/results/vision_ray_resume.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_vision_ray_resume.py [--family gemma3|qwen3_vl]

A random model of bench_vision_sft.py's (its tower included) is imported with `hf import` and
fine-tuned on the shapes task's image chat records from the recipe.yml the import wrote, under
`python -m ray_entry.train` on 2 CPU workers: once uninterrupted, once with the driver and every
training worker killed with SIGKILL after step 6 (nothing saved on the way out) and the same command
run again, which resumes from the step-4 checkpoint. The JSON holds both runs' losses per step and
whether they are equal bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402
from benchmarks.bench_vision_sft import MODELS, random_gemma3, random_model  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "vision_ray_resume.json"
STEPS, KILL_AFTER, PERIOD = 12, 6, 4


def _losses(run_dir: pathlib.Path) -> dict[int, float]:
    """Step → loss from metrics.jsonl (a resumed run's later record of a step wins)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "step" in record:
            out[record["step"]] = record["loss"]
    return out


def _kill_training() -> int:
    """SIGKILL every Ray training worker on this machine; how many there were."""
    killed = 0
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"ray::RayTrainWorker" in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
                killed += 1
        except OSError:
            pass
    return killed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=sorted(MODELS), default="gemma3")
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_vision_ray_"))
    (random_gemma3 if args.family == "gemma3" else random_model)(work / "hf")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    run = lambda *a, **kw: subprocess.run([sys.executable, "-m", *a], cwd=ROOT, env=env, check=True,  # noqa: E731
                                          capture_output=True, text=True, **kw)
    run("maxlite.data.vision_task", str(work / "shapes"), "--train", "400", "--eval", "20")
    run("maxlite.bridge.hf", "import", str(work / "hf"), str(work / "ck"))
    argv = [sys.executable, "-m", "ray_entry.train", str(work / "ck" / "recipe.yml"), "dataset_type=sft",
            f"dataset_path={work / 'shapes' / 'train.jsonl'}", "sft_template=auto", "ray_num_workers=2",
            f"steps={STEPS}", f"checkpoint_period={PERIOD}", "per_device_batch_size=2", "max_target_length=128",
            "log_period=1", "eval_interval=0", "enable_tensorboard=false", "write_report=false",
            f"base_output_directory={work / 'runs'}"]

    start = time.perf_counter()
    subprocess.run([*argv, "run_name=whole"], cwd=ROOT, env=env, check=True, capture_output=True)
    whole_s = time.perf_counter() - start
    print(f"uninterrupted: {whole_s:.0f} s", flush=True)

    log = work / "killed_first.log"
    with open(log, "w") as out:
        driver = subprocess.Popen([*argv, "run_name=killed"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        while f"completed step: {KILL_AFTER}," not in log.read_text():
            if driver.poll() is not None:
                raise SystemExit(f"the run ended before step {KILL_AFTER}: {log}")
            time.sleep(0.2)
        workers = _kill_training()
        driver.kill()
        driver.wait()
    print(f"killed the driver and {workers} training worker(s) after step {KILL_AFTER}", flush=True)
    again = subprocess.run([*argv, "run_name=killed"], cwd=ROOT, env=env, capture_output=True, text=True)
    resumed = next((line.split("maxlite: ", 1)[1] for line in again.stdout.splitlines() + again.stderr.splitlines()
                    if "resumed from step" in line), "")
    whole, killed = _losses(work / "runs" / "whole"), _losses(work / "runs" / "killed")
    write_result({"model": MODELS[args.family], "family": args.family, "workers": 2, "steps": STEPS,
                  "checkpoint_period": PERIOD, "killed_after_step": KILL_AFTER, "killed_workers": workers,
                  "rerun_exit_code": again.returncode, "resumed": resumed,
                  "losses_equal_bitwise": whole == killed and len(whole) == STEPS,
                  "losses_uninterrupted": [whole[s] for s in sorted(whole)],
                  "losses_killed_and_resumed": [killed[s] for s in sorted(killed)],
                  "uninterrupted_wall_s": round(whole_s, 1)}, args.out)


if __name__ == "__main__":
    main()
