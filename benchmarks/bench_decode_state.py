"""The decode cache of one sequence at 1k and 32k positions, full-size presets → benchmarks/results/decode_state.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_decode_state.py [--lengths 1024 32768] [--presets ...]

For each preset (its own compute dtype) and length: the bytes of the arrays decoding allocates for
one sequence (`maxlite.models.decode.empty_cache` under `jax.eval_shape`: shapes only, nothing
allocated), per layer stack, split into the recurrent layers' state (Kimi delta attention,
Mamba-2, the gated delta-net: `recurrent` kinds) and the rest (attention's keys and values, latent
attention's latents); and what `maxlite.generate` reports for the same length (the kinds' count,
`decode_cache_numbers`), which must be the same bytes. The hybrids hold the same state at every
length; only their attention layers' part grows, against a model whose every layer attends.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "decode_state.json"
PRESETS = ("kimi-linear-48b-a3b", "nemotron-h-8b", "qwen3-next-80b-a3b", "deepseek-v3", "llama3.1-8b")


def measure(preset: str, length: int) -> dict:
    import jax
    import numpy as np

    from maxlite import config as C
    from maxlite.models import decode
    from maxlite.models.kinds import MIXERS, decode_cache_numbers

    cfg = C.load(["base.yml", f"model_name={preset}"])
    cache = jax.eval_shape(lambda: decode.empty_cache(cfg, 1, length))
    stacks = {f"{mixer}/{variant}": sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(layers))
              for (mixer, variant), (layers, _) in cache.stacks.items()}
    state = sum(b for key, b in stacks.items() if MIXERS[key.split("/")[0]].recurrent)
    total, counted_state = decode_cache_numbers(cfg, length)
    itemsize = np.dtype(jax.numpy.dtype(cfg.dtype)).itemsize
    return {"preset": preset, "positions": length, "dtype": cfg.dtype, "layers": cfg.base_num_decoder_layers,
            "bytes_allocated": sum(stacks.values()), "recurrent_state_bytes": state,
            "growing_bytes": sum(stacks.values()) - state, "by_stack": stacks,
            "generate_reports": {"bytes": total * itemsize, "recurrent_state_bytes": counted_state * itemsize}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    rows = []
    for preset in args.presets:
        for length in args.lengths:
            rows.append(measure(preset, length))
            r = rows[-1]
            print(f"{preset} at {length}: {r['bytes_allocated'] / 2**20:,.1f} MiB, of it a recurrent state of "
                  f"{r['recurrent_state_bytes'] / 2**20:,.1f} MiB", file=sys.stderr, flush=True)
    write_result({"what": "the decode cache of one sequence (batch 1), by layer stack, at each length; "
                          "shapes from jax.eval_shape, nothing allocated", "results": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
