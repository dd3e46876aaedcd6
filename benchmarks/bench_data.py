"""Data benchmarks → benchmarks/results/data.json.

    python benchmarks/bench_data.py [--repeat 4] [--step-tokens-per-s N]

1. preprocess MB/s and tokens/s with 1 and 2 workers (bundled corpus repeated `--repeat` times);
2. loader tokens/s at seq 2048, batch 8, shuffled, for dataset_type=indexed and text;
3. the ratio to what a training step consumes: `--step-tokens-per-s`, else the
   `tokens_per_second` of benchmarks/results/train_tiny.json (`bench_train.py model_name=tiny`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per preprocess worker
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._results import write_result  # noqa: E402
from maxlite import config as C  # noqa: E402
from maxlite.data import make_iterator  # noqa: E402
from maxlite.data.preprocess import preprocess  # noqa: E402
from maxlite.data.tokenizer import BUNDLED_DIR, load_tokenizer  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "data.json"


def _corpus(tmp: str, repeat: int) -> str:
    import zstandard
    raw = zstandard.ZstdDecompressor().stream_reader(open(BUNDLED_DIR / "kjv_train.jsonl.zst", "rb")).read()
    path = os.path.join(tmp, "corpus.jsonl")
    with open(path, "wb") as f:
        for _ in range(repeat):
            f.write(raw)
    return path


def _cpu_seconds() -> float:
    import resource
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_preprocess(src: str, tmp: str, workers: int) -> dict:
    cpu = _cpu_seconds()
    s = preprocess([src], os.path.join(tmp, f"w{workers}"), load_tokenizer(""), ["text"], True,
                   workers, progress=False)
    mb, cpu = s["bytes"] / 1e6, _cpu_seconds() - cpu
    return {"workers": workers, "docs": s["docs"], "MB": round(mb, 2), "tokens": s["tokens"],
            "seconds": round(s["seconds"], 3), "MB_per_s": round(mb / s["seconds"], 2),
            "tokens_per_s": round(s["tokens"] / s["seconds"]),
            "tokens_per_s_per_worker": round(s["tokens"] / s["seconds"] / workers),
            # CPU time (main + workers) shows the per-worker cost when the machine is shared.
            "cpu_seconds": round(cpu, 2), "tokens_per_cpu_s": round(s["tokens"] / cpu),
            "prefix": s["outputs"][0]}


def bench_loader(args: list[str], batches: int) -> dict:
    c = C.resolve(C.load(["base.yml", "model_name=tiny", "max_target_length=2048",
                          "per_device_batch_size=1", *args]), 8)
    it = make_iterator(c, "train", 0, 1)
    for _ in range(3):  # warm-up: thread pools, first layouts, the text shuffle window
        next(it)
    start = time.perf_counter()
    real = 0
    for _ in range(batches):
        real += float(next(it)["weights"].sum())
    sec = time.perf_counter() - start
    it.close()
    tokens = batches * c.global_batch_size * c.max_target_length
    return {"batches": batches, "batch": c.global_batch_size, "seq": c.max_target_length,
            "seconds": round(sec, 3), "tokens_per_s": round(tokens / sec),
            "loss_carrying_fraction": round(real / tokens, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=4, help="copies of the bundled corpus to preprocess")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--step-tokens-per-s", type=float, default=0.0,
                    help="tokens/s a tiny training step consumes here (from a maxlite.train run)")
    a = ap.parse_args()
    result: dict = {"machine_cpus": os.cpu_count(), "load_average_1m_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        src = _corpus(tmp, a.repeat)
        pre = [bench_preprocess(src, tmp, w) for w in (1, 2)]
        pre[1]["speedup_vs_1_worker"] = round(pre[1]["tokens_per_s"] / pre[0]["tokens_per_s"], 2)
        result["preprocess"] = pre
        print(json.dumps(pre, indent=1), flush=True)
        result["loader_indexed"] = bench_loader(
            ["dataset_type=indexed", f"data_prefix={pre[0]['prefix']}"], a.batches)
        result["loader_text"] = bench_loader(["dataset_type=text"], max(a.batches // 10, 5))
    for pre_row in result["preprocess"]:
        pre_row.pop("prefix")
    step_file = OUT.parent / "train_tiny.json"
    if a.step_tokens_per_s <= 0 and step_file.is_file():
        a.step_tokens_per_s = float(json.loads(step_file.read_text())["tokens_per_second"])
        result["step_tokens_per_s_from"] = str(step_file.name)
    if a.step_tokens_per_s > 0:
        result["step_tokens_per_s"] = a.step_tokens_per_s
        for k in ("loader_indexed", "loader_text"):
            result[k]["x_step_consumption"] = round(result[k]["tokens_per_s"] / a.step_tokens_per_s, 1)
    write_result(result, OUT, indent=1)


if __name__ == "__main__":
    main()
