"""GRPO rollouts: today's static sampler against the rollout engine → benchmarks/results/rollout_throughput.json.

    JAX_PLATFORMS=cpu python benchmarks/rollout_throughput.py [--models tiny llama-100m] [--prompts 16]
        [--generations 8] [--new 256] [--slots 32] [--end-share 64] [--block-size 16] [--engines-only]
        [--repeats N] [--by-width]

Prompts: the bundled arithmetic prompts (maxlite/data/bundled/arith_prompts_train.jsonl.zst) in a
ChatML turn, tokenized with the bundled tokenizer; G completions each at temperature 1, random
weights (seed 0). Uneven lengths: a random model never says EOS, so the ids [100, 100 + V/end_share)
count as end ids (a marker set; V the vocabulary): each token ends its completion with the
probability the model gives that set (about 1/end_share), capped at --new tokens. Both samplers
see the same end ids: the engine stops a completion on one; the static sampler (decode.generate_tokens
over the prompts repeated G times in one batch, as objectives/rollout.py samples without the engine)
stops on one id only, so it runs every row to --new and its completions are cut at their first end id.

A second static figure runs the rows in chunks of max_num_seqs (the engine's decode memory) one
after the other, each chunk to --new: the static batch a memory bound on rows would force.

Useful tokens: the completions' tokens up to and including their end. `ended_fraction`: the share
of row-steps (rows × decode steps) spent on rows whose completion had already ended (the static
batch: 1 − useful / (rows × steps); the engine: slot-steps holding no live sequence). Compile
excluded (a warm-up run first); seconds are the timed run's wall time.

`--block-size C` also runs the engine over the paged cache (maxlite/rollout/paged.py, blocks of C
positions, the default pool): `engine_paged`, its peak blocks and bytes held, and paged ÷ contiguous.
`--engines-only`: the two engines, no static sampler. `--repeats N`: then N more runs of the
(contiguous) engine and the static sampler alternately, each pair's ratio and their median.
`--by-width`: the engine's steps grouped by the batch's width, each step waited for (`_by_width`).
`--no-hold`: the engines step on the trainer's float32 weights, each step rounding them to the compute
dtype again (before maxlite/rollout/weights.py held them rounded once).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "rollout_throughput.json"
CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _cpu_flags() -> list[str]:
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))


def _prompts(n: int) -> list[list[int]]:
    import zstandard

    from maxlite.data.tokenizer import BUNDLED_DIR, load_tokenizer

    path = BUNDLED_DIR / "arith_prompts_train.jsonl.zst"
    text = zstandard.ZstdDecompressor().stream_reader(open(path, "rb")).read(1 << 16).decode()
    records = [json.loads(line) for line in text.splitlines()[:-1]]
    tok = load_tokenizer("")
    step = max(len(records) // n, 1)  # spread over the file: prompts of several lengths
    return [tok.encode(CHATML.format(r["prompt"])).tolist() for r in records[::step][:n]]


def _static(cfg, graphdef, params, prompts, args, end_ids, key, rows: int = 0):
    """Today's sampler over all the rows at once, or (`rows`) over chunks of that many rows one after
    the other: the engine's decode memory (max_num_seqs rows of cache). Compiled here; returns the
    function that times one run of it (its figures as a dict)."""
    import functools

    import jax
    import numpy as np

    from maxlite.models import decode

    P = decode.prompt_length(cfg, max(map(len, prompts)))
    padded = np.zeros((len(prompts), P), np.int32)
    for r, ids in zip(padded, prompts):
        r[:len(ids)] = ids
    lengths = np.array([len(p) for p in prompts], np.int32)
    fn = jax.jit(functools.partial(decode.generate_tokens, graphdef, max_new_tokens=args.new, temperature=1.0,
                                   top_k=0, top_p=1.0, eos_id=-1))
    G = args.generations
    all_prompts, all_lengths = np.repeat(padded, G, 0), np.repeat(lengths, G, 0)
    rows = rows or len(all_prompts)
    chunks = [(all_prompts[i:i + rows], all_lengths[i:i + rows]) for i in range(0, len(all_prompts), rows)]
    compiled = fn.lower(params, *chunks[0], key).compile()

    def run() -> dict:
        start = time.perf_counter()
        done = [jax.block_until_ready(compiled(params, x, n, jax.random.fold_in(key, i)))
                for i, (x, n) in enumerate(chunks)]
        seconds = time.perf_counter() - start
        out, steps = np.concatenate([np.asarray(o) for o, _ in done]), sum(int(s) for _, s in done)
        ends = np.isin(out, end_ids)
        useful = np.where(ends.any(1), ends.argmax(1) + 1, args.new)
        return {"rows": rows, "steps": steps, "seconds": round(seconds, 3), "useful_tokens": int(useful.sum()),
                "useful_tokens_per_s": round(float(useful.sum() / seconds), 1),
                "ended_fraction": round(float(1 - useful.sum() / (rows * steps)), 4)}
    return run


def _unshared_peak(cfg, graphdef, params, prompts, args, end_ids, key) -> int:
    """Peak bytes of the paged cache when each completion copies its prompt's blocks (no sharing)."""
    from maxlite.rollout.engine import Sampling
    from maxlite.rollout.paged import PagedEngine

    engine = PagedEngine(cfg, graphdef, args.slots, args.batched_tokens, args.block_size, share_prefix=False)
    sampling = Sampling(args.new, 1.0, args.generations, marker_ids=tuple(end_ids))
    s = engine.generate(params, prompts, sampling, key).stats
    return s["peak_blocks"] * s["block_bytes"]


