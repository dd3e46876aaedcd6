"""What the alignment objectives cost → benchmarks/results/alignment.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_alignment.py [--repeats 5] [--grpo-steps 6]

dpo: the DPO step of the packaged recipe (dpo.yml: tiny, 16 pairs × 64 tokens per device) with
the reference's forward inside the step, and with `dpo_precompute_reference` (the reference read
from the batch), against an SFT (lm) step on the same tokens (both sides' rows as 2 × 16 lm rows),
and the reference's forward alone. The reference should cost about one forward more, not more.

grpo: the packaged recipe's step (grpo.yml: 8 prompts × 8 completions of 10 new tokens) split into
sampling (KV-cache decode, rewards) and training, and its sampled tokens/s against
maxlite.generate decoding the same batch shape (the decode benchmark's path) with the same weights.
Compiled steps, best of `--repeats` (GRPO: the mean over the steps after the first).
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

OUT = ROOT / "benchmarks" / "results" / "alignment.json"


def _first_batch(cfg, built):
    import jax

    from maxlite import data

    it = data.make_iterator(cfg, "train", 0, 1)
    try:
        local = next(it)
    finally:
        it.close()
    return {k: (v if k.startswith("host_") else jax.device_put(v, built.batch_sharding)) for k, v in local.items()}


def _best_step(step, state, batch, repeats: int):
    """(best seconds of `step(state, batch)` after a compiling call, the final state)."""
    import jax

    state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        best = min(best, time.perf_counter() - t)
    return best, state


def dpo_costs(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from maxlite import config as C
    from maxlite.build import build
    from maxlite.objectives import dpo, view

    dev = jax.devices()[:1]
    base = ["dpo.yml", "alignment_sft_steps=0", "alignment_sft_learning_rate=0"]
    live = build(C.load(base), dev, num_processes=1)
    cfg = live.cfg
    batch = _first_batch(cfg, live)
    live_s, state = _best_step(live.train_step, live.init_state(), batch, repeats)

    forward = jax.jit(lambda p, b: dpo.reference_logps(p, live.graphdef, b))
    refs = forward(state.params, batch)
    jax.block_until_ready(refs)
    forward_s = min(_timed(lambda: jax.block_until_ready(forward(state.params, batch))) for _ in range(repeats))

    pre = build(C.load([*base, "dpo_precompute_reference=true"]), dev, num_processes=1)
    pre_s, _ = _best_step(pre.train_step, pre.init_state(), {**batch, **refs}, repeats)

    sft = build(C.load([*base, "train_objective=lm", "dataset_type=synthetic",
                        f"per_device_batch_size={2 * cfg.per_device_batch_size}"]), dev, num_processes=1)
    rows = {k: jnp.concatenate([view(batch, "chosen_")[k], view(batch, "rejected_")[k]])
            for k in view(batch, "chosen_")}
    sft_s, _ = _best_step(sft.train_step, sft.init_state(), rows, repeats)
    return {"model": cfg.model_name, "pairs": cfg.global_batch_size, "tokens_per_row": cfg.max_target_length,
            "sft_step_s": round(sft_s, 4), "dpo_step_s": round(live_s, 4),
            "dpo_precomputed_step_s": round(pre_s, 4), "reference_forward_s": round(forward_s, 4),
            "dpo_over_sft": round(live_s / sft_s, 3), "dpo_precomputed_over_sft": round(pre_s / sft_s, 3),
            "reference_cost_in_forwards": round((live_s - pre_s) / forward_s, 2)}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def grpo_costs(steps: int) -> dict:
    import jax
    import numpy as np

    from maxlite import config as C, data
    from maxlite.build import build
    from maxlite.generate import Sampling, generate_ids
    from maxlite.mesh import global_batch

    built = build(C.load(["grpo.yml", "alignment_sft_steps=0", "alignment_sft_learning_rate=0"]),
                  jax.devices()[:1], num_processes=1)
    cfg, state = built.cfg, built.init_state()
    it = data.make_iterator(cfg, "train", 0, 1)
    records = []
    try:
        with jax.set_mesh(built.mesh):
            for step in range(steps):
                local = next(it)
                state, m = built.objective(state, global_batch(local, built.batch_sharding), step)
                records.append({k: float(v) for k, v in jax.device_get(m).items()})
    finally:
        it.close()
    warm = records[1:]  # the first step compiles
    sampling = float(np.mean([r["sampling_seconds"] for r in warm]))
    training = float(np.mean([r["training_seconds"] for r in warm]))
    rows = cfg.global_batch_size * cfg.grpo_num_generations
    new = cfg.grpo_max_new_tokens

    prompts = [local["prompt_ids"][i, :n].tolist() for i, n in enumerate(local["prompt_lengths"])]
    prompts = [p for p in prompts for _ in range(cfg.grpo_num_generations)]
    params = jax.device_get(state.params)
    generate_ids(cfg, params, prompts, Sampling(max_new_tokens=new, temperature=1.0))  # compiles
    decode = min(generate_ids(cfg, params, prompts, Sampling(max_new_tokens=new, temperature=1.0)).seconds
                 for _ in range(3))
    return {"model": cfg.model_name, "prompts": cfg.global_batch_size, "completions": rows,
            "max_new_tokens": new, "steps_measured": len(warm),
            "sampling_s": round(sampling, 4), "training_s": round(training, 4),
            "sampling_share": round(sampling / (sampling + training), 3),
            "sampled_tokens_per_s": round(rows * new / sampling, 1),
            "generate_tokens_per_s": round(rows * new / decode, 1),
            "sampling_over_generate": round(decode / sampling, 3),
            "mean_completion_length": round(float(np.mean([r["completion_length"] for r in warm])), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--grpo-steps", type=int, default=6)
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    import jax

    result = {"device": str(jax.devices()[0].device_kind), "devices": 1, "host": platform.node(),
              "command": "JAX_PLATFORMS=cpu python benchmarks/bench_alignment.py " + " ".join(sys.argv[1:])}
    result["dpo"] = dpo_costs(args.repeats)
    print(result["dpo"], file=sys.stderr, flush=True)
    result["grpo"] = grpo_costs(args.grpo_steps)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
