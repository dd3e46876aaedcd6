"""Peak host memory and time of `hf import` / `hf export` at preset sizes → benchmarks/results/hf_stream.json.

    python benchmarks/bench_hf_stream.py [--dir /tmp/hf_stream] [--sizes 1,5] [--weight-dtype float32]

For each size a random Llama (TinyLlama-1.1B's width: hidden 2048, 32 heads / 4 kv heads, MLP 5632,
vocabulary 32000, 22 layers; "5" is the same width with 5x the layers, 110: 5.0B parameters) is
written straight to sharded bfloat16 safetensors from random tensors, one tensor at a time (no
transformers model in memory), then imported with the CLI into an Orbax checkpoint and exported back,
each in a fresh process whose peak resident memory (ru_maxrss of the child) and wall time are
recorded. The export must give back the input's bfloat16 tensors bit for bit. The big files are
deleted at the end. Same width for both sizes on purpose: a streamed conversion's peak is set by
its largest tensors and the runtime, so it must not move when only the number of layers grows.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "hf_stream.json"
GIB = 2**30
WIDTH = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
         "vocab_size": 32000}
LAYERS = 22


def hf_config(layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **WIDTH, "num_hidden_layers": layers,
            "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
            "hidden_act": "silu", "torch_dtype": "bfloat16", "dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2}


def write_model(path: pathlib.Path, layers: int) -> int:
    """Random bfloat16 safetensors of a Llama with `layers` layers, tensor by tensor; returns bytes."""
    import ml_dtypes
    import numpy as np

    from maxlite.bridge.safetensors_io import Entry, write_sharded

    D, F, V = WIDTH["hidden_size"], WIDTH["intermediate_size"], WIDTH["vocab_size"]
    N, K, H = WIDTH["num_attention_heads"], WIDTH["num_key_value_heads"], 64
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
                       p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    entries = [Entry(name, shape, bf16, lambda shape=shape: (rng.standard_normal(shape, np.float32) * 0.02).astype(bf16))
               for name, shape in shapes.items()]
    path.mkdir(parents=True, exist_ok=True)
    write_sharded(path, entries, 2 * 10**9)  # ~2 GB shards, as a hub download has them
    (path / "config.json").write_text(json.dumps(hf_config(layers), indent=2))
    return sum(e.nbytes for e in entries)


def measured(cmd: list[str]) -> dict:
    """Run `cmd` in a fresh child of a fresh process: its peak RSS (ru_maxrss) and wall seconds."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "r = subprocess.run(sys.argv[1:]).returncode; s = time.perf_counter() - t; "
             "print('MEASURED', r, s, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    line = [x for x in out.stdout.splitlines() if x.startswith("MEASURED")][-1].split()
    if int(line[1]) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return {"seconds": round(float(line[2]), 1), "peak_rss_gib": round(int(line[3]) / GIB, 3)}


def du(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def same_tensors(a: pathlib.Path, b: pathlib.Path) -> bool:
    import numpy as np

    from maxlite.bridge.safetensors_io import SafetensorsDir

    x, y = SafetensorsDir(a), SafetensorsDir(b)
    return sorted(x.names()) == sorted(y.names()) and all(
        x.get(n).dtype == y.get(n).dtype and np.array_equal(x.get(n).view(np.uint16), y.get(n).view(np.uint16))
        for n in x.names())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/hf_stream")
    ap.add_argument("--sizes", default="1,5", help="layer multiples of the 22-layer 1.1B model")
    ap.add_argument("--weight-dtype", default="float32", help="what the checkpoint stores (the recipe's key)")
    args = ap.parse_args()
    base = pathlib.Path(args.dir)
    runs = []
    for k in [int(x) for x in args.sizes.split(",")]:
        work = base / f"x{k}"
        shutil.rmtree(work, ignore_errors=True)
        t = time.perf_counter()
        nbytes = write_model(work / "hf", LAYERS * k)
        made = time.perf_counter() - t
        py = [sys.executable, "-m", "maxlite.bridge.hf"]
        imp = measured([*py, "import", str(work / "hf"), str(work / "ckpt"), f"weight_dtype={args.weight_dtype}"])
        exp = measured([*py, "export", str(work / "ckpt"), str(work / "out"), "--tokenizer", "none"])
        run = {"layers": LAYERS * k, "parameters_b": round(nbytes / 2 / 1e9, 2), "hf_bf16_gib": round(nbytes / GIB, 2),
               "generate_seconds": round(made, 1), "import": imp, "export": exp,
               "checkpoint_gib": round(du(work / "ckpt") / GIB, 2), "export_gib": round(du(work / "out") / GIB, 2),
               "export_files": sorted(p.name for p in (work / "out").glob("*.safetensors*")),
               "round_trip_bit_exact_bf16": same_tensors(work / "hf", work / "out")}
        print(json.dumps(run), flush=True)
        runs.append(run)
        shutil.rmtree(work, ignore_errors=True)  # disk is limited: ~5x the model per size
    result = {"command": "python benchmarks/bench_hf_stream.py " + " ".join(sys.argv[1:]),
              "weight_dtype": args.weight_dtype, "width": WIDTH, "runs": runs,
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "max_rss_note": "ru_maxrss of the CLI process: resident memory incl. the JAX runtime and mapped file pages"}
    if len(runs) > 1:
        result["peak_ratio_largest_to_smallest"] = {
            step: round(runs[-1][step]["peak_rss_gib"] / runs[0][step]["peak_rss_gib"], 3) for step in ("import", "export")}
    write_result(result, OUT)


if __name__ == "__main__":
    main()