def _engine(cfg, graphdef, params, prompts, args, end_ids, key, block_size: int = 0):
    """The engine (`block_size`: the paged one), compiled; returns the function that times one call."""
    from maxlite.rollout.continuous import ContinuousEngine
    from maxlite.rollout.engine import Sampling
    from maxlite.rollout.paged import PagedEngine

    hold = not args.no_hold
    engine = (PagedEngine(cfg, graphdef, args.slots, args.batched_tokens, block_size, hold_weights=hold) if block_size
              else ContinuousEngine(cfg, graphdef, args.slots, args.batched_tokens, hold_weights=hold))
    sampling = Sampling(args.new, 1.0, args.generations, marker_ids=tuple(end_ids))
    engine.generate(params, prompts, sampling, key)  # compiles
    return lambda: _engine_figures(engine.generate(params, prompts, sampling, key), args, block_size)


def _by_width(cfg, graphdef, params, prompts, args, end_ids, key) -> dict:
    """`--by-width`: one more call of the contiguous engine with every step waited for, its steps
    grouped by the batch's width (32 slots, then the tail's 16, 8, 4): steps, seconds, ms a step and
    ms a live row (a slot holding a sequence when the step was dispatched). Waiting on each step undoes
    the host's one-step lead: the total is not a figure of the engine."""
    import collections

    import jax

    from maxlite.rollout.continuous import ContinuousEngine
    from maxlite.rollout.engine import Sampling

    class Timed(ContinuousEngine):
        def _step(self, fns, params, state, key, live):
            start = time.perf_counter()
            out = jax.block_until_ready(super()._step(fns, params, state, key, live))
            width = widths[int(state.pos_S.shape[0])]
            width[0], width[1], width[2] = width[0] + 1, width[1] + time.perf_counter() - start, width[2] + len(live)
            return out

    widths: dict = collections.defaultdict(lambda: [0, 0.0, 0])
    engine = Timed(cfg, graphdef, args.slots, args.batched_tokens, hold_weights=not args.no_hold)
    sampling = Sampling(args.new, 1.0, args.generations, marker_ids=tuple(end_ids))
    engine.generate(params, prompts, sampling, key)  # compiles
    widths.clear()
    start = time.perf_counter()
    engine.generate(params, prompts, sampling, key)
    return {"seconds_waiting_each_step": round(time.perf_counter() - start, 3),
            "widths": {str(w): {"steps": n, "seconds": round(t, 3), "ms_per_step": round(1000 * t / n, 1),
                                "ms_per_live_row": round(1000 * t / live, 2)}
                       for w, (n, t, live) in sorted(widths.items(), reverse=True)}}


def _engine_figures(done, args, block_size: int) -> dict:
    import numpy as np

    s = done.stats
    useful = np.array([len(t) for t in done.tokens])
    paged = {"block_size": block_size, "peak_blocks": s["peak_blocks"], "num_blocks": s["num_blocks"],
             "block_bytes_per_position": s["block_bytes"] // block_size,
             "peak_cache_bytes": s["peak_blocks"] * s["block_bytes"]} if block_size else {}
    return {**paged, "slots": args.slots, "steps": s["steps"], "prefills": s["prefills"],
            "seconds": round(s["seconds"], 3),
            "useful_tokens": int(useful.sum()), "useful_tokens_per_s": round(float(useful.sum() / s["seconds"]), 1),
            "ended_fraction": round(s["ended_slot_steps"] / s["slot_steps"], 4),
            "lengths": {"mean": round(float(useful.mean()), 1), "min": int(useful.min()), "max": int(useful.max()),
                        "at_cap": int((useful == args.new).sum())}}


