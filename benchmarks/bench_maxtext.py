"""maxlite against MaxText 0.2.5 on this CPU, MaxText's tiny configuration, interleaved runs.

    JAX_PLATFORMS=cpu python benchmarks/bench_maxtext.py --model dense|moe [--pairs 3] [--steps 15]
        [--maxtext-python /work/maxtext-venv/bin/python] [--out FILE]

MaxText needs Python >= 3.12 and its own JAX, so it runs from a separate virtual environment
(`--maxtext-python`; made with `python3.12 -m venv` and `pip install -r
benchmarks/maxtext-0.2.5-cpu.txt`, the versions measured). Each pair is one MaxText training run
and one maxlite run of the same model, one after the other (the order alternating pair by pair,
so that a change in the machine's load hits both sides alike), each a fresh process on synthetic
data with `JAX_PLATFORMS=cpu`. A side's time is the median of its own per-step log lines ("completed
step: N, seconds: S", the line both print) after its first 5 steps (compilation and warm-up out of
the way); process wall clock is not timed. Reported per pair: maxlite's speed as a multiple of
MaxText's (MaxText's median seconds / maxlite's), and the median of those. The load average
(`uptime`) is recorded before and after every run: the machine is shared.

  dense  emb 256, 4 layers, 4 query / 2 KV heads of 64, MLP 768, vocabulary 32,000, 256 tokens,
         batch 1: MaxText's base.yml (llama2 decoder block) with those dims, against `tiny`
  moe    the same with 8 experts of MLP 384, top 2, dropless: MaxText `model_name=mixtral-8x7b
         override_model_config=True sparse_matmul=True megablox=False capacity_factor=-1` (its
         ragged_dot path), against `tiny-moe` (dropless: `blocked` on CPU); both add the
         load-balancing loss at weight 0.01 (maxlite's default; MaxText's is 0)

Both keep their defaults otherwise (bfloat16 activations, float32 weights, scanned layers,
remat_policy full, AdamW, gradient clipping 1.0). Writes JSON (default
benchmarks/results/maxtext_tiny_cpu.json / maxtext_tiny_moe_cpu.json).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks._results import cpuinfo, write_result  # noqa: E402

SKIP = 5  # first logged steps left out of each run's median
AIM = 1.3  # maxlite's step speed as a multiple of MaxText's

DIMS = {"base_emb_dim": 256, "base_num_decoder_layers": 4, "base_num_query_heads": 4, "base_num_kv_heads": 2,
        "head_dim": 64, "base_mlp_dim": 768, "vocab_size": 32000, "max_target_length": 256,
        "per_device_batch_size": 1}
# base_mlp_dim = base_moe_mlp_dim: MaxText requires it of a model whose every layer is MoE (unused there)
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "base_moe_mlp_dim": 384, "base_mlp_dim": 384, "capacity_factor": -1,
       "load_balance_loss_weight": 0.01}
MAXTEXT = {
    "dense": {},
    "moe": {"model_name": "mixtral-8x7b", "override_model_config": True, "sparse_matmul": True,
            "megablox": False, **MOE},
}
MAXLITE = {"dense": {"model_name": "tiny"}, "moe": {"model_name": "tiny-moe", **MOE}}
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def _kv(d: dict) -> list[str]:
    return [f"{k}={v}" for k, v in d.items()]


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def commands(model: str, steps: int, maxtext_python: str, out_dir: str) -> dict[str, list[str]]:
    """side → argv of one training run (run_name appended per run)."""
    maxtext_base = subprocess.run(
        [maxtext_python, "-c", "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "
                               "'configs', 'base.yml'))"], capture_output=True, text=True, check=True).stdout.strip()
    common = {**DIMS, "dataset_type": "synthetic", "steps": steps, "enable_checkpointing": False,
              "base_output_directory": out_dir, "enable_tensorboard": False}
    return {
        "maxtext": [maxtext_python, "-m", "maxtext.trainers.pre_train.train", maxtext_base,
                    *_kv({**common, **MAXTEXT[model]})],
        "maxlite": [sys.executable, "-m", "maxlite.train", "base.yml",
                    *_kv({**common, **MAXLITE[model], "write_report": False})],
    }


def run_once(side: str, argv: list[str], run_name: str, timeout: int) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if side == "maxlite":
        env["PYTHONPATH"] = str(ROOT)
    else:
        env.pop("PYTHONPATH", None)  # MaxText's venv imports only its own packages
    record = {"side": side, "uptime_before": _uptime(), "loadavg_before": os.getloadavg()}
    start = time.perf_counter()
    proc = subprocess.run([*argv, f"run_name={run_name}"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    record["process_wall_s"] = round(time.perf_counter() - start, 1)  # not the figure: its own log lines are
    record.update(uptime_after=_uptime(), loadavg_after=os.getloadavg())
    output = proc.stdout + proc.stderr
    seconds = [float(s) for _, s in STEP_LINE.findall(output)]
    if proc.returncode or len(seconds) <= SKIP:
        sys.exit(f"{side} run failed (exit {proc.returncode}, {len(seconds)} step lines):\n{output[-4000:]}")
    record.update(step_seconds=seconds, median_step_s=statistics.median(seconds[SKIP:]))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MAXTEXT), default="dense")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15, help="train steps per run (the first 5 are not timed)")
    parser.add_argument("--maxtext-python", default="/work/maxtext-venv/bin/python")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one training run may take")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    out_dir = tempfile.mkdtemp(prefix="bench_maxtext_")
    argv = commands(args.model, args.steps, args.maxtext_python, out_dir)
    pairs = []
    for i in range(args.pairs):
        order = ("maxtext", "maxlite") if i % 2 == 0 else ("maxlite", "maxtext")
        runs = {side: run_once(side, argv[side], f"{side}_{i}", args.timeout) for side in order}
        ratio = runs["maxtext"]["median_step_s"] / runs["maxlite"]["median_step_s"]
        pairs.append({"order": list(order), "maxlite_speed_vs_maxtext": ratio, **runs})
        print(f"pair {i}: maxtext {runs['maxtext']['median_step_s']:.3f} s, maxlite "
              f"{runs['maxlite']['median_step_s']:.3f} s, maxlite speed {ratio:.2f}x", flush=True)
    versions = subprocess.run([args.maxtext_python, "-c", "import importlib.metadata as m, sys; print(sys.version.split()[0], "
                               "*(m.version(p) for p in ('maxtext', 'jax', 'jaxlib', 'flax', 'optax')))"],
                              capture_output=True, text=True, check=True).stdout.split()
    import flax
    import jax
    import optax

    ratios = [p["maxlite_speed_vs_maxtext"] for p in pairs]
    name = "maxtext_tiny_cpu.json" if args.model == "dense" else "maxtext_tiny_moe_cpu.json"
    write_result({
        "command": "JAX_PLATFORMS=cpu python benchmarks/bench_maxtext.py " + " ".join(sys.argv[1:]),
        "what": f"{args.model}: median seconds per step after step {SKIP} from each run's own log lines, "
                "MaxText 0.2.5 and maxlite runs interleaved; ratio = MaxText seconds / maxlite seconds",
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_model": cpuinfo("model name"),
                    "cpu_flags": cpuinfo("flags")},
        "maxtext_command": shlex.join([*argv["maxtext"], "run_name=..."]).replace(out_dir, "$OUT"),
        "maxlite_command": shlex.join([*argv["maxlite"], "run_name=..."]).replace(out_dir, "$OUT"),
        "maxtext_env": dict(zip(("python", "maxtext", "jax", "jaxlib", "flax", "optax"), versions)),
        "maxlite_env": {"python": platform.python_version(), "jax": jax.__version__,
                        "flax": flax.__version__, "optax": optax.__version__},
        "steps_per_run": args.steps, "steps_skipped": SKIP,
        "maxtext_median_step_s": statistics.median(p["maxtext"]["median_step_s"] for p in pairs),
        "maxlite_median_step_s": statistics.median(p["maxlite"]["median_step_s"] for p in pairs),
        "ratio_per_pair": ratios, "median_ratio": statistics.median(ratios), "aim": AIM,
        "aim_met": statistics.median(ratios) >= AIM, "pairs": pairs,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, pathlib.Path(args.out or ROOT / "benchmarks" / "results" / name))


if __name__ == "__main__":
    main()
