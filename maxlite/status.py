"""`python -m maxlite.status RUN_DIR`: where a run stands, from its run directory alone.

Reads status.json (state, step), metrics.jsonl (last loss, tokens/s, step times for the ETA,
the summary's goodput), the checkpoint listing (`checkpoints.list_checkpoints`) and the run's lease
(maxlite/lease.py): a run whose status still says `running` but whose lease holder is gone is
`lost`, and said to be killed for memory when its cgroup's OOM killer ran since it started. Works
for any run directory a local, Ray or Slurm run writes, on local disk or gs://.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import fsspec
import yaml

from maxlite import cli, config as C
from maxlite.checkpoints import list_checkpoints
from maxlite.rundir import read_status

ETA_WINDOW = 20  # last steps averaged for the ETA


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    try:
        with fsspec.open(path, "r") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line half-written by a running job
            continue
    return records


def _read_config(run_dir: str) -> dict[str, Any] | None:
    try:
        with fsspec.open(f"{run_dir}/config.yml", "r") as f:
            return yaml.safe_load(f) or {}
    except FileNotFoundError:
        return None


def run_status(run_dir: str) -> dict[str, Any]:
    """The fields `maxlite.status` prints; ConfigError when `run_dir` is not a run directory."""
    run_dir = run_dir.rstrip("/")
    status, cfg = read_status(run_dir), _read_config(run_dir)
    if status is None and cfg is None:
        raise C.ConfigError(f"{run_dir}: not a maxlite run directory (no status.json or config.yml)")
    cfg, status = cfg or {}, status or {}
    records = _read_jsonl(f"{run_dir}/metrics.jsonl")
    train = [r for r in records if "loss" in r and "seconds" in r]
    summary = next((r["summary"] for r in reversed(records) if "summary" in r), {})
    out: dict[str, Any] = {"run_dir": run_dir, "state": status.get("state", "unknown"),
                           "step": status.get("step", train[-1]["step"] if train else 0),
                           "steps": cfg.get("steps")}
    if train:
        last = train[-1]
        out["step"] = max(int(out["step"] or 0), int(last["step"]))
        out["loss"] = last["loss"]
        out["tokens_per_second_per_device"] = last.get("tokens_per_second_per_device")
        window = [r["seconds"] for r in train[-ETA_WINDOW:]]
        remaining = (out["steps"] or 0) - out["step"]
        if out["state"] == "running" and remaining > 0:
            out["eta_seconds"] = remaining * sum(window) / len(window)
    goodput = summary.get("goodput", status.get("goodput"))
    if goodput is not None:
        out["goodput"] = goodput
    ckpt_dir = (cfg.get("checkpoint_dir") or "").rstrip("/") or f"{run_dir}/checkpoints"
    try:
        complete = [r for r in list_checkpoints(ckpt_dir) if r["complete"]]
    except C.ConfigError:  # no checkpoint directory yet
        complete = []
    if complete:
        out["last_checkpoint"] = complete[-1]["step"]
    if out["state"] in ("running", "unknown"):  # unknown: it went before its first status
        _lost(run_dir, cfg, out)
    return out


def _lost(run_dir: str, cfg: dict[str, Any], out: dict[str, Any]) -> None:
    """`running` with no one running it: the lease's holder is gone (killed -9, for memory, ...)."""
    from maxlite import lease

    held = lease.read(run_dir)
    why = held and lease.gone(held, float(cfg.get("run_lease_seconds") or 120), time.time())
    if why:
        out["state"] = "lost"
        out["lost"] = f"{why}; {lease.gone_because(held)}; run it again to resume from its last checkpoint"
        if "killed for memory" in out["lost"]:
            out["reason"] = "out_of_memory"


def _fmt_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def format_status(st: dict[str, Any]) -> str:
    steps = f"/{st['steps']}" if st.get("steps") else ""
    state = st["state"] + (f" ({st['lost']})" if "lost" in st else "")
    lines = [f"run: {st['run_dir']}", f"state: {state}", f"step: {st['step']}{steps}"]
    if "loss" in st:
        lines.append(f"loss: {st['loss']:.4f}")
    if st.get("tokens_per_second_per_device") is not None:
        lines.append(f"tokens/s/device: {st['tokens_per_second_per_device']:,.0f}")
    if "eta_seconds" in st:
        lines.append(f"eta: {_fmt_seconds(st['eta_seconds'])}")
    lines.append(f"last checkpoint: {st.get('last_checkpoint', 'none')}")
    if "goodput" in st:
        lines.append(f"goodput: {st['goodput']}")
    return "\n".join(lines)


@cli.entry_point()
def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m maxlite.status", description="A run's status: state, step, "
                                "how it ended and what happens next, from its run directory.")
    p.add_argument("run_dir", help="the run directory, local or gs:// (e.g. runs/NAME)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    print(format_status(run_status(C.resolve_path(args.run_dir))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
