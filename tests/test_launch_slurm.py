"""`python -m maxlite.launch`: the rendered sbatch script, and real jobs on a one-node Slurm.

The `slurm`-marked tests start a real munged + slurmctld + slurmd (tests/slurm_cluster.py) and
train the tiny model through the launcher with the real trainer; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.helpers import wait_until
from tests.slurm_cluster import slurm_cluster  # noqa: F401  (session fixture)
from tests.xla_flags import cpu_xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
# One simulated device and a short sequence: the job's work is the launcher's, not the model's.
TINY = ["base.yml", "model_name=tiny", "max_target_length=64", "per_device_batch_size=1",
        "enable_tensorboard=false", "write_report=false"]
JOB_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1)}


def launch(home: pathlib.Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**(env or {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}),
                **JOB_ENV, "MAXLITE_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "maxlite.launch", *args], capture_output=True, text=True,
                          env=full_env, cwd=ROOT, timeout=120)


def status(home, name, env) -> dict:
    out = launch(home, "status", name, "--json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for(home, name, env, done, timeout: float = 420) -> dict:
    """Poll `status --json` until done(info)."""
    last = {}

    def check():
        last["info"] = info = status(home, name, env)
        return info if done(info) else None
    return wait_until(check, timeout, poll=1, context=lambda: f"{name} stuck at {last.get('info')}\n"
                                                              f"{log_text(last['info']) if last else ''}")


def submit(home, name, env, *args) -> dict:
    out = launch(home, "slurm", *args, "--partition", "debug", "--experiment-name", name, env=env)
    assert out.returncode == 0, out.stderr
    assert f"Experiment Status for {name}_" in out.stdout and "Job id:" in out.stdout
    return status(home, name, env)


def log_text(info) -> str:
    """The job's log so far; a job still pending (first submission or requeued) has none yet."""
    log = pathlib.Path(info["log"])
    return log.read_text() if log.exists() else ""


# ---- the rendered script (no cluster needed) ----

def test_dry_run_writes_the_script_and_submits_nothing(tmp_path):
    out = launch(tmp_path, "slurm", *TINY, "steps=5", "--partition", "debug", "--nodes", "2",
                 "--retries", "3", "--time", "01:00:00", "--experiment-name", "demo", "--dry-run")
    assert out.returncode == 0, out.stderr
    (exp_dir,) = (tmp_path / "experiments" / "demo").iterdir()
    script = (exp_dir / "sbatch.sh").read_text()
    assert out.stdout.startswith(script)
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --signal=B:TERM@60",
                 "#SBATCH --open-mode=append", "#SBATCH --requeue", "#SBATCH --time=01:00:00",
                 f"#SBATCH --output={exp_dir}/log-demo_%j.out", "RETRIES=3"]:
        assert line in script.splitlines(), line
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert f"{sys.executable} -m maxlite.train base.yml model_name=tiny" in srun
    assert "run_name=demo" in srun and f"base_output_directory={exp_dir}/runs" in srun
    assert "max_restarts=3" in srun  # --retries is the recipe's one restart budget
    assert "MAXLITE_COORDINATOR=" in script and "scontrol requeue" in script
    # what follows an attempt is maxlite.policy's answer, asked where the trainer's maxlite is
    assert re.search(rf"^policy\(\) {{ {re.escape(sys.executable)} -m maxlite\.policy \"\$@\"; }}$", script, re.M)
    assert f"RUN_DIR={exp_dir}/runs/demo" in script.splitlines()
    assert subprocess.run(["bash", "-n", str(exp_dir / "sbatch.sh")]).returncode == 0
    meta = json.loads((exp_dir / "experiment.json").read_text())
    assert meta["job_id"] is None and meta["run_status"] == f"{exp_dir}/runs/demo/status.json"
    info = status(tmp_path, "demo", None)
    assert info["status"] == "NOT SUBMITTED (dry run)" and info["local_directory"] == str(exp_dir)


