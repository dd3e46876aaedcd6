"""Context parallelism, attention alone: forward + backward over one sequence on one device against
the same sequence split over --devices context shards (simulated CPU devices by default).

    python benchmarks/bench_context.py [--impl blockwise] [--T 16384 --N 4 --K 2 --H 64 --block 512] \
        [--devices 4] [--documents 4] [--window 0] [--repeats 3] [--out FILE]

Times jit(vjp) of attention(q, k, v, segments) with a cotangent (median of --repeats after a
warm-up), f32, packed rows of --documents documents; the split run puts q/k/v/segments in the
load-balanced layout outside the timed function, as the train step does once per batch. Memory:
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

from benchmarks._results import write_result  # noqa: E402
from benchmarks.bench_attention import _time  # noqa: E402  (median of repeats after compiling)


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    parts = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
             "temp_bytes": m.temp_size_in_bytes}
    return parts | {"total_bytes": sum(parts.values())}


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

    def fwd_bwd(q, k, v, seg, dout):
        out, vjp = jax.vjp(lambda q, k, v: attention.attend(cfg, q, k, v, seg, window=args.window), q, k, v)
        return out, vjp(dout)

    one = jax.jit(fwd_bwd)
    single_args = tuple(jax.device_put(x, jax.devices()[0]) for x in (q, k, v, seg, dout))
    single = {"seconds": _time(one, single_args, args.repeats), **_memory(one.lower(*single_args).compile())}

    mesh_cfg = C.resolve(C.load([*recipe, f"ici_context_parallelism={n}", "ici_fsdp_parallelism=1",
                                 f"per_device_batch_size={B / n}"]), n)
    mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:n])
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        from jax.sharding import NamedSharding, PartitionSpec as P
        to = (lambda x: context.to_balanced(x, n)) if balance else (lambda x: x)
        sharded = tuple(jax.device_put(to(x), NamedSharding(mesh, P(None, "context")))
                        for x in (q, k, v, seg, dout))
        many = jax.jit(fwd_bwd)
        split = {"seconds": _time(many, sharded, args.repeats), **_memory(many.lower(*sharded).compile())}

    result = {
        "what": "attention forward + backward (jit(vjp)), f32, one sequence: one device vs split over context shards",
        "platform": jax.devices()[0].platform, "impl": args.impl,
        "shape": dict(B=B, T=T, N=N, K=K, H=H), "block": args.block, "documents": args.documents,
        "window": args.window, "context": n, "load_balance": balance,
        "one_device": single, "context_split": split,
        "memory_ratio_per_device": split["total_bytes"] / single["total_bytes"],
        "temp_ratio_per_device": split["temp_bytes"] / single["temp_bytes"],
        "time_ratio": split["seconds"] / single["seconds"],
        "command": "python " + " ".join(["benchmarks/bench_context.py", *sys.argv[1:]]),
    }
    out = pathlib.Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"context_cpu_{T}.json"
    write_result(result, out)


if __name__ == "__main__":
    main()
