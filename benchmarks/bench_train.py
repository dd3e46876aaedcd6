"""Training throughput on this machine: matmul peak, tokens/s, TFLOP/s/device, MFU, time to first step.

    python benchmarks/bench_train.py model_name=tiny [key=value ...] [--steps 30] [--out FILE]
    python benchmarks/bench_train.py model_name=tiny max_target_length=8192 --compare-memory \
        attention=blockwise,dot_product
    python benchmarks/bench_train.py model_name=llama3.2-1b --compare attention=cudnn_flash,dot_product
    python benchmarks/bench_train.py model_name=llama3.2-3b --compare quantization= --compare quantization=fp8

Writes JSON (default benchmarks/results/train_<model_name>.json). Run it on an otherwise idle
machine: the figures are ratios measured in one run (MFU against the matmul peak in the model's
compute dtype, measured just before).
Time to first step runs the recipe twice in fresh processes with a fresh compilation cache: cold
(compiles) and warm (loads the compiled programs). Each `--compare k=v,k2=v2` trains the recipe
with those overrides and reports each variant, and each later variant's tokens/s and final loss
as a ratio to the first's; each `--compare-memory k=v,...` runs 2 steps of a
variant in a fresh process and reports its measured peak (device peak on accelerators, the
process's max RSS on CPU) and the compiler's temporaries, with ratios to the first variant.
On a GPU/TPU the same script uses every local device and also reports the published peak.
"""

from __future__ import annotations

import argparse
import json
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


def _first_step(overrides: list[str], out_dir: str, run_name: str) -> dict:
    """Wall seconds from process start (python + imports + compile) to the first `completed step`."""
    cmd = [sys.executable, "-m", "maxlite.train", "base.yml", *overrides, "steps=1",
           f"base_output_directory={out_dir}", f"run_name={run_name}", "enable_tensorboard=false",
           f"jax_cache_dir={out_dir}/jax_cache"]
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


def time_to_first_step(overrides: list[str], out_dir: str) -> dict:
    """Cold (empty compilation cache) then warm (the same recipe again: programs loaded)."""
    cold = _first_step(overrides, out_dir, "first_step_cold")
    warm = _first_step(overrides, out_dir, "first_step_warm")
    return {"seconds": warm["seconds"], "cold_seconds": cold["seconds"], "command": warm["command"]}


def _peak_child(overrides: list[str], out_dir: str) -> None:
    """(In a fresh process) 2 steps of the recipe; print the measured and compiled peaks as JSON."""
    import resource

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import config as C, mesh as mesh_lib
    from maxlite.build import build
    from maxlite.train import train

    cfg = C.load(["base.yml", *overrides, "steps=2", f"base_output_directory={out_dir}",
                  "run_name=peak", "enable_tensorboard=false", "enable_progress_bar=false",
                  "enable_checkpointing=false", "jax_cache_dir="])
    train(cfg)
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    measured = stats.get("peak_bytes_in_use") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # the compiler's view of the same step (the trainer's own wiring): temporaries at its peak
    built = build(cfg)
    B, T = built.cfg.global_batch_size, built.cfg.max_target_length
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.float32 if k == "weights" else jnp.int32,
                                     sharding=built.batch_sharding)
             for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
    state_in = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            built.abstract, built.shardings)
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        analysis = built.train_step.lower(state_in, batch).compile().memory_analysis()
    print("PEAK " + json.dumps({
        "measured_peak_bytes": measured,
        "measured_by": "device peak_bytes_in_use" if stats else "process max RSS (ru_maxrss)",
        "compiler_temp_bytes": analysis.temp_size_in_bytes}))


