"""Step time of a Ray run, against the same recipe in one process → benchmarks/results/ray_steps.json.

    python benchmarks/bench_ray_steps.py [--steps 30] [--out PATH]

Two CPU workers × 2 simulated devices on the embedded local Ray cluster (`python -m ray_entry.train`,
tiny model, 64 tokens, checkpoints every 10 steps), and the same global batch in one process with 4
devices. Reported: the median step time after the first 4 steps (compilation and the first save out
of the way), from each run's metrics.jsonl. What it shows: what Ray itself adds to a step (its
per-report barrier and its controller's poll), not the model's speed; the machine has 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402
from tests.ray_cluster import ray_env  # noqa: E402 — the tests' Ray environment (no auth, this venv)

RECIPE = ["base.yml", "model_name=tiny", "per_device_batch_size=1", "max_target_length=64",
          "checkpoint_period=10", "enable_tensorboard=false", "write_report=false"]


def _median_step_seconds(run_dir: pathlib.Path) -> float:
    seconds = [json.loads(line)["seconds"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if '"seconds"' in line and json.loads(line).get("step", 0) > 4]
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "ray_steps.json")
    args = parser.parse_args()
    base = pathlib.Path(tempfile.mkdtemp(prefix="bench_ray_"))
    common = [*RECIPE, f"steps={args.steps}", f"base_output_directory={base}"]
    load_before = os.getloadavg()
    subprocess.run([sys.executable, "-m", "ray_entry.train", *common, "run_name=ray", "ray_num_workers=2",
                    "ray_simulated_devices_per_worker=2"], env=ray_env(), cwd=ROOT, check=True,
                   capture_output=True, text=True, timeout=900)
    one = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    subprocess.run([sys.executable, "-m", "maxlite.train", *common, "run_name=single"], env=one, cwd=ROOT,
                   check=True, capture_output=True, text=True, timeout=900)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    write_result({
        "what": "median step seconds after step 4: Ray (2 workers x 2 CPU devices) vs one process (4 devices)",
        "command": f"python benchmarks/bench_ray_steps.py --steps {args.steps}",
        "commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "steps": args.steps,
        "ray_median_step_seconds": round(_median_step_seconds(base / "ray"), 3),
        "one_process_median_step_seconds": round(_median_step_seconds(base / "single"), 3),
    }, args.out)


if __name__ == "__main__":
    main()
