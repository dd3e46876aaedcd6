"""Gated delta-net layers against full attention on CPU → benchmarks/results/gdn_*.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_gdn.py layer [--lengths 4096 16384] [--gdn-only 65536]
    JAX_PLATFORMS=cpu python benchmarks/bench_gdn.py decode [--contexts 1024 16384] [--new 32]

`layer`: one mixer's forward + backward (gradient of the sum of its output with respect to its input
and parameters; compile excluded, best of `--repeats`) per token, at each length: a gated delta-net
layer (chunks of 64) against grouped-query attention of the same width (`attention=blockwise`, CPU's
choice from 2,048 tokens on). `--gdn-only` lengths time the delta-net alone (attention's T² would
take minutes there).

`decode`: tokens/s of greedy decode steps after a prompt of each context length (`--new` steps from
that position, compile excluded, best of `--repeats`; no prefill), for tiny-hybrid (three delta-net
layers to one attention layer) and tiny (four attention layers; otherwise the same sizes), beside
`cache_read_ms`: one plain read of the whole cache, the part of a step's cost no decode can avoid.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402
from benchmarks.bench_decode import _best  # noqa: E402

WIDTH = ["base_emb_dim=512", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=64",
         "gdn_num_key_heads=4", "gdn_num_value_heads=8", "gdn_key_head_dim=64", "gdn_value_head_dim=64"]


def _cpu_flags() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return " ".join(f for f in line.split(":")[1].split() if f.startswith(("avx", "amx", "fma")))
    return ""


def layer_seconds(mixer: str, length: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import config as C
    from maxlite.models.kinds import MIXERS

    cfg = C.load(["base.yml", "model_name=tiny-hybrid", *WIDTH, f"max_target_length={length}", "dtype=float32",
                  "attention=blockwise"])
    with nnx.use_eager_sharding(False):
        module = MIXERS[mixer].cls()(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module)
    x = jax.random.normal(jax.random.key(0), (1, length, cfg.base_emb_dim), jnp.float32)
    positions, segments = jnp.arange(length)[None], jnp.ones((1, length), jnp.int32)

    @jax.jit
    def grads(params, x):
        return jax.grad(lambda p, x: nnx.merge(graphdef, p)(x, positions, segments).sum(), argnums=(0, 1))(params, x)
    jax.block_until_ready(grads(params, x))  # compiles
    return _best(lambda: jax.block_until_ready(grads(params, x)), repeats)


def run_layer(args) -> dict:
    rows = []
    for length in args.lengths + args.gdn_only:
        row = {"tokens": length}
        for mixer in ("gated_deltanet", "attention") if length in args.lengths else ("gated_deltanet",):
            s = layer_seconds(mixer, length, args.repeats)
            row[f"{mixer}_us_per_token"] = round(1e6 * s / length, 2)
        if "attention_us_per_token" in row:
            row["attention_over_gdn"] = round(row["attention_us_per_token"] / row["gated_deltanet_us_per_token"], 2)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    return {"what": "one mixer's forward + backward per token, batch 1, float32", "width": WIDTH, "results": rows}


def decode_rate(model_name: str, context: int, new: int, repeats: int) -> dict:
    """`new` decode steps (one token each, as `generate`'s loop runs them) from position `context`
    with a cache of context + new slots: what a step costs after a prompt of that length (the
    cache's contents do not change the work)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import api, config as C
    from maxlite.models import decode

    cfg = C.load(["base.yml", f"model_name={model_name}", f"max_target_length={context + new}",
                  f"max_position_embeddings={context + new}", "dtype=float32"])
    graphdef, params = nnx.split(api.create_model(cfg, seed=0), nnx.Param)

    @jax.jit
    def steps(params, cache):
        def one(i, carry):  # the params ride in the loop state, as in generate's loop
            token, cache, params = carry
            model = nnx.merge(graphdef, params)
            pos = jnp.full((1,), context, jnp.int32) + i
            x, cache = decode.forward(model, token[:, None], pos[:, None], pos + 1, cache)
            return jnp.argmax(model.logits(x)[:, 0], axis=-1).astype(jnp.int32), cache, params
        return jax.lax.fori_loop(0, new, one, (jnp.ones((1,), jnp.int32), cache, params))[0]

    cache = decode.empty_cache(cfg, 1, context + new)
    jax.block_until_ready(steps(params, cache))  # compiles
    seconds = _best(lambda: jax.block_until_ready(steps(params, cache)), repeats)
    # the floor a step cannot go under: reading the whole cache once (what its attention must read)
    read = jax.jit(lambda cache: sum(jnp.sum(a) for a in jax.tree.leaves(cache)))
    jax.block_until_ready(read(cache))
    read_seconds = _best(lambda: jax.block_until_ready(read(cache)), 5 * repeats)
    return {"model": model_name, "context": context, "new_tokens": new,
            "decode_tokens_per_s": round(new / seconds, 1), "ms_per_step": round(1e3 * seconds / new, 3),
            "cache_read_ms": round(1e3 * read_seconds, 3),
            "cache_bytes_per_token": round(decode_cache_bytes(cfg, context + new) / (context + new), 1)}


def decode_cache_bytes(cfg, length: int) -> float:
    from maxlite.models.kinds import cache_numbers_per_token

    return cache_numbers_per_token(cfg, length) * length * 4  # float32


def run_decode(args) -> dict:
    rows = []
    for model in ("tiny-hybrid", "tiny"):
        for context in args.contexts:
            rows.append(decode_rate(model, context, args.new, args.repeats))
            print(rows[-1], file=sys.stderr, flush=True)
    return {"what": "greedy decode steps per second after a prompt of `context` tokens, batch 1, float32",
            "results": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("layer", "decode"))
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--gdn-only", nargs="*", type=int, default=[])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 16384])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    import jax
    result = run_layer(args) if args.mode == "layer" else run_decode(args)
    out = args.out or ROOT / "benchmarks" / "results" / f"gdn_{args.mode}_cpu.json"
    write_result({"command": "JAX_PLATFORMS=cpu python benchmarks/bench_gdn.py " + " ".join(sys.argv[1:]),
                  "device": str(jax.devices()[0].device_kind), "host": platform.node(), "cpu_flags": _cpu_flags(),
                  **result}, out)


if __name__ == "__main__":
    main()
