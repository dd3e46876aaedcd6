"""Weights pushed from the trainer's mesh to a rollout mesh of another shape → benchmarks/results/weight_push.json.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python benchmarks/bench_weight_push.py

The model (`--model`, llama-100m, float32) initialised on devices 0-3 with fsdp 4, pushed by maxlite's
WeightPush (jax.device_put onto the rollout shardings) to devices 4-7 as data 2 × tensor 2: the best
of `--repeats` pushes after one untimed, and whether the rollout mesh's logits equal the trainer's.
Also the planner's lower bound for an 8B model in bf16 between two v6e-16 slices
(maxlite.rollout.reshard.push_estimate_seconds).
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "weight_push.json"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-100m")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from maxlite import build as build_lib, config as C, mesh as mesh_lib
    from maxlite.plan.topology import parse
    from maxlite.rollout import reshard
    from maxlite.state import abstract_params, nbytes

    argv = ["base.yml", f"model_name={args.model}", "ici_fsdp_parallelism=4", "per_device_batch_size=1",
            "max_target_length=64", "dtype=float32", "train_objective=grpo", "dataset_type=prompts", "trainer_devices_fraction=0.5",
            "sampler_devices_fraction=0.5", "rollout_tensor_parallelism=2",
            "reward_functions=[maxlite.objectives.rewards:exact_answer]", "grpo_max_new_tokens=8"]
    cfg = C.load(argv)
    devices = jax.devices()
    placement = reshard.split_devices(cfg, devices)
    built = build_lib.build(cfg, devices)
    state = built.init_state()
    target = reshard.rollout_mesh(built.cfg, placement.sampler)
    push = reshard.WeightPush(state.params, target)
    push(state.params)  # the first push compiles nothing but warms the transfer paths
    seconds = min(push(state.params)[1] for _ in range(args.repeats))
    pushed = push(state.params)[0]

    graphdef = abstract_params(built.cfg)[0]
    ids = np.random.default_rng(0).integers(0, built.cfg.vocab_size, (2, 16))

    def logits(params, mesh):
        with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
            model = nnx.merge(graphdef, params)
            return np.asarray(nnx.jit(lambda m, *a: m(*a))(model, ids, np.broadcast_to(np.arange(16), (2, 16)),
                                                           np.ones((2, 16), np.int32)), np.float32)

    ours, theirs = logits(pushed, target), logits(state.params, built.mesh)
    chip = parse("v6e:4x4").chip
    write_result({
        "model": args.model, "param_bytes": nbytes(state.params), "trainer_mesh": dict(built.mesh.shape),
        "rollout_mesh": dict(target.shape), "push_seconds_best": seconds,
        "logits_max_abs_diff": float(np.abs(ours - theirs).max()),
        "estimate_8b_bf16_v6e16_to_v6e16_seconds": reshard.push_estimate_seconds(8.03e9 * 2, chip, 16),
        "estimate_basis": f"{chip.name} dcn_gbps={chip.dcn_gbps} per chip, 16 sending chips",
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), []),
    }, OUT)


if __name__ == "__main__":
    main()
