"""Adam's first moment (and the gradients) in bfloat16 against float32: the same training run of a
preset on the bundled corpus, once per setting, and the loss each reaches.

    python benchmarks/bench_mu_dtype.py [--model llama-100m] [--steps 300] [--batch 4] [--length 128]
        [--runs "mu_dtype=float32" "mu_dtype=bfloat16" ...] [--out FILE] [key=value ...]

One CPU device, float32 weights, every run on the same batches from the same initialisation
(dataset_type=text, the bundled corpus; cosine schedule). The JSON holds each run's overrides, its
loss at steps 100/200/300 (or the steps given), the mean of its last 20 steps, its median step time
after the first step, the compiled step's memory (XLA's memory analysis: the arguments are the state
and the batch) and the first-moment bytes of its optimizer state, and every loss
(benchmarks/results/mu_dtype_<model>.json by default). Written after every run, so a run cut short
keeps the ones before it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shlex
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_result  # noqa: E402

RUNS = ("mu_dtype=float32", "mu_dtype=bfloat16")
COMMON = ["dataset_type=text", "enable_tensorboard=false", "write_report=false", "weight_dtype=float32"]


def train(argv: list[str], steps: int) -> dict:
    """One run: its loss curve, median step time after the first step, compiled step memory, and the
    bytes of its optimizer state's first moments (`mu` leaves)."""
    import jax
    import numpy as np
    from flax import nnx

    from maxlite import build as build_lib, config as C, mesh as mesh_lib
    from maxlite.data import make_iterator

    built = build_lib.build(C.load(argv), jax.devices()[:1], num_processes=1)
    state, step = built.init_state(), built.train_step
    mu_leaves = [x for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state)
                 if any(getattr(k, "name", None) == "mu" for k in path)]
    data = make_iterator(built.cfg, "train", 0, 1)
    losses, times, memory = [], [], None
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for i in range(steps):
            batch = {k: jax.device_put(v, built.batch_sharding) for k, v in next(data).items()}
            if i == 0:
                analysis = step.lower(state, batch).compile().memory_analysis()
                if analysis is not None:
                    memory = {"argument_bytes": analysis.argument_size_in_bytes,
                              "temp_bytes": analysis.temp_size_in_bytes}
            start = time.perf_counter()
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - start)
            if (i + 1) % 25 == 0:
                print(f"  step {i + 1}: loss {losses[-1]:.4f}, {times[-1]:.2f} s", flush=True)
    data.close()
    times = sorted(times[1:]) or [0.0]
    return {"losses": losses, "step_seconds_median": round(times[len(times) // 2], 3), "compiled_memory": memory,
            "mu_bytes": sum(x.size * np.dtype(x.dtype).itemsize for x in mu_leaves),
            "mu_dtypes": sorted({str(x.dtype) for x in mu_leaves})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-100m")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--at", default="100,200,300", help="the steps whose loss the JSON reports")
    parser.add_argument("--runs", nargs="+", default=list(RUNS),
                        help="one run per item: space-free key=value overrides joined by commas")
    parser.add_argument("--note", default="", help="a sentence the JSON keeps (e.g. why fewer steps)")
    parser.add_argument("--out", default="")
    args, extra = parser.parse_known_args()
    out = pathlib.Path(args.out or ROOT / f"benchmarks/results/mu_dtype_{args.model}.json")
    recipe = ["base.yml", f"model_name={args.model}", *COMMON, f"max_target_length={args.length}",
              f"per_device_batch_size={args.batch}", f"steps={args.steps}", *extra]
    at = [int(s) for s in args.at.split(",") if int(s) <= args.steps]
    runs = []
    for spec in args.runs:
        overrides = spec.split(",")
        print(f"{' '.join(overrides)}: {args.steps} steps", flush=True)
        start = time.perf_counter()
        run = train([*recipe, *overrides], args.steps)
        curve = run.pop("losses")
        last = curve[-20:]
        runs.append({"overrides": overrides, "loss_at": {str(s): round(curve[s - 1], 4) for s in at},
                     "mean_last_20": round(sum(last) / len(last), 4), "seconds": round(time.perf_counter() - start, 1),
                     **run, "losses": [round(x, 4) for x in curve]})
        print(f"  loss at {runs[-1]['loss_at']}, last-20 mean {runs[-1]['mean_last_20']}, "
              f"{run['step_seconds_median']} s/step, mu {run['mu_bytes'] / 2**20:.1f} MiB {run['mu_dtypes']}", flush=True)
        report(args, recipe, runs, out)


def report(args, recipe: list[str], runs: list[dict], out: pathlib.Path) -> None:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    base = runs[0]
    result = {
        "command": shlex.join(["python", "benchmarks/bench_mu_dtype.py", *sys.argv[1:]]),
        "recipe": recipe, "steps": args.steps, "tokens_per_step": args.batch * args.length, "note": args.note,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "flags": [x for x in flags if x.startswith(("avx", "amx", "fma"))],
                    "load_average": os.getloadavg()},
        "difference_to_first_run": [{"overrides": r["overrides"],
                                     "mean_last_20": round(r["mean_last_20"] - base["mean_last_20"], 4),
                                     "loss_at": {s: round(v - base["loss_at"][s], 4) for s, v in r["loss_at"].items()}}
                                    for r in runs[1:]],
        "runs": runs,
    }
    write_result(result, out)


if __name__ == "__main__":
    main()
