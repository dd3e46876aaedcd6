"""One decode step of DeepSeek sparse attention against latent attention, at 1k and 32k cached tokens →
benchmarks/results/dsa_decode.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_dsa_decode.py [--lengths 1024 32768] [--layers 2] [--repeats 5]

DeepSeek-V3.2's attention widths (128 heads; latent 512 + RoPE 64; indexer 64 heads of 128, keeping
2,048) and its MLA twin (DeepSeek-V3: the same model without the indexer), `--layers` layers 1,024 wide, narrow
experts so the step is the attention's: one new token of batch 1 over a cache of `length` filled
slots (maxlite.models.decode.forward, jitted; the cache donated). Per model and length: XLA's cost
analysis of the compiled step (bytes accessed, FLOPs), the bytes of the latents the step's attention
reads as the kinds compute them (DSA: index_topk of them, MLA: every one; both read all the indexer
keys / nothing more), and the step's wall time on this CPU (median of `--repeats`).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "dsa_decode.json"


def measure(preset: str, length: int, layers: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from maxlite import api, config as C
    from maxlite.models import decode

    cfg = C.load(["base.yml", f"model_name={preset}", f"base_num_decoder_layers={layers}", "first_num_dense_layers=1",
                  "base_emb_dim=1024", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=64", "base_mlp_dim=256",
                  "n_routing_groups=-1", "topk_routing_group=-1", "vocab_size=1024", "mtp_num_layers=0", "dtype=bfloat16",
                  f"max_target_length={length + 1}"])
    model = api.create_model(cfg)
    cache = decode.empty_cache(cfg, 1, length + 1)
    filled = jnp.where(jnp.arange(length + 1) < length, jnp.arange(length + 1), -1)[None].astype(jnp.int32)
    cache = decode.Cache({key: (per_layer, filled) for key, (per_layer, _) in cache.stacks.items()})
    graphdef, state = nnx.split(model)
    tokens, positions, lengths = (jnp.array([[7]], jnp.int32), jnp.array([[length]], jnp.int32),
                                  jnp.array([length + 1], jnp.int32))

    def step(state, cache):
        return decode.forward(nnx.merge(graphdef, state), tokens, positions, lengths, cache)

    compiled = jax.jit(step, donate_argnums=1).lower(state, cache).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        x, cache = compiled(state, cache)
        jax.block_until_ready(x)
        times.append(time.perf_counter() - start)
    itemsize = np.dtype(jnp.dtype(cfg.dtype)).itemsize
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    read = min(cfg.index_topk, length + 1) if cfg.decoder_block == "deepseek_v32" else length + 1
    return {"preset": preset, "cached_tokens": length, "layers": layers,
            "latent_bytes_read_per_layer": read * latent * itemsize,
            "indexer_key_bytes_read_per_layer": (length + 1) * cfg.index_head_dim * itemsize
            if cfg.decoder_block == "deepseek_v32" else 0,
            "xla_bytes_accessed": cost.get("bytes accessed"), "xla_flops": cost.get("flops"),
            "step_ms_median": round(1000 * statistics.median(times[1:]), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    rows = []
    for length in args.lengths:
        for preset in ("deepseek-v3", "deepseek-v3.2"):
            rows.append(measure(preset, length, args.layers, args.repeats))
            print(rows[-1], file=sys.stderr, flush=True)
    write_result({"what": "one decode step (batch 1, one new token) over `cached_tokens` filled slots",
                  "results": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
