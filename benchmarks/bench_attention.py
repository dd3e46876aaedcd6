"""Attention alone, forward + backward: each implementation's time and TFLOP/s at one shape.

    python benchmarks/bench_attention.py [--impl cudnn_flash,dot_product] [--B 1 --T 8192 \
        --N 32 --K 8 --H 64] [--documents 4] [--out FILE]

Times jit(grad) of sum(attention(q, k, v, segments) · dout) in bf16 (median of --repeats after
warm-up), for rows holding one document and rows packing --documents of them. FLOPs are
maxlite.models.flops' causal count (half of 4·B·T²·N·H), × 3 with the backward pass.
On a GPU it adds `cudnn_flash dense mask` (`max_segments_per_seq=0`: the documents as a dense
[B, 1, T, S] mask) and `cudnn causal only`: the cuDNN kernel with no segment mask at all, the
floor. Writes JSON (default benchmarks/results/attention_<platform>.json). The default shape is
a GPU's; on a CPU pass a smaller one (`--T 1024 --N 4 --K 2`): dot_product's f32 scores at the
default take 8.6 GB.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks._results import write_result  # noqa: E402


def _segments(B: int, T: int, documents: int):
    import numpy as np

    bounds = np.linspace(0, T, documents + 1).astype(int)
    seg = np.zeros((B, T), np.int32)
    for i in range(documents):
        seg[:, bounds[i]:bounds[i + 1]] = i + 1
    return seg


def _time(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default=None, help="comma-separated (default: the platform's)")
    for dim, default in (("B", 1), ("T", 8192), ("N", 32), ("K", 8), ("H", 64)):
        parser.add_argument(f"--{dim}", type=int, default=default)
    parser.add_argument("--documents", type=int, default=4, help="documents packed in a row")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from maxlite import config as C
    from maxlite.models import attention
    from maxlite.models.flops import attention_flops

    platform = jax.devices()[0].platform
    default = {"gpu": "cudnn_flash,dot_product", "tpu": "flash,dot_product"}.get(
        platform, "blockwise,dot_product")
    B, T, N, K, H = args.B, args.T, args.N, args.K, args.H
    keys = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(k, (B, T, N, H), jnp.bfloat16) for k in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (B, T, K, H), jnp.bfloat16) for key in keys[1:3])
    impls = {name: getattr(attention, name) for name in (args.impl or default).split(",")}
    if "blockwise" in impls:
        impls["blockwise"] = lambda q, k, v, s: attention.blockwise(q, k, v, s, min(512, T))
    if "flash" in impls:
        sizes = attention.splash_block_sizes(C.load(["base.yml", f"max_target_length={T}"]), T)
        impls["flash"] = lambda q, k, v, s: attention.flash(q, k, v, s, sizes)
    if "cudnn_flash" in impls:  # as a recipe runs it: documents as offsets, then the dense mask
        most = C.load(["base.yml"]).max_segments_per_seq
        impls["cudnn_flash"] = lambda q, k, v, s: attention.cudnn_flash(q, k, v, s, most)
        impls["cudnn_flash dense mask"] = lambda q, k, v, s: attention.cudnn_flash(q, k, v, s, 0)
    if platform == "gpu":
        impls["cudnn causal only"] = lambda q, k, v, s: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")
    flops = 3 * attention_flops(B, T, N, H)  # forward + backward, the causal half
    rows = {}
    for name, fn in impls.items():
        grad = jax.jit(jax.grad(lambda q, k, v, s, fn=fn: jnp.sum(
            (fn(q, k, v, s) * dout).astype(jnp.float32)), argnums=(0, 1, 2)))
        for documents in sorted({1, args.documents}):
            seg = jnp.asarray(_segments(B, T, documents))
            seconds = _time(grad, (q, k, v, seg), args.repeats)
            rows[f"{name}, {documents} document(s)"] = {
                "ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
            print(f"{name:18s} {documents} doc(s): {seconds * 1e3:9.3f} ms  "
                  f"{flops / seconds / 1e12:8.3f} TFLOP/s", flush=True)
    out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"attention_{platform}.json")
    write_result({"device": jax.devices()[0].device_kind, "shape": dict(B=B, T=T, N=N, K=K, H=H),
                  "dtype": "bfloat16", "causal_flops_fwd_bwd": flops, "runs": rows}, out)


if __name__ == "__main__":
    main()
