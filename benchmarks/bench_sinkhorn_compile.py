"""XLA:CPU's compile of DeepSeek-V4's unrolled Sinkhorn passes → benchmarks/results/sinkhorn_compile.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_sinkhorn_compile.py

Two parts, each compile's CPU seconds (process time) from one lowering, in a process with the tests'
cheaper compile (tests/xla_flags.py: LLVM -O0, loop emitters, one LLVM module) and in one with XLA's
defaults:

- `preset`: the training step of DeepSeek-V4's shrunk preset (tests/helpers.shrunk, 3 layers, 3
  residual streams, bf16 compute) with `hc_sinkhorn_iters` 3 (what the tests run) and 20 (published);
  the first step's loss beside it (the passes converge: the two agree to a few 1e-5).
- `chain`: the gradient of k chains of 5 Sinkhorn passes (rows, then columns) on a [2, 8, 4, 4]
  array, one after another in one program: the compile grows faster than k (XLA's instruction fusion
  copies the chain of producers into each consumer it fuses).

Each compile is a fresh one: an unused option (the collective timeout) differs per compile, so JAX's
in-memory cache never answers; the persistent cache is off.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import cpuinfo, write_result  # noqa: E402
from tests.xla_flags import CHEAP_COMPILE  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "sinkhorn_compile.json"

# each set of flags in a process of its own (XLA_FLAGS hold for a whole process)
FLAGS = {"tests": CHEAP_COMPILE, "xla_defaults": ""}
_fresh = iter(range(1000, 10**6))


def compile_cpu_s(lowered) -> float:
    t = time.process_time()
    lowered.compile(compiler_options={"xla_cpu_collective_timeout_seconds": next(_fresh)})
    return round(time.process_time() - t, 2)


def preset_rows() -> list[dict]:
    import jax
    from flax import nnx

    from maxlite import mesh as mesh_lib
    from maxlite.data.synthetic import make_synthetic_iterator
    from maxlite.models import matmul
    from tests.helpers import build, shrunk

    rows = []
    for iters in (3, 20):
        with matmul.cpu_path("bf16"):
            cfg, mesh, state, step, sharding = build(shrunk("deepseek-v4-flash") + [f"hc_sinkhorn_iters={iters}"], 1)
            data = make_synthetic_iterator(cfg, "train", 0, 1)
            with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
                batch = {k: jax.device_put(v, sharding) for k, v in next(data).items()}
                lowered = step.lower(state, batch)
                row = {"hc_sinkhorn_iters": iters, "stablehlo_lines": lowered.as_text().count("\n")}
                row["compile_cpu_s"] = compile_cpu_s(lowered)
                row["first_loss"] = float(step(state, batch)[1]["loss"])
        rows.append(row)
    return rows


def chain_rows() -> list[dict]:
    import jax
    import jax.numpy as jnp

    def program(k: int):
        def f(x):
            for j in range(k):
                x = x * (j + 1)
                for _ in range(5):
                    x = x / (jnp.sum(x, -1, keepdims=True) + 1e-6)
                    x = x / (jnp.sum(x, -2, keepdims=True) + 1e-6)
            return jnp.sum(x)
        return jax.jit(jax.grad(f)).lower(jnp.ones((2, 8, 4, 4)))

    rows = []
    for k in (4, 8, 12):
        lowered = program(k)
        row = {"chains_of_5_passes": k, "compile_cpu_s": compile_cpu_s(lowered)}
        rows.append(row)
    return rows


def one() -> None:
    """This process's flags: its rows as one JSON line."""
    print(json.dumps({"preset": preset_rows(), "chain": chain_rows()}))


def main() -> int:
    import platform

    if sys.argv[1:] == ["--one"]:
        one()
        return 0
    cpu, flags = cpuinfo("model name") or platform.processor(), cpuinfo("flags").split()
    result = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags},
              "flags": FLAGS}
    for name, flags in FLAGS.items():
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {flags}".strip()}
        done = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True, text=True, check=True)
        result[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, result[name], flush=True)
    write_result(result, OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