def test_container_and_gpu_options_render(tmp_path):
    out = launch(tmp_path, "slurm", "base.yml", "model_name=llama3-8b", "base_output_directory=/lustre/runs",
                 "run_name=r1", "--partition", "a3u", "--nodes", "4", "--gpus-per-node", "8",
                 "--image", "/lustre/maxlite-gpu.sqsh", "--mount", "/lustre/data", "--env", "NCCL_DEBUG=WARN",
                 "--experiment-name", "gpu", "--dry-run")
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --nodes=4" in script
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert "--container-image=/lustre/maxlite-gpu.sqsh" in srun and "/lustre/data:/lustre/data" in srun
    assert " python -m maxlite.train base.yml model_name=llama3-8b base_output_directory=/lustre/runs run_name=r1" in srun
    # maxlite.policy runs in the image (one task), with the run directory the trainer writes
    policy = next(ln for ln in script.splitlines() if ln.startswith("policy() {"))
    assert "srun --ntasks=1 --nodes=1 --container-image=/lustre/maxlite-gpu.sqsh" in policy
    assert policy.endswith(' python -m maxlite.policy "$@"; }') and "RUN_DIR=/lustre/runs/r1" in script.splitlines()
    assert "export NCCL_DEBUG=WARN" in script
    assert "PYTHONPATH" not in script  # the image brings its own maxlite


@pytest.mark.parametrize("args, message", [
    (["base.yml", "model_nme=tiny"], "unknown config key 'model_nme' in command line (did you mean 'model_name'?)"),
    (["base.yml", "--experiment-name", "bad/name"], "experiment name 'bad/name'"),
    (["base.yml", "--env", "A B=1"], "--env A B=1: write KEY=VALUE"),
])
def test_user_errors_are_one_line(tmp_path, args, message):
    if "--experiment-name" not in args:
        args = [*args, "--experiment-name", "e"]
    out = launch(tmp_path, "slurm", *args, "--partition", "debug", "--dry-run")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("maxlite: error: ") and message in out.stderr
    assert not (tmp_path / "experiments" / "e").exists()


def test_status_of_an_unknown_experiment_is_one_line(tmp_path):
    out = launch(tmp_path, "status", "nosuch")
    assert out.returncode == 2
    assert out.stderr == f"maxlite: error: no experiment named 'nosuch'; no experiments under {tmp_path}/experiments\n"


# ---- real jobs on a real one-node Slurm ----

@pytest.fixture
def cluster_env(slurm_cluster):  # noqa: F811
    return slurm_cluster.env


@pytest.mark.slurm
def test_invalid_partition_names_the_real_ones(tmp_path, cluster_env):
    out = launch(tmp_path, "slurm", *TINY, "--partition", "nosuch", "--experiment-name", "bad", env=cluster_env)
    assert out.returncode == 2
    assert out.stderr == ("maxlite: error: invalid partition 'nosuch': sinfo reports debug (default); "
                          "pick one with --partition\n")
    assert not (tmp_path / "experiments" / "bad").exists()