def compare_memory(overrides: list[str], variants: list[str], out_dir: str) -> dict:
    rows = {}
    for variant in variants:
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--peak-child", *overrides,
               *variant.split(",")]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                             env=dict(os.environ, BENCH_OUT=out_dir))
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PEAK ")), None)
        if out.returncode or line is None:
            raise SystemExit(f"peak run failed (exit {out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
        rows[variant] = json.loads(line[5:]) | {"command": " ".join(cmd[1:])}
    first, *rest = variants
    for variant in rest:
        for k in ("measured_peak_bytes", "compiler_temp_bytes"):
            rows[variant][f"{k}_ratio_to_first"] = rows[variant][k] / rows[first][k]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config key=value, e.g. model_name=tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-first-step", action="store_true", help="skip the time-to-first-step run")
    parser.add_argument("--compare", action="append", default=[], help="k=v[,k2=v2]: a variant to "
                        "train (repeat; e.g. attention=cudnn_flash and attention=dot_product on a GPU)")
    parser.add_argument("--compare-memory", action="append", default=[],
                        help="k=v[,k2=v2]: a variant whose 2-step peak memory is measured (repeat)")
    parser.add_argument("--peak-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    overrides = list(args.overrides) or ["model_name=tiny"]
    if args.peak_child:
        return _peak_child(overrides, os.environ.get("BENCH_OUT", tempfile.gettempdir()))
    name = next((o.split("=", 1)[1] for o in overrides if o.startswith("model_name=")), "custom")
    if args.compare_memory:
        with tempfile.TemporaryDirectory() as tmp:
            rows = compare_memory(overrides, args.compare_memory, tmp)
        out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"train_{name}_memory.json")
        return write_result({"config": overrides, "peaks": rows}, out)
    if args.compare:
        runs = {v: measure(overrides + v.split(","), args.steps, args.skip_first_step) for v in args.compare}
        first, *rest = args.compare
        for variant in rest:  # e.g. quantization=int8 against quantization= (bf16), measured in one run
            for k in ("tokens_per_second", "final_loss"):
                runs[variant][f"{k}_ratio_to_first"] = runs[variant][k] / runs[first][k]
        out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"train_{name}_compare.json")
        return write_result({"config": overrides, "runs": runs}, out)
    out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"train_{name}.json")
    write_result(measure(overrides, args.steps, args.skip_first_step), out)


def measure(overrides: list[str], steps: int, skip_first_step: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        first = None if skip_first_step else time_to_first_step(overrides, tmp)

        import jax

        from maxlite import config as C
        from maxlite.peak import measure_matmul_tflops, peak_tflops_per_device
        from maxlite.train import train

        peaks = {dtype: measure_matmul_tflops(dtype, size=2048 if jax.devices()[0].platform == "cpu"
                                              else 8192) for dtype in ("float32", "bfloat16")}
        cfg = C.load(["base.yml", *overrides, f"steps={steps}", f"base_output_directory={tmp}",
                      "run_name=bench", "enable_tensorboard=false", "log_period=10",
                      "enable_progress_bar=false"])
        summary = train(cfg)

    platform_name = jax.devices()[0].platform
    # Simulated CPU devices share the host: the per-device peak is the host's over the local count.
    share = jax.local_device_count() if platform_name == "cpu" else 1
    result = {
        "config": overrides,
        "steps": steps,
        "device": jax.devices()[0].device_kind,
        "platform": platform_name,
        "num_devices": jax.device_count(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "matmul_peak_tflops_per_device": {k: v / share for k, v in peaks.items()},
        "tokens_per_second": summary["tokens_per_second"],
        "tokens_per_second_per_device": summary["tokens_per_second_per_device"],
        "tflops_per_device": summary["tflops_per_device"],
        "compute_dtype": cfg.dtype,
        "quantization": cfg.quantization,
        # the run's own MFU: against the peak of its compute dtype (maxlite.peak, as train() picks it)
        "mfu": summary.get("mfu"),
        "mfu_peak_source": summary.get("peak_source"),
        "mfu_vs_measured_f32_peak": summary["tflops_per_device"] / (peaks["float32"] / share),
        "mfu_vs_measured_bf16_peak": summary["tflops_per_device"] / (peaks["bfloat16"] / share),
        "final_loss": summary["final_loss"],
        "time_to_first_step": first,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if platform_name != "cpu":
        published, source = peak_tflops_per_device()
        result["published_peak"] = {"tflops": published, "source": source,
                                    "mfu": summary["tflops_per_device"] / published}
    return result


if __name__ == "__main__":
    main()
