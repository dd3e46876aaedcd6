"""Asynchronous GRPO against synchronous, same placement and batch → benchmarks/results/rl_async.json
(in one process) or rl_async_ray.json (`--ray`).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python benchmarks/bench_rl_async.py
    JAX_PLATFORMS=cpu python benchmarks/bench_rl_async.py --ray [key=value ...]

`--ray`: `python -m ray_entry.train` on the launcher's local Ray cluster, one training worker and one
rollout worker (a Ray actor, `rollout_workers=1`), each run in a fresh directory, each pinned to a
core of its own (`ray_cpu_affinity=true`: the separate placement a GPU or TPU run has; `--no-affinity`
leaves both on every core, where they take turns rather than overlap).

grpo_math.yml (the tiny model, the bundled word problems, Math-Verify rewards) with the trainer on
the first quarter of the devices and the rollout engine on the last quarter, run `--steps` GRPO
steps twice: `off_policy_steps=0` (each step samples, then trains) and `off_policy_steps=1` (the
next step's prompts sampled while a step trains). The figure is the mean of each run's `seconds`
per step over its steps after the first two (compilation; the median beside it, of the rows before the
last), and their ratio;
the rewards of both runs are kept to show that learning goes on.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "rl_async.json"


def run(argv: list[str], directory: str, name: str, ray: bool = False) -> list[dict]:
    if ray:
        import subprocess
        subprocess.run([sys.executable, "-m", "ray_entry.train", *argv, f"base_output_directory={directory}",
                        f"run_name={name}"], check=True, cwd=directory, stdout=subprocess.DEVNULL)
    else:
        from maxlite import config as C
        from maxlite.train import train

        train(C.load([*argv, f"base_output_directory={directory}", f"run_name={name}"]))
    return [r for r in map(json.loads, open(f"{directory}/{name}/metrics.jsonl")) if "reward" in r]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--recipe", default="grpo_math.yml")
    p.add_argument("--ray", action="store_true")
    p.add_argument("--no-affinity", action="store_true", help="--ray: the workers unpinned (ray_cpu_affinity=false)")
    p.add_argument("--out", type=pathlib.Path, help="the JSON (default: by mode, in benchmarks/results/)")
    p.add_argument("overrides", nargs="*", help="key=value for both runs (e.g. grpo_max_new_tokens=128: longer "
                   "completions, a larger share of each step sampling)")
    args = p.parse_args()
    argv = [args.recipe, f"steps={args.steps}", "alignment_sft_steps=0", "checkpoint_period=0", "eval_interval=0",
            "log_period=1", "per_device_batch_size=4", "enable_tensorboard=false", "write_report=false",
            *args.overrides]
    argv += (["ray_num_workers=1", "rollout_workers=1", f"ray_cpu_affinity={str(not args.no_affinity).lower()}"] if args.ray else
             ["trainer_devices_fraction=0.25", "sampler_devices_fraction=0.25"])
    out = {"argv": argv}
    with tempfile.TemporaryDirectory() as directory:
        for k in (0, 1):
            rows = run([*argv, f"off_policy_steps={k}"], directory, f"k{k}", args.ray)
            # a row's `seconds` is read one step late (maxlite/train.py _read) and a GRPO step's work is done
            # on the host as it is dispatched, so it lands in the row before: the last row holds ~0 s and
            # the rows after the first two hold the work of steps 4..N, N - 3 steps
            timed = [r["seconds"] for r in rows[2:]]
            out[f"off_policy_{k}"] = {"mean_step_seconds": sum(timed) / (len(timed) - 1),
                                      "median_step_seconds": statistics.median(timed[:-1]),
                                      "rewards": [round(r["reward"], 4) for r in rows],
                                      "staleness": [r["rollout_staleness"] for r in rows],
                                      "step_seconds": [round(r["seconds"], 3) for r in rows],
                                      "rollout_seconds": [round(r["rollout_seconds"], 3) for r in rows],
                                      "sampling_seconds_median": statistics.median(r["sampling_seconds"] for r in rows[2:]),
                                      "training_seconds_median": statistics.median(r["training_seconds"] for r in rows[2:])}
    out["ratio_async_to_sync"] = out["off_policy_1"]["mean_step_seconds"] / out["off_policy_0"]["mean_step_seconds"]
    out["cpu"] = platform.processor() or platform.machine()
    out["cpu_flags"] = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    with open("/proc/loadavg") as f:
        out["loadavg"] = f.read().split()[:3]
    name = ("rl_async_ray_unpinned.json" if args.no_affinity else "rl_async_ray.json") if args.ray else OUT.name
    write_result(out, args.out or OUT.with_name(name))


if __name__ == "__main__":
    main()
