"""Pipeline parallelism on simulated CPU devices: step time and per-device memory of pipelined
layouts against fsdp over all devices, with the same model and global batch.

    python benchmarks/bench_pipeline.py [--devices 8] [--steps 5] [--out FILE] [key=value ...]

Layouts: fsdp 8; pipeline 4 × fsdp 2 (GPipe, 4 and 8 micro-batches); pipeline 2 × fsdp 4 (circular,
2 repeats). Each: the median of --steps timed steps after one warm-up (compile) step, XLA's compiled
memory analysis per device (arguments + outputs + temporaries), the schedule's bubble
(P − 1)/(R·M + P − 1), and the pipelined step's extra time against fsdp 8, 1 − t_fsdp / t_pipeline.
On CPU the "devices" share the same cores: an idle stage computes (discarded) work, so that extra
time is the bubble plus the pipeline's own overheads (the shifts, the per-stage embedding and
output head), not the speed-up real chips would see. The load average is recorded: other jobs
share the cores. Writes JSON (default benchmarks/results/pipeline_cpu.json).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks._results import write_result  # noqa: E402

LAYOUTS = {
    "fsdp8": ["ici_fsdp_parallelism=-1"],
    "pipeline4_fsdp2": ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=-1"],
    "pipeline4_fsdp2_m8": ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=-1", "num_pipeline_microbatches=8"],
    "pipeline2_fsdp4_circular2": ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=-1", "num_pipeline_repeats=2"],
}


def _run(recipe: list[str], steps: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from maxlite import build as build_lib, config as C, mesh as mesh_lib
    from maxlite.data.synthetic import make_synthetic_iterator

    built = build_lib.build(C.load(recipe))
    cfg, state = built.cfg, built.init_state()
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    load_before = os.getloadavg()
    times = []
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        batch = {k: jax.device_put(v, built.batch_sharding) for k, v in next(data).items()}
        memory = built.train_step.lower(state, batch).compile().memory_analysis()
        for i in range(steps + 1):
            batch = {k: jax.device_put(v, built.batch_sharding) for k, v in next(data).items()}
            start = time.perf_counter()
            state, metrics = built.train_step(state, batch)
            loss = float(metrics["loss"])
            if i:  # the first call compiles
                times.append(time.perf_counter() - start)
    per_device = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    return {"step_seconds_median": statistics.median(times), "step_seconds": times,
            "memory_bytes_per_device": per_device, "temp_bytes_per_device": memory.temp_size_in_bytes,
            "pipeline": cfg.pipeline_schedule, "mesh": dict(zip(built.mesh.axis_names, built.mesh.devices.shape)),
            "global_batch": cfg.global_batch_size, "last_loss": loss, "finite": bool(np.isfinite(loss)),
            "load_average_1_5_15min": {"before": list(load_before), "after": list(os.getloadavg())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline_cpu.json"))
    args, overrides = parser.parse_known_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    recipe = ["base.yml", "model_name=tiny", "max_target_length=256", "per_device_batch_size=2", "dtype=float32",
              "enable_tensorboard=false", "write_report=false", *overrides]
    rows = {name: _run([*recipe, *layout], args.steps) for name, layout in LAYOUTS.items()}
    base = rows["fsdp8"]["step_seconds_median"]
    for row in rows.values():
        if row["pipeline"]:
            row["bubble_formula"] = row["pipeline"]["bubble_fraction"]
            row["extra_time_vs_fsdp8"] = 1 - base / row["step_seconds_median"]
        row["step_time_vs_fsdp8"] = row["step_seconds_median"] / base
    cpu_flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    write_result({"recipe": recipe, "devices": args.devices, "steps": args.steps, "machine": platform.machine(),
                  "cpu_flags": sorted(f for f in cpu_flags if f.startswith(("avx", "amx", "fma"))),
                  "layouts": rows}, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
