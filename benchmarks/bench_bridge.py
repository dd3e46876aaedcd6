"""HF bridge memory and speed → benchmarks/results/bridge.json.

    python benchmarks/bench_bridge.py [--layers 8] [--dim 1024]

Exports a mid-size llama (random weights, float32) to HF safetensors and imports it back, each in a
fresh process, and reports the peak resident memory each conversion added on top of the
parameters it holds (VmHWM reset via /proc/self/clear_refs before converting), next to the size
of the whole model and of its largest tensor. Tensor-by-tensor conversion should add about one
tensor, not one model.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bridge.json"
MIB = 2**20


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS


def _config(args):
    from maxlite import config as C
    return C.load(["base.yml", f"base_emb_dim={args.dim}", f"base_num_decoder_layers={args.layers}",
                   f"base_num_query_heads={args.dim // 64}", f"base_num_kv_heads={args.dim // 256}",
                   "head_dim=64", f"base_mlp_dim={args.dim * 11 // 4}", "vocab_size=32000"])


def child(args) -> dict:
    """One conversion in this process; prints its measurements as JSON."""
    from maxlite.bridge import hf
    from maxlite.bridge import params as P

    cfg = _config(args)
    if args.child == "export":
        pure = P.random_params(cfg)
        sizes = [v.nbytes for _, v in P.leaves(pure)]
        before = _status("VmRSS")
        _reset_peak()
        t = time.perf_counter()
        hf.export_hf(cfg, pure, args.dir, max_shard_size="200MB", tokenizer="none")
    else:
        before = _status("VmRSS")
        _reset_peak()
        t = time.perf_counter()
        _, pure = hf.import_hf(args.dir)
        sizes = [v.nbytes for _, v in P.leaves(pure)]
    seconds = time.perf_counter() - t
    peak, after = _status("VmHWM"), _status("VmRSS")
    model = sum(sizes)
    held = model if args.child == "export" else 0  # import builds the params it returns
    return {"model_mib": model / MIB, "largest_tensor_mib": max(sizes) / MIB,
            "rss_before_mib": before / MIB, "rss_after_mib": after / MIB, "peak_mib": peak / MIB,
            "peak_added_mib": (peak - before) / MIB,
            "peak_added_beyond_result_mib": (peak - before - (model - held)) / MIB,
            "seconds": seconds, "gb_per_s": model / seconds / 1e9, "params": int(model // 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--child", choices=("export", "import"))
    parser.add_argument("--dir")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    results = {"layers": args.layers, "dim": args.dim}
    with tempfile.TemporaryDirectory() as tmp:
        for step in ("export", "import"):
            print(f"{step} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--child", step, "--dir", tmp,
                                  "--layers", str(args.layers), "--dim", str(args.dim)],
                                 env=env, check=True, capture_output=True, text=True).stdout
            results[step] = json.loads(out.strip().splitlines()[-1])
        # end to end through maxlite checkpoints (Orbax restore/save included): peak RSS of each CLI
        ckpt = os.path.join(tmp, "ckpt")
        for name, argv in (("cli_import", ["import", tmp, ckpt]),
                           ("cli_export", ["export", ckpt, os.path.join(tmp, "again"), "--tokenizer", "none"])):
            print(f"{name} ...", file=sys.stderr, flush=True)
            code = ("import resource, runpy, sys\n"
                    f"sys.argv = ['hf'] + {argv!r}\n"
                    "try:\n    runpy.run_module('maxlite.bridge.hf', run_name='__main__')\n"
                    "except SystemExit as e:\n    assert not e.code, e.code\n"
                    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                 text=True, cwd=ROOT).stdout
            results[name] = {"peak_rss_mib": int(out.strip().splitlines()[-1]) / 1024,
                             "seconds": time.perf_counter() - t}
            results[name]["peak_over_model"] = results[name]["peak_rss_mib"] / results["export"]["model_mib"]
    for step in ("export", "import"):
        r = results[step]
        r["extra_over_largest_tensor"] = r["peak_added_beyond_result_mib"] / r["largest_tensor_mib"]
        r["extra_over_model"] = r["peak_added_beyond_result_mib"] / r["model_mib"]
    write_result(results, OUT)


if __name__ == "__main__":
    main()
