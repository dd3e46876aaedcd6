"""Muon against AdamW: a small learning-rate sweep of each on the bundled corpus, the steps Muon
needs to reach AdamW's best final loss, and what a step costs with each (time and memory).

    python benchmarks/bench_optimizers.py [--steps 60] [--model NAME] [--batch B] [--length T]
        [--sweep adamw=1e-3,3e-3 muon=1e-2,3e-2] [--out FILE] [key=value ...]

Without --model: a shrunk `tiny` (the tests' SMALL model, float32) at 8 × 64 tokens per step; with
it, that preset in the default dtypes (bf16 compute) at B × T. One device. Every run trains on the
same batches (dataset_type=text, the bundled corpus) with a WSD schedule; the JSON holds every loss
curve, each run's final loss (the mean of its last 5 steps), its median step time after the first
step, the compiled step's memory (XLA's memory analysis: arguments + temporaries, the same on every
platform), and the first step at which Muon's best run's 5-step mean reaches AdamW's best final loss;
with --eval-every K, the eval split's loss every K steps and the first of those at which Muon's best
run reaches AdamW's best final eval loss (benchmarks/results/optimizers_tiny.json by default).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_result  # noqa: E402

SHRUNK = ["model_name=tiny", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=2", "base_num_kv_heads=2",
          "head_dim=32", "base_num_decoder_layers=2", "dtype=float32"]
COMMON = ["dataset_type=text", "enable_tensorboard=false", "write_report=false", "lr_schedule_type=wsd",
          "warmup_steps_fraction=0.1", "wsd_decay_steps_fraction=0.2"]
SWEEP = {"adamw": (1e-3, 3e-3, 1e-2), "muon": (3e-3, 1e-2, 3e-2)}


def train(argv: list[str], steps: int, eval_every: int = 0) -> dict:
    """One run: its loss curve, median step time after the first step, compiled step memory, and
    every `eval_every` steps the eval split's loss (the same eval_steps batches each time)."""
    import jax
    from flax import nnx

    from maxlite import build as build_lib, config as C, mesh as mesh_lib
    from maxlite.data import make_iterator
    from maxlite.evaluation import Evaluator

    built = build_lib.build(C.load(argv), jax.devices()[:1], num_processes=1)
    state, step = built.init_state(), built.train_step
    data = make_iterator(built.cfg, "train", 0, 1)
    evaluator = Evaluator(built.cfg, built.graphdef, built.shardings.params, built.batch_sharding, 0, 1)
    out, times, memory, evals = [], [], None, {}
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for i in range(steps):
            batch = {k: jax.device_put(v, built.batch_sharding) for k, v in next(data).items()}
            if i == 0:
                analysis = step.lower(state, batch).compile().memory_analysis()
                if analysis is not None:
                    memory = {"argument_bytes": analysis.argument_size_in_bytes,
                              "temp_bytes": analysis.temp_size_in_bytes,
                              "output_bytes": analysis.output_size_in_bytes}
            start = time.perf_counter()
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - start)
            if eval_every and ((i + 1) % eval_every == 0 or i + 1 == steps):
                evals[i + 1] = round(evaluator.run(state.params)["loss"], 5)
    data.close()
    times = sorted(times[1:]) or [0.0]
    return {"losses": out, "eval_losses": evals, "step_seconds_median": times[len(times) // 2],
            "compiled_memory": memory, "device": jax.devices()[0].device_kind}


def sweep_arg(text: str) -> dict[str, tuple[float, ...]]:
    out = dict(SWEEP)
    for item in text.split():
        opt, rates = item.split("=", 1)
        out[opt] = tuple(float(r) for r in rates.split(","))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", default="", help="a preset, trained in the default dtypes (default: shrunk tiny)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="score the eval split every this many steps (0: training loss only)")
    parser.add_argument("--sweep", default="", help="e.g. 'adamw=1e-3,3e-3 muon=1e-2' (default: SWEEP)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/optimizers_tiny.json"))
    args, extra = parser.parse_known_args()
    sweep = sweep_arg(args.sweep)
    recipe = ["base.yml", *([f"model_name={args.model}"] if args.model else SHRUNK), *COMMON,
              f"max_target_length={args.length}", f"per_device_batch_size={args.batch}"]
    runs = []
    for opt, rates in sweep.items():
        for lr in rates:
            start = time.perf_counter()
            run = train([*recipe, f"steps={args.steps}", f"opt_type={opt}", f"learning_rate={lr}", *extra],
                        args.steps, args.eval_every)
            curve = run.pop("losses")
            runs.append({"opt_type": opt, "learning_rate": lr, "final_loss": sum(curve[-5:]) / 5,
                         "seconds": round(time.perf_counter() - start, 1), **run,
                         "losses": [round(x, 4) for x in curve]})
            print(f"{opt} lr={lr:g}: final {runs[-1]['final_loss']:.4f}, "
                  f"{run['step_seconds_median'] * 1e3:.1f} ms/step, memory {run['compiled_memory']}", flush=True)
            report(args, recipe, sweep, runs)


def report(args, recipe: list[str], sweep: dict, runs: list[dict]) -> None:
    """The JSON so far (written after every run: a run cut short keeps the ones before it)."""
    best = {opt: min((r for r in runs if r["opt_type"] == opt), key=lambda r: r["final_loss"])
            for opt in sweep if any(r["opt_type"] == opt for r in runs)}
    reached = eval_reached = None
    if "adamw" in best and "muon" in best:
        target, curve = best["adamw"]["final_loss"], best["muon"]["losses"]
        reached = next((i + 1 for i in range(4, len(curve)) if sum(curve[i - 4:i + 1]) / 5 <= target), None)
        if args.eval_every:  # the same on the eval split: AdamW's best final eval loss, Muon's best run
            last = lambda r: r["eval_losses"][max(r["eval_losses"])]  # noqa: E731
            adamw = min((r for r in runs if r["opt_type"] == "adamw"), key=last)
            muon = min((r for r in runs if r["opt_type"] == "muon"), key=last)
            eval_reached = {"adamw_final_eval_loss": last(adamw), "adamw_learning_rate": adamw["learning_rate"],
                            "muon_learning_rate": muon["learning_rate"],
                            "muon_step": next((s for s, v in sorted(muon["eval_losses"].items()) if v <= last(adamw)),
                                              None)}
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    ratio = (round(best["muon"]["step_seconds_median"] / best["adamw"]["step_seconds_median"], 3)
             if "adamw" in best and "muon" in best and best["adamw"]["step_seconds_median"] else None)
    result = {
        "command": " ".join(["python", "benchmarks/bench_optimizers.py", *sys.argv[1:]]),
        "recipe": recipe, "steps": args.steps, "sweep": sweep,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "flags": [x for x in flags if x.startswith(("avx", "amx", "fma"))],
                    "load_average": os.getloadavg()},
        "best": {opt: {"learning_rate": r["learning_rate"], "final_loss": r["final_loss"],
                       "step_seconds_median": r["step_seconds_median"], "compiled_memory": r["compiled_memory"]}
                 for opt, r in best.items()},
        "muon_to_adamw_step_time": ratio,
        "muon_steps_to_adamw_final_loss": reached,
        "muon_steps_to_adamw_final_eval_loss": eval_reached,
        "ratio_to_adamw_steps": None if reached is None else round(reached / args.steps, 3),
        "runs": runs,
    }
    write_result(result, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
