"""How far quantized training moves the loss, against how far a change of seed moves it.

    python benchmarks/bench_quant_losses.py [--steps 50] [--seeds 8] [--out FILE]

Trains the recipe of tests/test_quant.py (`tiny`, 2 CPU devices × 4 rows × 32 tokens) in bf16 with
seeds 0..N-1, and with each quantization mode for two of those seeds; writes every loss curve, the
per-step standard deviation across the bf16 seeds, and each quantized run's largest distance from
the bf16 run of its own seed (benchmarks/results/quant_losses_tiny.json). The test's tolerance is
the smallest of those standard deviations.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # as the tests see it
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks._results import write_result  # noqa: E402

RECIPE = ["base.yml", "model_name=tiny", "max_target_length=32", "per_device_batch_size=4",
          "enable_tensorboard=false", "write_report=false"]


def main() -> None:
    import numpy as np

    from helpers import train_losses

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--modes", default="int8,fp8,fp8_full")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant_losses_tiny.json"))
    args = parser.parse_args()

    def losses(mode: str, seed: int) -> list[float]:
        run, _ = train_losses([*RECIPE, f"steps={args.steps}", f"quantization={mode}", f"seed={seed}"], 2,
                              args.steps)
        return run.tolist()

    bf16 = {seed: losses("", seed) for seed in range(args.seeds)}
    std = np.array(list(bf16.values())).std(axis=0, ddof=1)
    quantized = {}
    for mode in args.modes.split(","):
        for seed in (0, args.seeds // 2):
            run = losses(mode, seed)
            gap = np.abs(np.array(run) - np.array(bf16[seed]))
            quantized[f"{mode}_seed{seed}"] = {"losses": run, "max_distance": float(gap.max()),
                                               "at_step": int(gap.argmax()) + 1}
    write_result({"recipe": RECIPE, "steps": args.steps, "devices": 2,
                  "bf16_losses_by_seed": bf16,
                  "bf16_seed_std_per_step": std.tolist(),
                  "bf16_seed_std_min": float(std.min()), "bf16_seed_std_min_at_step": int(std.argmin()) + 1,
                  "bf16_seed_std_median": float(np.median(std)),
                  "quantized": quantized}, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
