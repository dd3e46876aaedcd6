"""Attention alone, forward + backward: each implementation's time and TFLOP/s at one shape.

    python benchmarks/bench_attention.py [--impl cudnn_flash,dot_product] [--B 1 --T 8192 \
        --N 32 --K 8 --H 64] [--documents 4] [--window W] [--out FILE]

Times jit(grad) of sum(attention(q, k, v, segments) · dout) in bf16 (median of --repeats after
warm-up), for rows holding one document and rows packing --documents of them. FLOPs are
maxlite.models.flops' causal count (half of 4·B·T²·N·H), × 3 with the backward pass.
On a GPU it adds `cudnn_flash dense mask` (`max_segments_per_seq=0`: the documents as a dense
[B, 1, T, S] mask) and `cudnn causal only`: the cuDNN kernel with no segment mask at all, the
floor. Writes JSON (default benchmarks/results/attention_<platform>.json). The default shape is
a GPU's; on a CPU pass a smaller one (`--T 1024 --N 4 --K 2`): dot_product's f32 scores at the
default take 8.6 GB. `--window W` also times each implementation as a sliding-window layer
(keys i − W < j ≤ i) and records its speed-up over the same implementation's causal run.
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
    parser.add_argument("--window", type=int, default=0, help="also time a sliding window of W keys")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from maxlite import config as C
    from maxlite.models import attention, cudnn_attention
    from maxlite.models.flops import attention_flops

    platform = jax.devices()[0].platform
    default = {"gpu": "cudnn_flash,dot_product", "tpu": "flash,dot_product"}.get(
        platform, "blockwise,dot_product")
    B, T, N, K, H = args.B, args.T, args.N, args.K, args.H
    keys = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(k, (B, T, N, H), jnp.bfloat16) for k in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (B, T, K, H), jnp.bfloat16) for key in keys[1:3])
    impls = {name: getattr(attention, name) for name in (args.impl or default).split(",")}
    block = min(512, T)
    sizes = attention.splash_block_sizes(C.load(["base.yml", f"max_target_length={T}"]), T)
    most = C.load(["base.yml"]).max_segments_per_seq
    variants = {  # name → fn(q, k, v, segments, window)
        "dot_product": attention.dot_product,
        "blockwise": lambda q, k, v, s, window=0: attention.blockwise(q, k, v, s, block, window=window),
        "flash": lambda q, k, v, s, window=0: attention.flash(q, k, v, s, sizes, window=window),
        # as a recipe runs it: documents as offsets, then the dense mask
        "cudnn_flash": lambda q, k, v, s, window=0: cudnn_attention.cudnn_flash(q, k, v, s, most, window=window),
        "cudnn_flash dense mask": lambda q, k, v, s, window=0: cudnn_attention.cudnn_flash(q, k, v, s, 0, window=window),
    }
    names = (args.impl or default).split(",")
    if "cudnn_flash" in names:
        names.append("cudnn_flash dense mask")
    impls = {name: variants[name] for name in names}
    if platform == "gpu":
        impls["cudnn causal only"] = lambda q, k, v, s, window=0: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn", local_window_size=(window - 1, 0) if window else None)
    windows = [0] + ([args.window] if args.window else [])
    rows, speedups = {}, {}
    for name, fn in impls.items():
        for window in windows:
            flops = 3 * attention_flops(B, T, N, H, window)  # forward + backward, the keys attended
            grad = jax.jit(jax.grad(lambda q, k, v, s, fn=fn, w=window: jnp.sum(
                (fn(q, k, v, s, window=w) * dout).astype(jnp.float32)), argnums=(0, 1, 2)))
            label = name + (f" window {window}" if window else "")
            for documents in sorted({1, args.documents}):
                seg = jnp.asarray(_segments(B, T, documents))
                seconds = _time(grad, (q, k, v, seg), args.repeats)
                rows[f"{label}, {documents} document(s)"] = {
                    "ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
                print(f"{label:30s} {documents} doc(s): {seconds * 1e3:9.3f} ms  "
                      f"{flops / seconds / 1e12:8.3f} TFLOP/s", flush=True)
                if window:
                    causal = rows[f"{name}, {documents} document(s)"]["ms"]
                    speedups[f"{name}, {documents} document(s)"] = causal / (seconds * 1e3)
    out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"attention_{platform}.json")
    result = {"device": jax.devices()[0].device_kind, "shape": dict(B=B, T=T, N=N, K=K, H=H),
              "dtype": "bfloat16", "causal_flops_fwd_bwd": 3 * attention_flops(B, T, N, H), "runs": rows}
    if args.window:
        result.update(window=args.window, window_speedup_over_causal=speedups)
    write_result(result, out)


if __name__ == "__main__":
    main()
