"""`status` and `cancel` for a launched experiment, from squeue/scontrol and the status files.

There is no `sacct` (it needs an accounting database), so the live state comes from `scontrol`
(which remembers finished jobs for MinJobAge, 300 s by default) and, after that, from the
job's own record (`status.json` in the launch directory, written by sbatch.sh) and the trainer's
`status.json` in the run directory.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import time
from typing import Any

from maxlite.launch import experiment
from maxlite.launch.experiment import LaunchError

_ACTIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SUSPENDED", "RESIZING", "SIGNALING"}


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o ID` as a dict, or None when Slurm no longer knows the job."""
    tool = shutil.which("scontrol")
    if tool is None or not job_id:
        return None
    out = subprocess.run([tool, "show", "job", "-o", str(job_id)], capture_output=True, text=True)
    if out.returncode != 0 or "JobState=" not in out.stdout:
        return None
    fields = {}
    for token in out.stdout.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def _run_state(path: str) -> dict[str, Any] | None:
    return None if "://" in path else experiment.read_json(path)


def collect(exp_dir: pathlib.Path) -> dict[str, Any]:
    """Everything the status block shows, as one dict (also what `status --json` prints)."""
    meta = experiment.read_json(exp_dir / "experiment.json") or {}
    job_id = meta.get("job_id") or ""
    record = experiment.read_json(exp_dir / "status.json") or {}
    run = _run_state(meta.get("run_status", "")) or {}
    slurm = scontrol_job(job_id) if job_id else None
    slurm_state = slurm.get("JobState") if slurm else None
    restarts = int(slurm.get("Restarts", 0)) if slurm else int(record.get("attempt", 0))
    cancelled = (exp_dir / "cancelled").exists() or slurm_state == "CANCELLED" or record.get("state") == "CANCELLED"

    if meta.get("dry_run"):
        status = "NOT SUBMITTED (dry run)"
    elif cancelled:
        status = "CANCELLED"
    elif slurm_state == "PENDING":
        status = "PENDING (requeued)" if restarts else "PENDING"
    elif slurm_state in _ACTIVE:
        status = "RUNNING"
    elif record.get("state") in ("FINISHED", "FAILED", "PREEMPTED"):
        status = record["state"]  # the job's own verdict (it knows whether the run finished)
    elif slurm_state:
        status = slurm_state  # e.g. TIMEOUT, NODE_FAIL, OUT_OF_MEMORY: the job could not record
    else:
        status = "UNKNOWN"
    log = exp_dir / f"log-{meta.get('name', exp_dir.parent.name)}_{job_id}.out"
    return {
        "experiment": exp_dir.name, "task": meta.get("task", exp_dir.parent.name), "status": status,
        "job_id": job_id or None, "slurm_state": slurm_state, "attempts": restarts + 1,
        "partition": meta.get("partition"), "nodes": meta.get("nodes"), "local_directory": str(exp_dir),
        "log": str(log), "run_status_file": meta.get("run_status"), "run_state": run.get("state"),
        "run_step": run.get("step"), "exit_code": record.get("exit_code"),
    }


def block(info: dict[str, Any]) -> str:
    """The NeMo-like status block."""
    run = info["run_status_file"] or "?"
    if info["run_state"]:
        run += f" (state: {info['run_state']}, step {info['run_step']})"
    lines = [
        f"Experiment Status for {info['experiment']}",
        "",
        f"Task 0: {info['task']}",
        f"- Status: {info['status']}",
        f"- Executor: SlurmExecutor on @localhost (partition {info['partition']}, {info['nodes']} node(s))",
        f"- Job id: {info['job_id'] or '-'}",
        f"- Attempts: {info['attempts']}",
        f"- Local Directory: {info['local_directory']}",
        f"- Log: {info['log']}",
        f"- Run status: {run}",
    ]
    return "\n".join(lines)


def cancel(exp_dir: pathlib.Path) -> str:
    """Mark the launch cancelled (so the job never requeues itself) and scancel it."""
    meta = experiment.read_json(exp_dir / "experiment.json") or {}
    job_id = meta.get("job_id")
    if not job_id:
        raise LaunchError(f"{exp_dir.name} was never submitted (dry run?): nothing to cancel")
    tool = shutil.which("scancel")
    if tool is None:
        raise LaunchError("'scancel' not found: run on a Slurm login node")
    slurm = scontrol_job(job_id)
    state = slurm.get("JobState") if slurm else None
    if state not in _ACTIVE | {"PENDING", "REQUEUED"}:
        raise LaunchError(f"job {job_id} is not queued or running ({state or 'unknown to Slurm'}): nothing to cancel")
    marker = exp_dir / "cancelled"
    marker.touch()  # first, so the batch shell sees it when its trainer stops
    out = subprocess.run([tool, str(job_id)], capture_output=True, text=True)
    if out.returncode != 0:
        marker.unlink()
        raise LaunchError(f"scancel {job_id} failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    # the job's own record: its batch shell may be killed before it can write it
    record = experiment.read_json(exp_dir / "status.json") or {"job_id": job_id, "attempt": 0}
    experiment.write_json(exp_dir / "status.json", {**record, "state": "CANCELLED", "exit_code": None,
                                                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return job_id