def measure(model_name: str, args) -> dict:
    import jax
    from flax import nnx

    from maxlite import api, config as C

    prompts = _prompts(args.prompts)
    cfg = C.load(["base.yml", f"model_name={model_name}", f"max_target_length={max(map(len, prompts)) + args.new}"])
    graphdef, params = nnx.split(api.create_model(cfg, seed=0), nnx.Param)
    end_ids = list(range(100, 100 + cfg.vocab_size // args.end_share))
    key = jax.random.key(0)
    engine_run = _engine(cfg, graphdef, params, prompts, args, end_ids, key)
    engine = engine_run()
    if args.by_width:
        engine["by_width"] = _by_width(cfg, graphdef, params, prompts, args, end_ids, key)
    print(model_name, "engine", engine, file=sys.stderr, flush=True)
    paged = {}
    if args.block_size:
        paged = {"engine_paged": _engine(cfg, graphdef, params, prompts, args, end_ids, key, args.block_size)()}
        paged["engine_paged"]["peak_cache_bytes_unshared"] = _unshared_peak(cfg, graphdef, params, prompts, args,
                                                                            end_ids, key)
        # the contiguous engine's cache: a row of (longest padded prompt + max_new_tokens) positions per slot
        from maxlite.models.decode import prompt_length
        positions = args.slots * (prompt_length(cfg, max(map(len, prompts))) + args.new)
        engine["cache_bytes"] = positions * paged["engine_paged"]["block_bytes_per_position"]
        paged["paged_speedup"] = round(paged["engine_paged"]["useful_tokens_per_s"] / engine["useful_tokens_per_s"], 2)
        print(model_name, "engine, paged", paged, file=sys.stderr, flush=True)
    if args.engines_only:
        return {"model": model_name, "dtype": cfg.dtype, "prompts": len(prompts), "generations": args.generations,
                "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))], "max_new_tokens": args.new,
                "end_ids": f"[100, {100 + len(end_ids)})", "engine": engine, **paged}
    static_run = _static(cfg, graphdef, params, prompts, args, end_ids, key)
    static = static_run()
    print(model_name, "static", static, file=sys.stderr, flush=True)
    chunked = _static(cfg, graphdef, params, prompts, args, end_ids, key, rows=args.slots)()
    print(model_name, "static in chunks of max_num_seqs rows", chunked, file=sys.stderr, flush=True)
    return {**paged, "model": model_name, "dtype": cfg.dtype, "prompts": len(prompts), "generations": args.generations,
            "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))], "max_new_tokens": args.new,
            "end_ids": f"[100, {100 + len(end_ids)})", "static": static, "static_chunked": chunked, "engine": engine,
            "useful_speedup": round(engine["useful_tokens_per_s"] / static["useful_tokens_per_s"], 2),
            "useful_speedup_same_rows": round(engine["useful_tokens_per_s"] / chunked["useful_tokens_per_s"], 2),
            **_pairs(engine_run, static_run, args.repeats, model_name)}


def _pairs(engine_run, static_run, repeats: int, model_name: str) -> dict:
    """`--repeats N`: N more runs of the engine and the static sampler, alternately (the order
    swapped every pair), each compiled once: every pair's useful-token ratio and their median, which
    a drift of the machine's speed between the two runs above (±15% here) moves less."""
    if repeats < 1:
        return {}
    ratios, engine_s, static_s = [], [], []
    for r in range(repeats):
        got = {}
        for name, run in ((("engine", engine_run), ("static", static_run)) if r % 2 == 0
                          else (("static", static_run), ("engine", engine_run))):
            got[name] = run()
        engine_s.append(got["engine"]["seconds"])
        static_s.append(got["static"]["seconds"])
        ratios.append(round(got["engine"]["useful_tokens_per_s"] / got["static"]["useful_tokens_per_s"], 3))
        print(model_name, f"pair {r + 1}: engine {engine_s[-1]} s, static {static_s[-1]} s, ratio {ratios[-1]}",
              file=sys.stderr, flush=True)
    return {"pairs": {"engine_seconds": engine_s, "static_seconds": static_s, "useful_speedups": ratios,
                      "median_useful_speedup": round(statistics.median(ratios), 3)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "llama-100m"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--slots", type=int, default=32, help="the engine's max_num_seqs")
    ap.add_argument("--batched-tokens", type=int, default=2048, help="the engine's max_num_batched_tokens")
    ap.add_argument("--end-share", type=int, default=64, help="1 / the share of the vocabulary that ends a completion")
    ap.add_argument("--block-size", type=int, default=0, help="also the paged engine, blocks of this many positions")
    ap.add_argument("--engines-only", action="store_true", help="the engines only, no static sampler")
    ap.add_argument("--no-hold", action="store_true", help="the engines on the trainer's float32 weights, re-rounded "
                    "each step (as before maxlite/rollout/weights.py held them in the compute dtype)")
    ap.add_argument("--repeats", type=int, default=0, help="then N pairs of engine and static runs, alternately: "
                    "each pair's useful-token ratio and their median")
    ap.add_argument("--by-width", action="store_true", help="the engine's steps by batch width, each waited for")
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    import jax

    rows = [measure(name, args) for name in args.models]
    write_result({"device": str(jax.devices()[0].device_kind), "host": platform.node(), "cpus": os.cpu_count(),
                  "cpu_flags": _cpu_flags(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                  "load_average": [round(x, 2) for x in os.getloadavg()],
                  "command": (f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} " if os.environ.get("JAX_PLATFORMS") else "")
                  + "python benchmarks/rollout_throughput.py " + " ".join(sys.argv[1:]),
                  "results": rows}, args.out)


if __name__ == "__main__":
    main()
