"""Peak matmul throughput of one device: published for accelerators, measured with XLA on CPU."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from maxlite.chips import PEAK_TFLOPS


def measure_matmul_tflops(dtype: str = "float32", size: int = 2048, repeats: int = 10,
                          device=None) -> float:
    """Best-of-N TFLOP/s of a square XLA matmul on one device (what the hardware gives XLA), its
    operands in `dtype` and accumulated in float32, as the model's projections are
    (`maxlite.models.matmul.project`): on CPU a bf16 → bf16 dot would be upcast to f32."""
    device = device or jax.local_devices()[0]
    # random operands: constant ones or zeros run measurably faster on GPUs than real data
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(ka, (size, size), dtype), device)
    b = jax.device_put(jax.random.normal(kb, (size, size), dtype), device)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    matmul(a, b).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_tflops_per_device(dtype: str = "bfloat16", cpu_matmul: str = "bf16",
                           cache_file: str = "") -> tuple[float, str]:
    """(peak, where it came from): the published bf16 figure for known chips, else (CPU) measured
    for the product that runs: `dtype`, the model's compute dtype, or float32 where the CPU path
    upcasts it (`cpu_matmul` f32, maxlite/cpu_matmul.py). With a `cache_file` (cpu_matmul.json beside
    the compile cache) a CPU model measures each product once, as it chooses its matmul path once:
    the probe was half a CPU-second at the end of every run (tiny, 2 cores)."""
    device = jax.local_devices()[0]
    for name, peak in PEAK_TFLOPS.items():
        if device.device_kind.startswith(name):
            return peak, f"published {name} bf16 peak"
    if device.platform == "cpu" and cpu_matmul == "f32":
        dtype = "float32"
    # on CPU a 1024 product reaches the 2048 one's rate (0.099 against 0.084 TFLOP/s, 2 loaded cores)
    # at an eighth of the work: the 2048 probe was 9 s of the README demo's wall time
    size = 1024 if device.platform == "cpu" else 2048
    source = f"measured XLA {jnp.dtype(dtype).name} matmul on {device.device_kind}"
    if device.platform != "cpu" or not cache_file:
        return measure_matmul_tflops(dtype, size=size, device=device), source
    from maxlite import cpu_matmul as cache

    key = f"peak | {cache.cpu_identity()} | jax {jax.__version__} | {jnp.dtype(dtype).name} {size}x{size}"
    cached = cache.read_entries(cache_file).get(key)
    if cached:
        return cached["tflops"], f"{source} (cached in {os.path.basename(cache_file)})"
    peak = measure_matmul_tflops(dtype, size=size, device=device)
    cache.write_entry(cache_file, key, {"tflops": peak})
    return peak, source
