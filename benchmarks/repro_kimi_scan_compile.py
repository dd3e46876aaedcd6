"""A reproduction, not a benchmark: a random Kimi Linear (tests/hf_models.py's config, with a dense layer and
then two units of (KDA, latent attention), stacked) imported from transformers, its forward lowered once and
compiled several times with XLA:CPU's default code generation; each compilation's float32 logits against
transformers', in three variants → benchmarks/results/kimi_scan_compile.json (docs/families.md, "Kimi
Linear's layer loop on XLA:CPU"):

- `as_built`: the layer loop as maxlite builds it on a CPU (kinds.scan_unroll: unrolled for this kind);
- `loop`: the two units run by a loop (scan_unroll forced to 1), as every other platform runs them;
- `loop_without_ynn`: the same loop, compiled with XLA:CPU's YNNPACK fusions off.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \\
        python benchmarks/repro_kimi_scan_compile.py [--compiles 4] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compiles", type=int, default=6)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "kimi_scan_compile.json")
    args, overrides = ap.parse_known_args()

    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from maxlite.bridge import hf
    from maxlite.models import transformer
    from maxlite.models.layout import layer_stacks
    from maxlite.state import abstract_params
    from tests import hf_models

    torch.set_num_threads(1)
    config = hf_models.config("kimi_linear")
    config.num_hidden_layers = 5
    config.layer_types = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
    config.mlp_layer_types = ["dense", "sparse", "sparse", "sparse", "sparse"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    directory = tempfile.mkdtemp()
    model.save_pretrained(directory)
    cfg, pure = hf.import_hf(directory, ["dtype=float32", "max_target_length=16", *overrides])
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.float().numpy()
    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    B, T = ids.shape
    inputs = (ids, np.broadcast_to(np.arange(T), (B, T)), np.ones((B, T), np.int32))
    as_built = transformer.scan_unroll
    variants = {"as_built": (as_built, None), "loop": (lambda stack, platform: 1, None),
                "loop_without_ynn": (lambda stack, platform: 1, {"xla_cpu_experimental_ynn_fusion_type": ""})}
    results = {}
    for name, (unroll, options) in variants.items():
        transformer.scan_unroll = unroll
        rows = []
        for _ in range(args.compiles):
            lowered = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a)).lower(state, *inputs)
            compiled = lowered.compile(options)
            ours = np.asarray(compiled(state, *inputs))
            again = np.asarray(compiled(state, *inputs))
            rows.append({"hlo_md5": hashlib.md5(lowered.as_text().encode()).hexdigest(),
                         "relative": float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)),
                         "same_program_twice_equal": bool(np.array_equal(ours, again, equal_nan=True))})
            print(name, rows[-1], file=sys.stderr, flush=True)
        results[name] = {"compiler_options": options, "compiles": rows,
                         "worst_relative": max(r["relative"] for r in rows)}
    transformer.scan_unroll = as_built
    write_result({"stacks": [(s.name, s.count, len(s.unit)) for s in layer_stacks(cfg)], "overrides": overrides,
                  "xla_flags": os.environ.get("XLA_FLAGS", ""), "jaxlib": jax.lib.__version__,
                  "variants": results}, args.out)


if __name__ == "__main__":
    main()