@pytest.mark.slurm
def test_sbatch_rejection_is_one_line_and_leaves_nothing(tmp_path, cluster_env):
    out = launch(tmp_path, "slurm", *TINY, "--partition", "debug", "--time", "soon", "--experiment-name", "t",
                 env=cluster_env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("maxlite: error: sbatch failed: sbatch: error: Invalid --time specification")
    assert list((tmp_path / "experiments" / "t").iterdir()) == []


@pytest.mark.slurm
def test_trains_tiny_to_completion_and_reports_finished(tmp_path, cluster_env):
    # Two tasks on the one node: two JAX processes joined by jax.distributed from the Slurm env.
    tasks = 2 if os.cpu_count() >= 2 else 1
    submit(tmp_path, "fin", cluster_env, *TINY, "steps=3", "--nodes", "1", "--ntasks-per-node", str(tasks))
    info = wait_for(tmp_path, "fin", cluster_env, lambda i: i["status"] not in ("PENDING", "RUNNING"))
    log = log_text(info)
    assert info["status"] == "FINISHED", log
    assert info["run_state"] == "finished" and info["run_step"] == 3 and info["attempts"] == 1
    assert f"{tasks} process(es)" in log and "completed step: 3" in log and "run finished" in log
    exp_dir = tmp_path / "experiments" / "fin" / info["experiment"]
    assert pathlib.Path(info["run_status_file"]) == exp_dir / "runs" / "fin" / "status.json"
    out = launch(tmp_path, "status", "fin", env=cluster_env)
    assert out.stdout.splitlines()[:4] == [f"Experiment Status for {info['experiment']}", "", "Task 0: fin",
                                           "- Status: FINISHED"]


def _trainer_pids(marker: str) -> list[int]:
    """Our job's trainer processes: this interpreter running maxlite.train for MARKER's run."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0] == sys.executable.encode() and b"maxlite.train" in argv and any(marker.encode() in a for a in argv):
            pids.append(int(proc.name))
    return pids


@pytest.mark.slurm
def test_crashed_attempt_is_requeued_and_finishes(tmp_path, cluster_env):
    # the first attempt stalls at step 1 (a pause that fires once per run): killed there, surely alive
    info = submit(tmp_path, "crash", cluster_env, *TINY, "steps=4", "fault_type=pause", "fault_step=1",
                  "fault_pause_seconds=600", "--retries", "1")
    info = wait_for(tmp_path, "crash", cluster_env,
                    lambda i: "fault injection: pause" in log_text(i) or i["status"] not in ("PENDING", "RUNNING"))
    assert info["run_state"] == "running", log_text(info)
    pids = _trainer_pids(info["local_directory"])
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)  # a hard crash (OOM kill, node fault) in the first attempt
    info = wait_for(tmp_path, "crash", cluster_env,
                    lambda i: i["attempts"] == 2 and i["status"] not in ("PENDING", "RUNNING", "PENDING (requeued)"))
    log = log_text(info)
    assert info["status"] == "FINISHED" and info["run_state"] == "finished", log
    # one log holds both attempts (--open-mode=append)
    assert "attempt 0 (max_restarts=1)" in log and "attempt 1 (max_restarts=1)" in log
    run = json.loads(pathlib.Path(info["run_status_file"]).read_text())
    assert run["restarts"] == 1 and run["next"] == "done"  # the one restart, counted in the run directory
    lease = run["lease"]  # handed on by the requeue
    assert lease["launcher"].endswith("attempt 1") and lease["took_over"]["launcher"].endswith("attempt 0")


@pytest.mark.slurm
def test_requeues_stop_after_the_retries(tmp_path, cluster_env):
    # A backend that does not exist fails every attempt at start-up (not a config error: exit 1).
    submit(tmp_path, "broken", cluster_env, *TINY, "steps=3", "--retries", "1", "--env", "JAX_PLATFORMS=nosuch")
    info = wait_for(tmp_path, "broken", cluster_env, lambda i: i["status"] == "FAILED")
    log = log_text(info)
    assert info["attempts"] == 2 and info["exit_code"] not in (0, 2), log
    run = json.loads(pathlib.Path(info["run_status_file"]).read_text())  # written by maxlite.policy: no trainer did
    assert (run["state"], run["next"], run["restarts"], run["exit_code"]) == ("failed", "fail", 1, info["exit_code"])


@pytest.mark.slurm
def test_config_error_in_the_job_is_not_requeued(tmp_path, cluster_env):
    # Passes the launcher's check but not the trainer's: 3-way tensor parallelism on 1 device.
    submit(tmp_path, "cfg", cluster_env, *TINY, "ici_tensor_parallelism=3", "--retries", "2")
    info = wait_for(tmp_path, "cfg", cluster_env, lambda i: i["status"] not in ("PENDING", "RUNNING"))
    log = log_text(info)
    assert info["status"] == "FAILED" and info["exit_code"] == 2 and info["attempts"] == 1, log
    assert "maxlite: error: ici" in log and "run failed (configuration error, exit 2): not retried" in log
    assert not pathlib.Path(info["run_status_file"]).parent.exists()  # refused before the run directory


@pytest.mark.slurm
def test_cancel_stops_the_job_without_requeue(tmp_path, cluster_env):
    submit(tmp_path, "stop", cluster_env, *TINY, "steps=100000", "--retries", "2")
    wait_for(tmp_path, "stop", cluster_env, lambda i: i["status"] == "RUNNING")
    out = launch(tmp_path, "cancel", "stop", env=cluster_env)
    assert out.returncode == 0 and out.stdout.startswith("cancelled job "), out.stderr
    info = wait_for(tmp_path, "stop", cluster_env, lambda i: i["slurm_state"] not in ("RUNNING", "COMPLETING"))
    # the job's own record says it (written by `cancel`: the batch shell may die before it can)
    assert info["status"] == "CANCELLED" and info["slurm_state"] == "CANCELLED" and info["attempts"] == 1
    assert json.loads((pathlib.Path(info["local_directory"]) / "status.json").read_text())["state"] == "CANCELLED"
    again = launch(tmp_path, "cancel", "stop", env=cluster_env)
    assert again.returncode == 2 and "nothing to cancel" in again.stderr


@pytest.mark.slurm
def test_sigterm_arrives_before_the_time_limit(tmp_path, cluster_env):
    # A 1-minute limit with 50 s of warning: SIGTERM comes ~10-40 s in, long before the kill.
    # --retries 0: a run that saved on SIGTERM is requeued anyway; preemptions are not failures
    # (maxlite.outcome: the trainer's `next` in status.json says "requeue").
    submit(tmp_path, "limit", cluster_env, *TINY, "steps=100000", "--time", "1", "--term-grace", "50")
    info = wait_for(tmp_path, "limit", cluster_env,
                    lambda i: "run preempted and saved: requeueing" in log_text(i) or i["status"] == "FAILED")
    log = log_text(info)
    assert "SIGTERM (time limit or preemption): forwarding it to the trainer" in log, log
    assert "trainer exited with 0; run state: preempted; next: requeue" in log, log  # outlived its trainer
    assert launch(tmp_path, "cancel", "limit", env=cluster_env).returncode in (0, 2)  # it would go on


def test_the_batch_script_sees_a_step_killed_for_memory(tmp_path):
    """The batch script's OOM evidence (maxlite.hostmem.job_oom_kills, which `python -m maxlite.policy`
    reads before and after each attempt), run for real: a job cgroup (Slurm's layout: job_7/step_batch
    beside job_7/step_0, under a 200 MiB limit) whose step the kernel kills for memory is counted, which
    makes the job end OUT_OF_MEMORY instead of being requeued. A process outside a job cgroup counts
    nothing. Skipped where no memory cgroup can be made."""
    from tests.helpers import memory_cgroup

    limited = memory_cgroup(200 * 2**20)
    if limited is None:
        pytest.skip("cannot make a memory-limited cgroup here (no writable memory controller under /sys/fs/cgroup)")
    job, made = f"{limited}/job_7", []
    count = f"{sys.executable} -c 'from maxlite.hostmem import job_oom_kills; print(job_oom_kills())'"
    try:
        for d in (job, f"{job}/step_batch", f"{job}/step_0"):
            os.mkdir(d)
            made.append(d)
        test = (f"outside=$({count})\necho $$ > {job}/step_batch/cgroup.procs\nbefore=$({count})\n"
                f"(echo $BASHPID > {job}/step_0/cgroup.procs && exec {sys.executable} -c 'x = bytearray(600 << 20); x[::4096] = b\"1\" * len(x[::4096])')\n"
                f"echo \"rc=$? outside=$outside before=$before after=$({count})\"")
        done = subprocess.run(["bash", "-c", test], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    finally:
        for d in reversed(made):
            os.rmdir(d)
        os.rmdir(limited)
    rc, outside, before, after = (int(x.split("=")[1]) for x in done.stdout.split())
    assert rc == 137 and after == before + 1 and outside == 0, done.stdout + done.stderr
