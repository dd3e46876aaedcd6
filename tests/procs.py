"""Real `python -m maxlite.train` runs for tests, one process or several (jax.distributed over
gloo on CPU), and what they leave in the run directory (status.json, metrics.jsonl, rollbacks,
fault markers, checkpoints)."""

import glob
import json
import os
import shutil
import subprocess
import sys
import time

from maxlite.resilience.keeper import run_key
from tests.helpers import free_port, wait_until
from tests.xla_flags import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["base.yml", "model_name=tiny", "base_num_decoder_layers=2", "max_target_length=32",
        "per_device_batch_size=1", "enable_tensorboard=false", "write_report=false", "checkpoint_period=0", "log_period=1"]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAXLITE_", "RAY_ADDRESS"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices),
               TF_CPP_MIN_LOG_LEVEL="3", **extra)
    return env


def start(run_dir, name, args, processes=1, devices=4):
    """Start `python -m maxlite.train` on `processes` local processes; returns (procs, log paths)."""
    port = free_port()
    argv = [sys.executable, "-m", "maxlite.train", *TINY,
            f"base_output_directory={run_dir}", f"run_name={name}", *args]
    procs, logs = [], []
    for i in range(processes):
        extra = dict(MAXLITE_COORDINATOR=f"127.0.0.1:{port}", MAXLITE_NUM_PROCESSES=str(processes),
                     MAXLITE_PROCESS_ID=str(i)) if processes > 1 else {}
        log = os.path.join(run_dir, f"{name}.attempt{time.monotonic_ns()}.p{i}.log")
        with open(log, "w") as f:
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=_env(devices // processes if processes > 1 else devices,
                                                                     **extra), stdout=f, stderr=subprocess.STDOUT))
        procs[-1].log = log  # wait_for shows it when the run ends early
        logs.append(log)
    return procs, logs


def finish(procs, logs, timeout=600):
    codes = [p.wait(timeout=timeout) for p in procs]
    return codes, [open(x).read() for x in logs]


def run(run_dir, name, args, **kw):
    return finish(*start(run_dir, name, args, **kw))


def status(run_dir, name):
    try:
        with open(os.path.join(run_dir, name, "status.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def resumed(run_dir, name):
    """(step, source) the run's latest attempt started from: status.json `resumed_from`."""
    record = status(run_dir, name).get("resumed_from") or {}
    return record.get("step"), record.get("source")


def losses(run_dir, name):
    """step → loss of the last attempt that reached it (metrics.jsonl, written by process 0)."""
    out = {}
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                out[r["step"]] = r["loss"]
    return out


def batch_hashes(run_dir, name):
    """step → batch_hash (the step's global batch fingerprint) of the last attempt that reached it."""
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        return {r["step"]: r["batch_hash"] for r in map(json.loads, f) if "batch_hash" in r}


def rollbacks(run_dir, name):
    """The run's rollbacks.jsonl records (maxlite/rollback.py)."""
    with open(os.path.join(run_dir, name, "rollbacks.jsonl")) as f:
        return [json.loads(line) for line in f]


def fired(run_dir, name, fault, step, process=0):
    """Whether an injected fault fired: its once-per-run marker (maxlite/resilience/faults.py)."""
    return os.path.exists(os.path.join(run_dir, name, f".fault_{fault}_{step}_p{process}"))


def steps_logged(run_dir, name):
    try:
        return len(losses(run_dir, name))
    except (OSError, json.JSONDecodeError):
        return 0


def wait_for(cond, proc, timeout=300):
    def tail():  # the run's log (start), in the failure's message
        log = getattr(proc, "log", None)
        return open(log).read()[-4000:] if log and os.path.exists(log) else ""

    def alive():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the condition was met:\n{tail()}"
    wait_until(cond, timeout, poll=0.05, alive=alive, context=tail)


def clear_snapshots(run_dir, name):
    for f in glob.glob(f"/dev/shm/maxlite-snap-{run_key(os.path.join(run_dir, name))}/*"):
        os.remove(f)


def checkpoints_listed(run_dir, name):
    """Steps `python -m maxlite.checkpoints list` reports as complete."""
    out = subprocess.run([sys.executable, "-m", "maxlite.checkpoints", "list", os.path.join(run_dir, name, "checkpoints")],
                         cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _complete_checkpoint(run_dir, name, step):
    ckpts = os.path.join(run_dir, name, "checkpoints")
    return os.path.isdir(os.path.join(ckpts, str(step))) and not [
        n for n in os.listdir(ckpts) if "tmp" in n]


def starve_and_finish(run_dir, processes):
    """A process that keeps computing (starved by a loaded machine, or compiling) for 3× its step
    timeout is not killed: the watchdog sees its work (saying so once: test_resilience_units.py),
    no hang is declared and the run finishes. The last of `processes` starves."""
    codes, texts = run(run_dir, "st", ["steps=10", "fault_type=starve", "fault_step=6", f"fault_process={processes - 1}",
                                        "enable_checkpointing=false", "watchdog_min_timeout=3", "watchdog_factor=2"],
                       processes=processes)
    assert codes == [0] * processes, texts[0][-3000:]
    assert fired(run_dir, "st", "starve", 6, processes - 1)
    assert not glob.glob(os.path.join(run_dir, "st", "hang_p*.log"))  # no watchdog fired
    assert status(run_dir, "st")["state"] == "finished" and status(run_dir, "st")["step"] == 10


def remove_snapshots(run_dir):
    """In-memory snapshots live in /dev/shm, outside the test's tmp dir: remove what the runs in
    `run_dir` left (a failed test's; a finished run clears its own)."""
    for name in os.listdir(run_dir):
        shutil.rmtree(f"/dev/shm/maxlite-snap-{run_key(os.path.join(run_dir, name))}", ignore_errors=True)
