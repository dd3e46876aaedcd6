"""Training throughput on this machine: matmul peak, tokens/s, TFLOP/s/device, MFU, time to first step.

    python benchmarks/bench_train.py model_name=tiny [key=value ...] [--steps 30] [--out FILE]

Writes JSON (default benchmarks/results/train_<model_name>.json). Run it on an otherwise idle
machine: the figures are ratios measured in one run (MFU against the peak measured just before).
On a GPU/TPU the same script uses every local device and also reports the published peak.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks._results import write_result  # noqa: E402


def time_to_first_step(overrides: list[str], out_dir: str) -> dict:
    """Wall seconds from process start (python + imports + compile) to the first `completed step`."""
    cmd = [sys.executable, "-m", "maxlite.train", "base.yml", *overrides, "steps=1",
           f"base_output_directory={out_dir}", "run_name=first_step", "enable_tensorboard=false"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    first = None
    for line in proc.stdout:
        if line.startswith("completed step: 1,") and first is None:
            first = time.perf_counter() - start
    proc.wait()
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"first-step run failed (exit {proc.returncode}): {' '.join(cmd)}")
    return {"seconds": first, "command": " ".join(cmd[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config key=value, e.g. model_name=tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-first-step", action="store_true", help="skip the time-to-first-step run")
    args = parser.parse_args()

    overrides = list(args.overrides) or ["model_name=tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        first = None if args.skip_first_step else time_to_first_step(overrides, tmp)

        import jax

        from maxlite import config as C
        from maxlite.peak import measure_matmul_tflops, peak_tflops_per_device
        from maxlite.train import train

        peaks = {dtype: measure_matmul_tflops(dtype, size=2048 if jax.devices()[0].platform == "cpu"
                                              else 8192) for dtype in ("float32", "bfloat16")}
        cfg = C.load(["base.yml", *overrides, f"steps={args.steps}", f"base_output_directory={tmp}",
                      "run_name=bench", "enable_tensorboard=false", "log_period=10",
                      "enable_progress_bar=false"])
        summary = train(cfg)

    platform_name = jax.devices()[0].platform
    # Simulated CPU devices share the host: the per-device peak is the host's over the local count.
    share = jax.local_device_count() if platform_name == "cpu" else 1
    result = {
        "config": overrides,
        "steps": args.steps,
        "device": jax.devices()[0].device_kind,
        "platform": platform_name,
        "num_devices": jax.device_count(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "matmul_peak_tflops_per_device": {k: v / share for k, v in peaks.items()},
        "tokens_per_second": summary["tokens_per_second"],
        "tokens_per_second_per_device": summary["tokens_per_second_per_device"],
        "tflops_per_device": summary["tflops_per_device"],
        "mfu_vs_measured_f32_peak": summary["tflops_per_device"] / (peaks["float32"] / share),
        "mfu_vs_measured_bf16_peak": summary["tflops_per_device"] / (peaks["bfloat16"] / share),
        "final_loss": summary["final_loss"],
        "time_to_first_step": first,
    }
    if platform_name != "cpu":
        published, source = peak_tflops_per_device()
        result["published_peak"] = {"tflops": published, "source": source,
                                    "mfu": summary["tflops_per_device"] / published}
    name = next((o.split("=", 1)[1] for o in overrides if o.startswith("model_name=")), "custom")
    out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"train_{name}.json")
    write_result(result, out)


if __name__ == "__main__":
    main()
