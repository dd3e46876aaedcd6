"""Peak matmul throughput of one device: published for accelerators, measured with XLA on CPU."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from maxlite.chips import PEAK_TFLOPS


def measure_matmul_tflops(dtype: str = "float32", size: int = 2048, repeats: int = 10,
                          device=None) -> float:
    """Best-of-N TFLOP/s of a square XLA matmul on one device (what the hardware gives XLA)."""
    device = device or jax.local_devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    b = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_tflops_per_device(dtype: str = "bfloat16") -> tuple[float, str]:
    """(peak, where it came from): published figure for known chips, else measured f32 on CPU."""
    device = jax.local_devices()[0]
    for name, peak in PEAK_TFLOPS.items():
        if device.device_kind.startswith(name):
            return peak, f"published {name} {dtype} peak"
    return measure_matmul_tflops("float32", device=device), f"measured XLA f32 matmul on {device.device_kind}"
