"""A reproduction, not a benchmark: a random Kimi Linear (tests/hf_models.py's config) imported from
transformers, its forward lowered once and compiled several times with XLA:CPU's default code generation;
each compilation's float32 logits against transformers', in three variants → benchmarks/results/
kimi_scan_compile.json (docs/families.md, "Kimi Linear's layer loop on XLA:CPU"):

- `as_built`: as maxlite computes it (the delta rule's zero state kept an array: gated_deltanet.zero_state);
- `zeros_folded`: the zero state a plain constant, which XLA folds into the fusion that multiplies it
  (what maxlite did before);
- `zeros_folded_without_ynn`: the same, compiled with XLA:CPU's YNNPACK fusions off.

The model: a dense layer, then two units of (KDA, latent attention) stacked and run by a loop; with
`--stages N` (N simulated devices) eight MoE layers of (KDA, latent attention) in N pipeline stages
(maxlite/models/pipeline.py), each stage's units inside the pipeline's loop.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \\
        python benchmarks/repro_kimi_scan_compile.py [--compiles 8] [KEY=VALUE ...]
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python benchmarks/repro_kimi_scan_compile.py --stages 4 --out benchmarks/results/kimi_scan_compile_pipeline.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import cpuinfo, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compiles", type=int, default=8)
    ap.add_argument("--stages", type=int, default=1, help="pipeline stages (that many simulated devices)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "kimi_scan_compile.json")
    args, overrides = ap.parse_known_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from maxlite import build as build_lib, mesh as mesh_lib
    from maxlite.bridge import hf
    from maxlite.models import gated_deltanet
    from maxlite.models.layout import layer_stacks
    from maxlite.state import abstract_params
    from tests import hf_models

    torch.set_num_threads(1)
    config = hf_models.config("kimi_linear")
    if args.stages > 1:
        config.num_hidden_layers = 8
        config.layer_types = ["linear_attention", "full_attention"] * 4
        config.mlp_layer_types = ["sparse"] * 8
        overrides = [f"ici_pipeline_parallelism={args.stages}", "ici_fsdp_parallelism=1", *overrides]
    else:
        config.num_hidden_layers = 5
        config.layer_types = ["linear_attention", "linear_attention", "full_attention", "linear_attention",
                              "full_attention"]
        config.mlp_layer_types = ["dense", "sparse", "sparse", "sparse", "sparse"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    directory = tempfile.mkdtemp()
    model.save_pretrained(directory)
    cfg, pure = hf.import_hf(directory, ["dtype=float32", "max_target_length=16", *overrides])
    rows = 2 * args.stages  # a micro-batch per stage
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (rows, 16))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.float().numpy()
    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    B, T = ids.shape
    inputs = (ids, np.broadcast_to(np.arange(T), (B, T)).copy(), np.ones((B, T), np.int32))
    mesh = build_lib.build(cfg, jax.devices()[:args.stages], num_processes=1).mesh
    as_built = gated_deltanet.zero_state
    folded = lambda shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    no_ynn = {"xla_cpu_experimental_ynn_fusion_type": ""}
    variants = {"as_built": (as_built, None), "zeros_folded": (folded, None),
                "zeros_folded_without_ynn": (folded, no_ynn)}
    results = {}
    for name, (zero_state, options) in variants.items():
        gated_deltanet.zero_state = zero_state
        compiles = []
        with jax.set_mesh(mesh) if args.stages > 1 else contextlib.nullcontext(), \
                nnx.logical_axis_rules(mesh_lib.RULES):
            for _ in range(args.compiles):
                lowered = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a)).lower(state, *inputs)
                compiled = lowered.compile(options)
                ours = np.asarray(compiled(state, *inputs))
                again = np.asarray(compiled(state, *inputs))
                compiles.append({"hlo_md5": hashlib.md5(lowered.as_text().encode()).hexdigest(),
                                 "relative": float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)),
                                 "same_program_twice_equal": bool(np.array_equal(ours, again, equal_nan=True))})
                print(name, compiles[-1], file=sys.stderr, flush=True)
        results[name] = {"compiler_options": options, "compiles": compiles,
                         "right": sum(r["relative"] <= 1e-5 for r in compiles),
                         "worst_relative": max(r["relative"] for r in compiles)}
    gated_deltanet.zero_state = as_built
    write_result({"stacks": [(s.name, s.count, len(s.unit)) for s in layer_stacks(cfg)], "stages": args.stages,
                  "overrides": overrides, "xla_flags": os.environ.get("XLA_FLAGS", ""), "jaxlib": jax.lib.__version__,
                  "machine": f"{cpuinfo('model name')}, {os.cpu_count()} cores", "variants": results}, args.out)


if __name__ == "__main__":
    main()
