"""Decoding with the KV cache against recomputing the prefix → benchmarks/results/decode.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_decode.py [--models tiny llama-100m] [--batches 1 8]

For each model and batch: greedy decode of `--new` tokens after a `--prompt`-token prompt through
maxlite.generate (compile excluded, best of `--repeats`), and the same model's training forward
pass over the whole sequence. Without a cache every new token costs a forward pass over its prefix;
`recompute_tokens_per_s` is the batch's new tokens over the summed time of those passes (measured
at the shortest and longest prefix, linear in between). `cache_speedup` is the ratio.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "decode.json"


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(model_name: str, batch: int, args) -> dict:
    import jax
    import numpy as np

    from maxlite import api, config as C
    from maxlite.generate import Sampling, generate_ids
    from flax import nnx

    cfg = C.load(["base.yml", f"model_name={model_name}", f"max_target_length={args.prompt + args.new}"])
    model = api.create_model(cfg, seed=0)
    params = nnx.split(model, nnx.Param)[1]
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, (batch, args.prompt)).tolist()
    sampling = Sampling(max_new_tokens=args.new)
    first = generate_ids(cfg, params, prompts, sampling)  # compiles
    decode_s = min(generate_ids(cfg, params, prompts, sampling).seconds for _ in range(args.repeats))

    def forward_seconds(length: int) -> float:
        ids = rng.integers(1, cfg.vocab_size, (batch, length))
        jax.block_until_ready(api.forward(model, ids))  # compiles
        return _best(lambda: jax.block_until_ready(api.forward(model, ids)), args.repeats)

    short, long = forward_seconds(args.prompt), forward_seconds(args.prompt + args.new - 1)
    recompute_s = args.new * (short + long) / 2
    new_tokens = batch * args.new
    return {"model": model_name, "batch": batch, "prompt_tokens": args.prompt, "new_tokens": args.new,
            "decode_steps": first.steps, "compile_s": round(first.compile_seconds, 2),
            "decode_tokens_per_s": round(new_tokens / decode_s, 1),
            "forward_tokens_per_s": round(batch * (args.prompt + args.new - 1) / long, 1),
            "recompute_tokens_per_s": round(new_tokens / recompute_s, 1),
            "cache_speedup": round(recompute_s / decode_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "llama-100m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    import jax
    rows = []
    for name in args.models:
        for batch in args.batches:
            rows.append(measure(name, batch, args))
            print(rows[-1], file=sys.stderr, flush=True)
    write_result({"device": str(jax.devices()[0].device_kind), "devices": 1, "host": platform.node(),
                  "command": "JAX_PLATFORMS=cpu python benchmarks/bench_decode.py " + " ".join(sys.argv[1:]),
                  "results": rows}, args.out)


if __name__ == "__main__":
    main()
