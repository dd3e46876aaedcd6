"""The output head's rows per device with pipeline stages, on simulated CPU devices: the compiled
train step's temporaries per device and the shapes of its float32 logits ([rows, T, V]) for
pipelined layouts against fsdp over all devices, same model and global batch.

    python benchmarks/bench_pipeline_head.py [--out FILE]

A wide vocabulary (32,000) and num_vocab_tiling=1 make the head visible. Compiles only (no steps).
Writes JSON (default benchmarks/results/pipeline_head_rows_cpu.json).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks._results import write_result  # noqa: E402

RECIPE = ["base.yml", "model_name=tiny", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=2",
          "base_num_kv_heads=2", "head_dim=32", "base_num_decoder_layers=4", "vocab_size=32000",
          "max_target_length=256", "dtype=float32", "per_device_batch_size=2", "num_vocab_tiling=1",
          "enable_tensorboard=false", "write_report=false", "dataset_type=synthetic"]
LAYOUTS = {"fsdp8": ["ici_fsdp_parallelism=8"],
           "pipeline4_fsdp2": ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2"],
           "pipeline2_fsdp4": ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"]}


def _measure(recipe: list[str]) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import config as C, mesh as mesh_lib
    from maxlite.build import build

    built = build(C.load(recipe), jax.devices()[:8], num_processes=1)
    B, T, V = built.cfg.global_batch_size, built.cfg.max_target_length, built.cfg.vocab_size
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.float32 if k == "weights" else jnp.int32,
                                     sharding=built.batch_sharding)
             for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), built.abstract, built.shardings)
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        compiled = built.train_step.lower(state, batch).compile()
    shapes = sorted({(int(a), int(b)) for a, b in re.findall(rf"f32\[(\d+),(\d+),{V}\]", compiled.as_text())})
    return {"temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
            "logits_per_device": [f"f32[{a},{b},{V}]" for a, b in shapes],
            "logit_rows_per_device": max(a * b for a, b in shapes) // T, "global_batch": B}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/pipeline_head_rows_cpu.json"))
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    layouts = {name: _measure([*RECIPE, *extra]) for name, extra in LAYOUTS.items()}
    write_result({"recipe": RECIPE, "devices": 8, "layouts": layouts}, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
