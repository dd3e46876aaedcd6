"""Multi-head latent attention against grouped-query attention → benchmarks/results/mla_cpu.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_mla.py [--length 4096] [--repeats 3] [--new 32]

1. Decode cache per token: the presets' (deepseek-v3, kimi-k2, deepseek-v2-lite; counted by the
   kinds' cache size) and tiny-deepseek's as `generate` reports it, each against the same model with
   grouped-query attention over the same heads (K = N heads of the query/key width for keys, the
   value width for values: what DeepSeek's heads would cache expanded), and tiny-deepseek's
   `generate` tokens/s through the latent cache.
2. One attention layer's forward + backward at `--length` tokens (the CPU's attention: blockwise):
   tiny-deepseek's MLA against a GQA layer whose forward FLOPs (maxlite.models.kinds) are the
   closest to MLA's, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "mla_cpu.json"


def _cpu_flags() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
    return ""


def _expanded(cfg):
    """The same model with grouped-query attention over the same heads, caching full K and V."""
    return dataclasses.replace(cfg, attention_type="global", base_num_kv_heads=cfg.base_num_query_heads,
                               head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


def cache(args) -> dict:
    import numpy as np
    from flax import nnx

    from maxlite import api, config as C
    from maxlite.generate import Sampling, generate_ids
    from maxlite.models.kinds import cache_numbers_per_token

    out = {}
    for name in ("deepseek-v3", "kimi-k2", "deepseek-v2-lite"):
        cfg = C.load(["base.yml", f"model_name={name}"])
        L, N = cfg.base_num_decoder_layers, cfg.base_num_query_heads
        full = N * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)  # K and V of every head
        mla = cache_numbers_per_token(cfg, 4096) / L
        out[name] = {"mla_numbers_per_token_per_layer": mla, "full_heads_numbers_per_token_per_layer": full,
                     "ratio": full / mla, "mla_bf16_bytes_per_token": 2 * mla * L}
    cfg = C.load(["base.yml", "model_name=tiny-deepseek", "dtype=float32", "max_target_length=256"])
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (4, 64)).tolist()
    sampling = Sampling(max_new_tokens=args.new)
    for label, c in (("mla", cfg), ("gqa_same_heads", _expanded(cfg))):
        params = nnx.split(api.create_model(c, seed=0), nnx.Param)[1]
        generate_ids(c, params, prompts, sampling)  # compiles
        runs = [generate_ids(c, params, prompts, sampling) for _ in range(args.repeats)]
        out[f"tiny-deepseek_{label}"] = {
            "cache_bytes_per_token": runs[0].cache_bytes_per_token,
            "tokens_per_s": max(r.tokens_per_second for r in runs), "batch": 4, "prompt": 64, "new": args.new}
    out["tiny_cache_ratio"] = (out["tiny-deepseek_gqa_same_heads"]["cache_bytes_per_token"]
                               / out["tiny-deepseek_mla"]["cache_bytes_per_token"])
    return out


def _layer_seconds(cfg, T: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite.models.kinds import MIXERS

    with nnx.use_eager_sharding(False):
        layer = MIXERS["mla" if cfg.attention_type == "mla" else "attention"].cls()(cfg, rngs=nnx.Rngs(params=0))
    graphdef, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.base_emb_dim), jnp.float32)
    pos, seg = jnp.arange(T)[None], jnp.ones((1, T), jnp.int32)

    @jax.jit
    def step(params, x):
        def loss(params, x):
            return jnp.sum(jnp.square(nnx.merge(graphdef, params)(x, pos, seg)))
        return jax.grad(loss, argnums=(0, 1))(params, x)

    jax.block_until_ready(step(params, x))  # compiles
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(step(params, x))
        best = min(best, time.perf_counter() - t)
    return best


def attention_time(args) -> dict:
    from maxlite import config as C
    from maxlite.models.kinds import MIXERS

    T = args.length
    mla = C.load(["base.yml", "model_name=tiny-deepseek", "dtype=float32", f"max_target_length={T}",
                  "attention=blockwise"])
    flops = lambda c: sum(MIXERS["mla" if c.attention_type == "mla" else "attention"].flops(  # noqa: E731
        c, 1, T, "global").values())
    target = flops(mla)
    N = mla.base_num_query_heads
    candidates = [dataclasses.replace(mla, attention_type="global", base_num_kv_heads=N, head_dim=h)
                  for h in range(8, 257, 8)]
    gqa = min(candidates, key=lambda c: abs(flops(c) - target))
    out = {}
    for label, c in (("mla", mla), ("gqa_equal_flops", gqa)):
        seconds = _layer_seconds(c, T, args.repeats)
        out[label] = {"seconds_fwd_bwd": seconds, "forward_flops": flops(c),
                      "train_gflop_per_s": 3 * flops(c) / seconds / 1e9}
    out["gqa_equal_flops"]["head_dim"] = gqa.head_dim
    out["mla_over_gqa_time"] = out["mla"]["seconds_fwd_bwd"] / out["gqa_equal_flops"]["seconds_fwd_bwd"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    write_result({"machine": {"cpu": platform.processor() or platform.machine(), "flags": _cpu_flags()},
                  "decode_cache": cache(args), f"attention_fwd_bwd_{args.length}": attention_time(args)}, OUT)


if __name__ == "__main__":
    main()
