"""Muon against AdamW: a small learning-rate sweep of each on the bundled corpus, and the steps Muon
needs to reach AdamW's best final loss.

    python benchmarks/bench_optimizers.py [--steps 60] [--out FILE] [key=value ...]

Trains a shrunk `tiny` (the tests' SMALL model, 1 CPU device, 8 × 64 tokens per step) with each
optimizer at each learning rate of its sweep, on the same batches (dataset_type=text); writes every
loss curve, each run's final loss (the mean of its last 5 steps), and the first step at which
Muon's best run's 5-step mean reaches AdamW's best final loss (benchmarks/results/optimizers_tiny.json).
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

RECIPE = ["base.yml", "model_name=tiny", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=2",
          "base_num_kv_heads=2", "head_dim=32", "base_num_decoder_layers=2", "dataset_type=text",
          "max_target_length=64", "per_device_batch_size=8", "dtype=float32", "enable_tensorboard=false",
          "write_report=false", "lr_schedule_type=wsd", "warmup_steps_fraction=0.1", "wsd_decay_steps_fraction=0.2"]
SWEEP = {"adamw": (1e-3, 3e-3, 1e-2), "muon": (3e-3, 1e-2, 3e-2)}


def losses(argv: list[str], steps: int) -> list[float]:
    import jax
    from flax import nnx

    from maxlite import build as build_lib, config as C, mesh as mesh_lib
    from maxlite.data import make_iterator

    built = build_lib.build(C.load(argv), jax.devices()[:1], num_processes=1)
    state, step = built.init_state(), built.train_step
    data = make_iterator(built.cfg, "train", 0, 1)
    out = []
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(steps):
            batch = {k: jax.device_put(v, built.batch_sharding) for k, v in next(data).items()}
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
    data.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/optimizers_tiny.json"))
    args, extra = parser.parse_known_args()
    runs = []
    for opt, rates in SWEEP.items():
        for lr in rates:
            start = time.perf_counter()
            curve = losses([*RECIPE, f"steps={args.steps}", f"opt_type={opt}", f"learning_rate={lr}", *extra],
                           args.steps)
            runs.append({"opt_type": opt, "learning_rate": lr, "final_loss": sum(curve[-5:]) / 5,
                         "seconds": round(time.perf_counter() - start, 1), "losses": [round(x, 4) for x in curve]})
            print(f"{opt} lr={lr:g}: final {runs[-1]['final_loss']:.4f}", flush=True)
    best = {opt: min((r for r in runs if r["opt_type"] == opt), key=lambda r: r["final_loss"]) for opt in SWEEP}
    target, curve = best["adamw"]["final_loss"], best["muon"]["losses"]
    reached = next((i + 1 for i in range(4, len(curve)) if sum(curve[i - 4:i + 1]) / 5 <= target), None)
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    result = {
        "command": " ".join(["python", "benchmarks/bench_optimizers.py", *sys.argv[1:]]),
        "recipe": RECIPE, "steps": args.steps, "sweep": SWEEP,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "flags": [x for x in flags if x.startswith(("avx", "amx", "fma"))],
                    "load_average": os.getloadavg()},
        "best": {opt: {"learning_rate": r["learning_rate"], "final_loss": r["final_loss"]} for opt, r in best.items()},
        "muon_steps_to_adamw_final_loss": reached,
        "ratio_to_adamw_steps": None if reached is None else round(reached / args.steps, 3),
        "runs": runs,
    }
    write_result(result, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
