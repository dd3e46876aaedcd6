"""The CPU matmul paths (`cpu_matmul`) on this machine: what `auto` chooses, and a train step in each.

    JAX_PLATFORMS=cpu python benchmarks/bench_cpu_matmul.py [--repeats 5] [--steps 3] [key=value ...] [--out FILE]

On MaxText's tiny configuration by default (emb 256, 4 layers, vocab 32,000, 256 tokens, batch 1,
synthetic data, one device): the start-up probe's timings at these shapes (maxlite/cpu_matmul.py,
not cached: measured here, and how long it took), then one train step per path (`bf16`, `f32`, and
`auto` as a run would resolve it with no cache: its own probe at build), interleaved repeat by
repeat (median wall and process CPU seconds per step). Writes JSON with the command, the CPU's model and
flags and the load average before and after (default benchmarks/results/cpu_matmul_<cpu>.json).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks._results import cpuinfo, write_result  # noqa: E402
from benchmarks.bench_moe_cpu import _interleaved, _load, _summary  # noqa: E402

TINY = ["base.yml", "model_name=tiny", "vocab_size=32000", "max_target_length=256", "per_device_batch_size=1",
        "dataset_type=synthetic", "enable_checkpointing=false", "remat_policy=none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="train steps per repeat and path")
    parser.add_argument("--out", default="")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import jax
    from flax import nnx

    from maxlite import build as build_lib, config as C, cpu_matmul, mesh as mesh_lib
    from maxlite.data.synthetic import make_synthetic_iterator

    load_before = _load()
    argv = TINY + args.overrides
    start = time.perf_counter()
    probe = cpu_matmul.probe(C.load(argv))
    probe_wall = time.perf_counter() - start
    fns, auto = {}, None
    for path in (*cpu_matmul.PATHS, "auto"):
        # jax_cache_dir empty: no cpu_matmul.json, so `auto` measures at build as a new machine would
        built = build_lib.build(C.load(argv + [f"cpu_matmul={path}", "jax_cache_dir="]), jax.devices()[:1],
                                num_processes=1)
        auto = built.cpu_matmul if path == "auto" else auto
        batch = {k: jax.device_put(v, built.batch_sharding)
                 for k, v in next(make_synthetic_iterator(built.cfg, "train", 0, 1)).items()}
        box = {"state": built.init_state()}

        def step(built=built, batch=batch, box=box):
            with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
                box["state"], metrics = built.train_step(box["state"], batch)
            return metrics["loss"]

        jax.block_until_ready(step())  # compiled now, with this path set (build set it)
        fns[path] = step
    steps = _summary(_interleaved(fns, args.repeats, args.steps), "bf16")
    cpu = re.sub(r"[^a-z0-9]+", "-", cpuinfo("model name").lower()).strip("-") or "cpu"
    out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"cpu_matmul_{cpu}.json")
    write_result({
        "command": "JAX_PLATFORMS=cpu python benchmarks/bench_cpu_matmul.py " + " ".join(sys.argv[1:]),
        "config": argv, "cpu_model": cpuinfo("model name"), "cpu_flags": cpuinfo("flags"),
        "cpus": os.cpu_count(), "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "load_before": load_before, "load_after": _load(),
        "probe_seconds": probe, "probe_wall_s": probe_wall, "auto_would_choose": cpu_matmul.faster(probe),
        "auto_chose": auto.record(),
        "step_faster_path": min(cpu_matmul.PATHS, key=lambda p: steps[p]["median_wall_s"]),
        "step_faster_path_cpu_s": min(cpu_matmul.PATHS, key=lambda p: steps[p]["median_cpu_s"]),
        "repeats": args.repeats, "steps_per_repeat": args.steps, "step": steps,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, out)


if __name__ == "__main__":
    main()
