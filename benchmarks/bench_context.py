"""Context parallelism, attention alone: forward + backward over one sequence on one device against
the same sequence split over --devices context shards (simulated CPU devices by default), with
K/V all-gathered (what maxlite runs) and passed around a ring (benchmarks/ring_attention.py).

    python benchmarks/bench_context.py [--impl blockwise] [--T 16384 --N 4 --K 2 --H 64 --block 512] \
        [--devices 4] [--documents 4] [--window 0] [--repeats 3] [--no-ring] [--out FILE]

Times jit(vjp) of attention(q, k, v, segments) with a cotangent (median of --repeats runs of the
compiled function; at minutes per run on CPU no warm-up run), f32, packed rows of --documents
documents; the split runs put q/k/v/segments in the load-balanced layout outside the timed
function, as the train step does once per batch. The ring runs blockwise over key blocks of
--block tokens, as blockwise does; its values and gradients are compared with the all-gather's
(`max_abs_diff`). The load average (os.getloadavg, as `uptime` prints it) is recorded around each
run: other jobs share the cores. Memory:
XLA's compiled memory analysis per device (arguments + outputs + temporaries; an SPMD program's
figures are one device's), so the ratio is per-device memory split / one device. On CPU the
"devices" share the same cores: the split's time is the cost of the extra work and collectives,
not a speed-up. Writes JSON (default benchmarks/results/context_cpu_<T>.json).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import statistics  # noqa: E402
import time  # noqa: E402

from benchmarks._results import write_result  # noqa: E402


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    parts = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
             "temp_bytes": m.temp_size_in_bytes}
    return parts | {"total_bytes": sum(parts.values())}


def _measure(fn, args, repeats: int):
    """(figures: median seconds of `repeats` runs of the compiled fn, its memory and the load
    average before and after, the last run's result)."""
    import jax

    load_before = os.getloadavg()
    compiled = jax.jit(fn).lower(*args).compile()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return ({"seconds": statistics.median(times), **_memory(compiled),
             "load_average_1_5_15min": {"before": list(load_before), "after": list(os.getloadavg())}}, result)


def _max_abs_diff(a, b) -> dict:
    import jax
    import numpy as np

    names = ("out", "dq", "dk", "dv")
    return {n: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for n, x, y in
            zip(names, jax.tree.leaves(a), jax.tree.leaves(b))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="blockwise", help="dot_product | blockwise")
    for dim, default in (("B", 1), ("T", 16384), ("N", 4), ("K", 2), ("H", 64)):
        parser.add_argument(f"--{dim}", type=int, default=default)
    parser.add_argument("--block", type=int, default=512, help="attention_block_size")
    parser.add_argument("--devices", type=int, default=4, help="context shards")
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--no-balance", action="store_true", help="context_parallel_load_balance=false")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-ring", action="store_true", help="skip the ring prototype")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from maxlite import config as C, mesh as mesh_lib
    from benchmarks.ring_attention import ring_attend
    from maxlite.models import attention, context

    B, T, N, K, H, n = args.B, args.T, args.N, args.K, args.H, args.devices
    balance = not args.no_balance
    keys = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(k, (B, T, N, H), jnp.float32) for k in (keys[0], keys[3]))
    k, v = (jax.random.normal(kk, (B, T, K, H), jnp.float32) for kk in keys[1:3])
    bounds = np.linspace(0, T, args.documents + 1).astype(int)
    seg = np.zeros((B, T), np.int32)
    for i in range(args.documents):
        seg[:, bounds[i]:bounds[i + 1]] = i + 1
    seg = jnp.asarray(seg)
    recipe = ["base.yml", f"attention={args.impl}", f"attention_block_size={args.block}", f"max_target_length={T}",
              f"context_parallel_load_balance={balance}"]
    cfg = C.load(recipe)

    def fwd_bwd(attend):
        def run(q, k, v, seg, dout):
            out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
            return out, vjp(dout)
        return run

    gathered = lambda q, k, v, seg: attention.attend(cfg, q, k, v, seg, window=args.window)  # noqa: E731
    single_args = tuple(jax.device_put(x, jax.devices()[0]) for x in (q, k, v, seg, dout))
    single, single_result = _measure(fwd_bwd(gathered), single_args, args.repeats)

    mesh_cfg = C.resolve(C.load([*recipe, f"ici_context_parallelism={n}", "ici_fsdp_parallelism=1",
                                 f"per_device_batch_size={B / n}"]), n)
    mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:n])
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        from jax.sharding import NamedSharding, PartitionSpec as P
        to = (lambda x: context.to_balanced(x, n)) if balance else (lambda x: x)
        sharded = tuple(jax.device_put(to(x), NamedSharding(mesh, P(None, "context")))
                        for x in (q, k, v, seg, dout))
        split, split_result = _measure(fwd_bwd(gathered), sharded, args.repeats)
        if not args.no_ring:
            ringed = lambda q, k, v, seg: ring_attend(q, k, v, seg, balance, args.window, args.block)  # noqa: E731
            ring, ring_result = _measure(fwd_bwd(ringed), sharded, args.repeats)
    back = (lambda x: context.from_balanced(x, n)) if balance else (lambda x: x)
    in_order = lambda r: jax.tree.map(lambda x: back(jax.device_get(x)), r)  # noqa: E731

    result = {
        "what": "attention forward + backward (jit(vjp)), f32, one sequence: one device vs split over context shards",
        "platform": jax.devices()[0].platform, "impl": args.impl,
        "shape": dict(B=B, T=T, N=N, K=K, H=H), "block": args.block, "documents": args.documents,
        "window": args.window, "context": n, "load_balance": balance,
        "one_device": single, "context_split": split,
        "memory_ratio_per_device": split["total_bytes"] / single["total_bytes"],
        "temp_ratio_per_device": split["temp_bytes"] / single["temp_bytes"],
        "time_ratio": split["seconds"] / single["seconds"],
        "max_abs_diff_split_vs_one_device": _max_abs_diff(in_order(split_result), single_result),
    }
    if not args.no_ring:
        result |= {
            "ring": ring,
            "ring_vs_all_gather": {"memory_ratio_per_device": ring["total_bytes"] / split["total_bytes"],
                                   "temp_ratio_per_device": ring["temp_bytes"] / split["temp_bytes"],
                                   "time_ratio": ring["seconds"] / split["seconds"]},
            "ring_memory_ratio_to_one_device": ring["total_bytes"] / single["total_bytes"],
            "max_abs_diff_ring_vs_all_gather": _max_abs_diff(ring_result, split_result),
        }
    result["command"] = "python " + " ".join(["benchmarks/bench_context.py", *sys.argv[1:]])
    out = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"context_cpu_{T}.json"
    write_result(result, out)


if __name__ == "__main__":
    main()
