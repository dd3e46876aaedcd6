"""Each RL loss from the same SFT start → benchmarks/results/rl_algos*.json: held-out pass@1 at the
SFT start and at the end, steps and minutes, per `loss_algo`.

    python benchmarks/bench_rl_algos.py [--recipe grpo.yml] [--algos grpo gspo-token dapo dr_grpo]
        [--parallel N] [--timeout S] [--out F] [KEY=VALUE ...]

Each algorithm is one `python -m maxlite.train RECIPE loss_algo=A KEY=VALUE ...` as a user runs it
(its own process and run directory under a temporary folder; every other key the recipe's, so the
SFT warm-up and the data order are the same for all). Its figures come from the run's metrics.jsonl:
the eval at step alignment_sft_steps (the SFT start: the reference policy) and the last eval, and
the RL steps' mean generation_batches / groups_kept / groups_dropped where the run logs them (DAPO's
dynamic sampling and refill). `--parallel N`
runs N at once (a GPU that one small model leaves idle); a run past `--timeout` seconds is stopped
and reported with the evals it reached (`finished: false`). The JSON is written after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402


def _evals(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
             if k == "step" or k.startswith("eval_")} for r in rows if "eval_pass_at_1" in r]


def _training(run_dir: pathlib.Path) -> dict:
    """The RL steps' filter and refill figures (those the run logs), each as its mean over the steps."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = [r for r in rows if "loss" in r and ("generation_batches" in r or "groups_dropped" in r)]
    keys = ("generation_batches", "groups_kept", "groups_dropped")
    return {k: round(sum(r[k] for r in rows) / len(rows), 4) for k in keys if rows and all(k in r for r in rows)}


def _one(algo: str, args, overrides: list[str], workdir: pathlib.Path) -> dict:
    from maxlite import config as C

    cfg = C.load([args.recipe, f"loss_algo={algo}", *overrides])
    argv = [sys.executable, "-m", "maxlite.train", args.recipe, f"loss_algo={algo}", *overrides,
            f"base_output_directory={workdir}", f"run_name={algo}"]
    log = open(workdir / f"{algo}.log", "w")
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    minutes = (time.perf_counter() - start) / 60
    evals = _evals(workdir / algo)
    start_eval = next((e for e in evals if e["step"] == cfg.alignment_sft_steps), None)
    end_eval = evals[-1] if evals else None
    tail = (workdir / f"{algo}.log").read_text().splitlines()[-3:]
    row = {"loss_algo": algo, "finished": code == 0, "exit": code, "minutes": round(minutes, 2),
           "sft_steps": cfg.alignment_sft_steps, "steps": cfg.steps, "last_eval_step": end_eval and end_eval["step"],
           "start": start_eval, "end": end_eval, "evals": evals, "rl_steps_mean": _training(workdir / algo),
           "log_tail": tail}
    if start_eval and end_eval:
        row["pass_at_1_gain"] = round(end_eval["eval_pass_at_1"] - start_eval["eval_pass_at_1"], 4)
    print(algo, json.dumps({k: row[k] for k in ("finished", "minutes", "start", "end")}), file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="grpo.yml")
    ap.add_argument("--algos", nargs="+", default=["grpo", "gspo-token", "dapo", "dr_grpo"])
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "rl_algos.json")
    args, overrides = ap.parse_known_args()
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip() if shutil.which(
        "nvidia-smi") else ""  # not jax.devices(): this process would take the GPU's memory from the runs
    result = {"recipe": args.recipe, "overrides": overrides, "device": gpus or platform.processor() or "cpu",
              "host": platform.node(), "cpus": os.cpu_count(), "parallel": args.parallel,
              "command": " ".join(["python benchmarks/bench_rl_algos.py", *sys.argv[1:]]), "runs": {}}
    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):  # what the runs inherit (the simulated devices of a CPU run)
        if os.environ.get(var):
            result["command"] = f"{var}={os.environ[var]} " + result["command"]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        futures = {a: pool.submit(_one, a, args, overrides, pathlib.Path(tmp)) for a in args.algos}
        for algo, future in futures.items():
            result["runs"][algo] = future.result()
            result["load_average"] = [round(x, 2) for x in os.getloadavg()]
            write_result(result, args.out)


if __name__ == "__main__":
    main()
