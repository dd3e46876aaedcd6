"""Recovery after losing a host, on a real Ray cluster → benchmarks/results/recovery.json.

    python benchmarks/bench_recovery.py [--steps 40]

Two CPU workers on two Ray nodes (tiny model, 2 simulated devices each, checkpoints every 5
steps, in-memory snapshots every 2) train; once a few steps ran, one node is stopped for good.

- elastic: `ray_min_workers=1`, no spare node: after `elastic_wait_seconds` the group restarts on
  the one node left (2 micro-batches per step keep the global batch) from the disk checkpoint
  (in-memory snapshots belong to the 2-host topology);
- full_disk: a spare node is up before the loss, no snapshots: Ray restarts the full group with it
  from the disk checkpoint (the issue's yardstick);
- full_memory: the same with the snapshots: the new group restores from the peer's replica of the
  lost host's shard (`source` says which it used).

Measured from the node's stop to the first step the new group logs (wall clock, polled every
0.2 s), and how many steps the new group had to redo. Machine: 2 cores, so the numbers are
dominated by process start, JAX import and compilation; what matters is the difference between
the two and that both stay far under HyperPod's "under 2 minutes" at scale.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._results import write_result  # noqa: E402
from tests.ray_cluster import RayHead, ray_env, stop_session  # noqa: E402 — the tests' real local cluster

OUT = ROOT / "benchmarks" / "results" / "recovery.json"
RECIPE = ["base.yml", "model_name=tiny", "per_device_batch_size=1", "max_target_length=64", "checkpoint_period=5",
          "enable_tensorboard=false", "write_report=false", "ray_num_workers=2",
          "ray_simulated_devices_per_worker=2", "max_restarts=2", "log_period=1", "eval_interval=0"]


def _steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"completed step: (\d+),", log)]


def one(kind: str, steps: int, wait_s: int, out_dir: pathlib.Path) -> dict:
    with RayHead(num_cpus=0) as head:
        head.add_node("a", num_cpus=1)
        head.add_node("b", num_cpus=1)
        args = [*RECIPE, f"steps={steps}", f"base_output_directory={out_dir}", f"run_name={kind}"]
        if kind == "elastic":
            args += ["ray_min_workers=1", f"elastic_wait_seconds={wait_s}"]
        args.append(f"inmemory_snapshot_period={2 if kind == 'full_memory' else 0}")
        log_path = out_dir / f"{kind}.log"
        driver = subprocess.Popen([sys.executable, "-m", "ray_entry.train", *args], cwd=ROOT,
                                  env=ray_env(RAY_ADDRESS=head.gcs_address), stdout=open(log_path, "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while max(_steps(log_path.read_text()), default=0) < 12:
                if driver.poll() is not None:
                    raise RuntimeError(log_path.read_text()[-3000:])
                time.sleep(0.2)
            if kind.startswith("full"):
                head.add_node("c", num_cpus=1)  # the replacement, up before the loss
            last = max(_steps(log_path.read_text()))
            offset = len(log_path.read_text())
            lost = time.monotonic()
            stop_session(head.nodes["b"].pid, grace_s=0.5)
            restarted = re.compile(r"(resumed from step (\d+)|restored step (\d+) from memory).*?completed step: \d+,", re.S)
            while not (found := restarted.search(log_path.read_text()[offset:])):
                if driver.poll() is not None:
                    raise RuntimeError(log_path.read_text()[-3000:])
                time.sleep(0.2)
            seconds = time.monotonic() - lost
            driver.wait(timeout=600)
        finally:
            stop_session(driver.pid)
    from_step = int(found.group(2) or found.group(3))
    status = json.loads((out_dir / kind / "status.json").read_text())
    return {"seconds_to_first_step": round(seconds, 1), "workers_after": (status.get("elastic") or {}).get("workers", 2),
            "source": "memory" if found.group(3) else "checkpoint", "resumed_from_step": from_step,
            "steps_done_before_loss": last, "steps_redone": last - from_step,
            "finished": status["state"] == "finished", "elastic_wait_seconds": wait_s if kind == "elastic" else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--wait", type=int, default=10, help="elastic_wait_seconds")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_recovery_") as tmp:
        results = {kind: one(kind, a.steps, a.wait, pathlib.Path(tmp)) for kind in ("elastic", "full_disk", "full_memory")}
    write_result({"benchmark": "recovery after losing one of two Ray hosts (tiny, CPU)",
                  "command": "python benchmarks/bench_recovery.py", "machine": f"{platform.machine()}, "
                  "2 cores", **results}, OUT)


if __name__ == "__main__":
    main()
