"""LoRA against full fine-tuning → benchmarks/results/lora.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_lora.py [model_name=llama-100m] [--rank 16] [--steps 5]

For the same recipe, with and without `lora_rank`: parameter bytes, optimizer-state bytes (what
the state holds: Adam's two moments of the trained parameters) and the mean step time over
`--steps` steps after one compiling step, on this machine's devices. Step times are from one run
each: compare them as a ratio.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "lora.json"


def measure(argv: list[str], steps: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from maxlite import api, config as C, mesh as mesh_lib
    from maxlite.build import build
    from maxlite.state import nbytes, split_trainable

    built = build(C.load(argv))
    state = built.init_state()
    cfg = built.cfg
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (cfg.global_batch_size, cfg.max_target_length + 1))
    batch = {k: jax.device_put(v, built.batch_sharding) for k, v in api.make_batch(tokens).items()}
    times = []
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for i in range(steps + 1):
            t = time.perf_counter()
            state, metrics = built.train_step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t)
    trained = split_trainable(built.abstract.params)[0]
    return {"param_bytes": nbytes(built.abstract.params), "trained_param_bytes": nbytes(trained),
            "optimizer_state_bytes": nbytes(built.abstract.opt_state),
            "first_step_s": round(times[0], 3), "step_s": round(sum(times[1:]) / steps, 4),
            "final_loss": float(metrics["loss"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("overrides", nargs="*", default=["model_name=llama-100m"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    import jax
    base = ["base.yml", "per_device_batch_size=2", "max_target_length=256", "remat_policy=none", *args.overrides]
    full = measure(base, args.steps)
    lora = measure([*base, f"lora_rank={args.rank}"], args.steps)
    write_result({"device": jax.devices()[0].device_kind, "devices": jax.device_count(), "recipe": base,
                  "lora_rank": args.rank, "full": full, "lora": lora,
                  "optimizer_state_ratio": round(lora["optimizer_state_bytes"] / full["optimizer_state_bytes"], 4),
                  "step_time_ratio": round(lora["step_s"] / full["step_s"], 3),
                  "command": "JAX_PLATFORMS=cpu python benchmarks/bench_lora.py " + " ".join(sys.argv[1:])},
                 args.out)


if __name__ == "__main__":
    main()
