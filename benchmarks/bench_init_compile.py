"""The initialiser's compile on XLA:CPU at LLVM -O1, -O2 and XLA's default -O3 → benchmarks/results/init_compile.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_init_compile.py [--models ...]

For each model (full-size presets in their own dtypes, and shrunk float32 presets as the family table
builds them): the train state's initialiser (`maxlite.state._init_fn`, jitted with the state's
shardings on one CPU device) lowered once and compiled at each level, its compile's CPU seconds
(process time: XLA compiles on several threads), the seconds of two runs, and a hash of the initial
parameters' bytes. `maxlite.state.init_compiler_options` compiles at -O1 on CPU because the bytes are
the same at every level and the compile is the cheapest; each run starts with an empty compile cache.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "init_compile.json"
SHRUNK = ("tiny", "deepseek-v3", "qwen3.5-27b", "gemma4-tiny")  # tests/helpers.shrunk, float32
FULL = ("gpt3-126m", "qwen3-0.6b")
LEVELS = (1, 2, 3)


def measure(argv: list[str]) -> list[dict]:
    import jax
    import numpy as np
    from flax import nnx

    from maxlite import config as C, mesh as M, state as S
    from maxlite.build import build

    built = build(C.load(argv + ["jax_cache_dir="]))
    rows = []
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(M.RULES):
        lowered = jax.jit(S._init_fn(built.cfg, built.tx), out_shardings=built.shardings).lower(
            jax.random.key(built.cfg.seed))
        for level in LEVELS:
            t = time.process_time()
            compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": level})
            compile_cpu = time.process_time() - t
            runs = []
            for _ in range(2):
                t = time.perf_counter()
                state = jax.block_until_ready(compiled(jax.random.key(built.cfg.seed)))
                runs.append(round(time.perf_counter() - t, 3))
            digest = hashlib.sha256()
            for x in jax.tree_util.tree_leaves(jax.device_get(nnx.to_pure_dict(state.params))):
                digest.update(np.ascontiguousarray(np.asarray(x)).tobytes())
            del state
            rows.append({"llvm_level": level, "compile_cpu_s": round(compile_cpu, 2), "run_s": runs,
                         "params_sha256": digest.hexdigest()})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[*(f"shrunk:{m}" for m in SHRUNK), *FULL])
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        sys.exit("bench_init_compile: XLA_FLAGS sets the level itself; unset it")
    from tests.helpers import shrunk

    results = []
    for model in args.models:
        name = model.removeprefix("shrunk:")
        argv = (shrunk(name) + ["dtype=float32"]) if model.startswith("shrunk:") else ["base.yml", f"model_name={name}"]
        rows = measure(argv + ["per_device_batch_size=1"])
        same = len({r["params_sha256"] for r in rows}) == 1
        results.append({"model": model, "argv": argv, "same_bytes_at_every_level": same, "levels": rows})
        print(f"{model}: compile CPU-s " + ", ".join(f"-O{r['llvm_level']} {r['compile_cpu_s']}" for r in rows)
              + f"; same bytes: {same}", file=sys.stderr, flush=True)
    import jax

    write_result({"what": "the train state's initialiser compiled by XLA:CPU at each LLVM level (empty "
                          "compile cache): compile CPU seconds, two runs' seconds, the initial parameters' hash",
                  "machine": os.uname().machine, "cpu_count": os.cpu_count(), "jax": jax.__version__,
                  "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
