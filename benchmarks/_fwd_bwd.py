"""One forward + backward of a function on XLA:CPU, measured the way the scan benchmarks report it
(bench_mamba2_scan.py, bench_delta_rule.py)."""

from __future__ import annotations

import statistics
import time


def fwd_bwd(objective, *args) -> dict:
    """jax.value_and_grad of `objective` (a scalar of `args`, differentiated in all of them), compiled
    once: its temporaries (`memory_analysis().temp_size_in_bytes`, MiB), the median seconds of 3 calls
    after a warm-up, and the objective's value."""
    import jax

    f = jax.jit(jax.value_and_grad(objective, argnums=tuple(range(len(args)))))
    compiled = f.lower(*args).compile()
    value = float(jax.block_until_ready(compiled(*args))[0])
    times = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return {"temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
            "fwd_bwd_s": round(statistics.median(times), 3), "objective": value}
