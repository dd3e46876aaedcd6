"""Render, check and submit the sbatch script that runs one maxlite recipe on a Slurm cluster.

One task per node (`srun --ntasks-per-node`), each running `python -m maxlite.train RECIPE k=v`;
`maxlite.mesh` initialises jax.distributed from the Slurm environment and MAXLITE_COORDINATOR.
The batch shell asks for SIGTERM 60 s before the time limit (`--signal=B:TERM@60` reaches only the
batch shell, so it forwards the signal to the step), then follows maxlite.policy's answer
(`python -m maxlite.policy end ...`: done | requeue | restart | fail, against the run's one restart
count in its run directory; it also writes status.json from the answer): the shell only runs the
trainer, requeues and records; it decides nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from maxlite import config as C
from maxlite.launch import experiment
from maxlite.launch.experiment import LaunchError

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """What the user asked for on the command line."""

    recipe_args: tuple[str, ...]           # RECIPE key=value ... as passed to maxlite.train
    name: str
    partition: str
    nodes: int = 1
    gpus_per_node: int = 0
    ntasks_per_node: int = 1               # 1: a process drives all GPUs of its node; G: one per GPU
    image: str = ""                        # pyxis/enroot image (docker://..., or a .sqsh file)
    mounts: tuple[str, ...] = ()           # extra container mounts SRC[:DST]
    time: str = ""                         # Slurm time limit (e.g. 04:00:00); "" = partition default
    retries: int | None = None             # --retries: the recipe's max_restarts, said on the command line
    term_grace: int = 60                   # seconds of warning before the time limit
    env: tuple[str, ...] = ()              # KEY=VALUE exported in the job
    entrypoint: str = "maxlite.train"      # the module each task runs with `python -m`
    workdir: str = ""                      # job working directory; "" = where you launched


def _cli_keys(recipe_args: tuple[str, ...]) -> dict[str, str]:
    return {a.split("=", 1)[0].strip().lstrip("-"): a.split("=", 1)[1] for a in recipe_args if "=" in a}


def trainer_args(job: SlurmJob, exp_dir: pathlib.Path) -> tuple[tuple[str, ...], str, str]:
    """The trainer's arguments plus (base_output_directory, run_name) the run will use.

    run_name is pinned (to NAME unless given) so every requeued attempt resumes the same run;
    base_output_directory defaults to the launch directory's runs/ unless the recipe or the
    command line chose one.
    """
    if not job.recipe_args or "=" in job.recipe_args[0]:
        raise LaunchError("give a recipe first, e.g. `python -m maxlite.launch slurm base.yml model_name=tiny ...`")
    cli = _cli_keys(job.recipe_args)
    args = list(job.recipe_args)
    run_name = cli.get("run_name") or job.name
    if "run_name" not in cli:
        args.append(f"run_name={run_name}")
    if job.retries is not None:  # one restart budget: the flag is the recipe's key
        args.append(f"max_restarts={job.retries}")
    # Validate here (no JAX) so a typo fails now, not in the queue; with --image the recipe is
    # read by the image's maxlite, which may differ from this one.
    recipe = None if job.image else C.load(args)
    base = cli.get("base_output_directory")
    if base is None and recipe is not None and recipe.base_output_directory != C.load([]).base_output_directory:
        base = recipe.base_output_directory  # the recipe YAML chose one
    if base is None:
        base = str(exp_dir / "runs")
        args.append(f"base_output_directory={base}")
    return tuple(args), base, run_name


def restart_budget(job: SlurmJob) -> int:
    """The recipe's `max_restarts` (THE restart budget, maxlite.outcome), which the batch script
    counts failures against (-1: unlimited)."""
    args, _, _ = trainer_args(job, pathlib.Path("/exp"))
    cli = _cli_keys(tuple(args))
    if "max_restarts" in cli:
        return int(cli["max_restarts"])
    try:  # with --image the recipe is the image's to read; its YAML may know keys this one does not
        return C.load(args).max_restarts
    except C.ConfigError:
        return C.load([]).max_restarts


def run_status_path(job: SlurmJob, exp_dir: pathlib.Path) -> str:
    """Where the trainer writes its status.json for this launch."""
    _, base, run_name = trainer_args(job, exp_dir)
    return _run_status_path(base, run_name, job.workdir or os.getcwd())


def _run_status_path(base: str, run_name: str, workdir: str) -> str:
    if "://" in base:
        return f"{base.rstrip('/')}/{run_name}/status.json"
    return str((pathlib.Path(workdir) / base / run_name / "status.json").absolute())


def render(job: SlurmJob, exp_dir: pathlib.Path, python: str = sys.executable) -> str:
    """The complete sbatch script for JOB writing into EXP_DIR."""
    workdir = job.workdir or os.getcwd()
    args, base, run_name = trainer_args(job, exp_dir)
    q = shlex.quote
    log = exp_dir / f"log-{job.name}_%j.out"
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --partition={job.partition}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={job.ntasks_per_node}",
    ]
    if job.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.time:
        head.append(f"#SBATCH --time={job.time}")
    head += [
        f"#SBATCH --output={log}",
        "#SBATCH --open-mode=append",        # a requeued attempt appends to the same log
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:TERM@{job.term_grace}",  # B: the batch shell; it forwards to the step
        f"#SBATCH --chdir={workdir}",
    ]
    srun = ["srun", f"--ntasks-per-node={job.ntasks_per_node}", "--kill-on-bad-exit=1"]
    if job.gpus_per_node and job.ntasks_per_node > 1:
        srun.append(f"--gpus-per-task={max(1, job.gpus_per_node // job.ntasks_per_node)}")
    exports, container = [], []
    if job.image:
        mounts = [f"{exp_dir}:{exp_dir}", f"{workdir}:{workdir}"]
        if "://" not in base:
            mounts.append(f"{pathlib.Path(workdir, base).absolute()}:{pathlib.Path(workdir, base).absolute()}")
        mounts += [m if ":" in m else f"{m}:{m}" for m in job.mounts]
        container = [f"--container-image={job.image}", f"--container-mounts={','.join(dict.fromkeys(mounts))}",
                     f"--container-workdir={workdir}"]
        python = "python"
    else:
        # The job runs this checkout with this interpreter, installed or not.
        exports.append(f'export PYTHONPATH={q(str(PROJECT_ROOT))}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    exports += [f"export {k}={q(v)}" for k, v in (e.split("=", 1) for e in job.env)]
    command = " ".join(q(a) for a in [*srun, *container, python, "-m", job.entrypoint, *args])
    # maxlite.policy runs where maxlite is: this interpreter, or one task in the image
    policy = " ".join(q(a) for a in [*(["srun", "--ntasks=1", "--nodes=1", *container] if container else []),
                                     python, "-m", "maxlite.policy"])
    run_dir = _run_status_path(base, run_name, workdir).rsplit("/", 1)[0]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(head) + "\n" + _BODY.format(
        generated=now, exp_dir=q(str(exp_dir)), run_dir=q(run_dir), retries=restart_budget(job),
        exports="\n".join(exports), command=command, policy=policy)


# The batch shell: it runs the trainer, forwards signals, requeues and records; what follows an
# attempt is maxlite.policy's answer (run in Python, where maxlite is).
_BODY = r"""# Written by `python -m maxlite.launch slurm` at {generated}; relaunch rather than edit.
set -uo pipefail
EXP_DIR={exp_dir}
RUN_DIR={run_dir}
# the recipe's max_restarts (maxlite.policy's one restart budget, counted in the run directory; -1: unlimited)
RETRIES={retries}
ATTEMPT=${{SLURM_RESTART_COUNT:-0}}
{exports}
# jax.distributed coordinator: the first node of the allocation, a port derived from the job id.
MAXLITE_COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):$((20000 + SLURM_JOB_ID % 20000))"
export MAXLITE_COORDINATOR MAXLITE_EXPERIMENT_DIR="$EXP_DIR"

note() {{ echo "[maxlite.launch $(date -u +%H:%M:%S)] $*"; }}
record() {{  # state exit_code: the job's own record, read by `python -m maxlite.launch status`
  printf '{{"job_id": "%s", "state": "%s", "attempt": %d, "exit_code": %s, "nodes": "%s", "time": "%s"}}\n' \
    "$SLURM_JOB_ID" "$1" "$ATTEMPT" "$2" "$SLURM_JOB_NODELIST" "$(date -u +%FT%TZ)" > "$EXP_DIR/status.json.tmp"
  mv -f "$EXP_DIR/status.json.tmp" "$EXP_DIR/status.json"
}}
policy() {{ {policy} "$@"; }}

got_term=0 interrupted=0
on_term() {{
  got_term=1 interrupted=1
  if [ -e "$EXP_DIR/cancelled" ]; then note "cancel requested: the trainer stops with the job"; return; fi
  note "SIGTERM (time limit or preemption): forwarding it to the trainer so it can save"
  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null  # signals the srun step's tasks, not this shell
}}
on_int() {{  # `scancel --batch --signal=INT`: the user's stop, as Ctrl-C on a local run
  interrupted=1
  note "SIGINT: forwarding it to the trainer (a save, then a stop that is not requeued)"
  scancel --signal=INT "$SLURM_JOB_ID" 2>/dev/null
}}
trap on_term TERM
trap on_int INT

note "attempt $ATTEMPT (max_restarts=$RETRIES) of job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; coordinator $MAXLITE_COORDINATOR"
record RUNNING null
policy begin "$EXP_DIR"  # the job cgroup's out-of-memory count before the attempt
{command} &
pid=$!
rc=1
while :; do  # `wait` returns early when the trap runs; wait again for the real exit code
  interrupted=0; wait "$pid"; s=$?; [ "$s" -ne 127 ] && rc=$s
  [ "$interrupted" = 1 ] || break
done
slurm_state=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null)
if [ -e "$EXP_DIR/cancelled" ] || {{ [ -n "$slurm_state" ] && [ "$slurm_state" != RUNNING ]; }}; then
  note "job cancelled: not requeueing"; record CANCELLED "$rc"; exit "$rc"
fi
# maxlite.policy: what follows (it counts a restart and writes status.json from its answer)
read -r next code reason state < <(policy end "$EXP_DIR" "$RUN_DIR" "$RETRIES" "$rc")
note "trainer exited with $rc; run state: ${{state:-unknown}}; next: ${{next:-unknown}}; job state: ${{slurm_state:-unknown}}"
requeue() {{
  trap - TERM  # the requeue kills this shell: let it die here, not run on
  scontrol requeue "$SLURM_JOB_ID" && exec sleep 300
  note "scontrol requeue failed"; record FAILED "$rc"; exit 1
}}
case "$next" in
  done) record FINISHED "$code"; exit 0 ;;
  requeue|restart) record REQUEUED "$rc"; requeue ;;
  fail)
    if [ "$reason" = out_of_memory ]; then record OUT_OF_MEMORY "$code"; else record FAILED "$code"; fi
    exit "$code" ;;
  *) note "maxlite.policy gave no answer (see above)"; record FAILED "$rc"; [ "$rc" -eq 0 ] && exit 1; exit "$rc" ;;
esac
"""


def _slurm_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"'{name}' not found: run on a Slurm login node (or pass --dry-run to only write the script)")
    return path


def partitions() -> list[str]:
    """Partition names as `sinfo` reports them (the default one first)."""
    out = subprocess.run([_slurm_tool("sinfo"), "-h", "-o", "%P"], capture_output=True, text=True)
    if out.returncode != 0:
        raise LaunchError(f"sinfo failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    names = [p for p in dict.fromkeys(out.stdout.split()) if p]
    return sorted(names, key=lambda p: not p.endswith("*"))


def check_partition(partition: str, required: bool = True) -> None:
    """LaunchError unless sinfo lists PARTITION; with required=False, skip when Slurm is unreachable."""
    try:
        known = partitions()
    except LaunchError:
        if required:
            raise
        return
    if partition not in {p.rstrip("*") for p in known}:
        shown = ", ".join(p[:-1] + " (default)" if p.endswith("*") else p for p in known) or "none"
        raise LaunchError(f"invalid partition '{partition}': sinfo reports {shown}; pick one with --partition")


def submit(script: pathlib.Path) -> str:
    """sbatch the script; the job id, or sbatch's own error line."""
    out = subprocess.run([_slurm_tool("sbatch"), "--parsable", str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
        raise LaunchError(f"sbatch failed: {lines[0] if lines else 'no output'}")
    return out.stdout.strip().split(";")[0]


def launch(job: SlurmJob, dry_run: bool = False) -> pathlib.Path:
    """Create the launch directory, write sbatch.sh and experiment.json, submit unless dry_run."""
    experiment.check_name(job.name)
    if job.nodes < 1 or job.ntasks_per_node < 1 or job.gpus_per_node < 0:
        raise LaunchError("--nodes and --ntasks-per-node must be >= 1, --gpus-per-node >= 0")
    bad_env = [e for e in job.env if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", e)]
    if bad_env:
        raise LaunchError(f"--env {bad_env[0]}: write KEY=VALUE")
    args, _, _ = trainer_args(job, pathlib.Path("/exp"))  # config errors first, before anything is written or queued
    if not job.image:  # the data and tokenizer as the job will read them (an image has its own paths)
        from maxlite import data
        data.check(C.load(args))
    check_partition(job.partition, required=not dry_run)  # a dry run also works off-cluster
    exp_dir = experiment.create(job.name)
    script_text = render(job, exp_dir)
    script = exp_dir / "sbatch.sh"
    script.write_text(script_text)
    script.chmod(0o755)
    meta = {
        "name": job.name, "task": job.name, "executor": "SlurmExecutor", "partition": job.partition,
        "nodes": job.nodes, "gpus_per_node": job.gpus_per_node, "image": job.image,
        "max_restarts": restart_budget(job),
        "command": ["python", "-m", "maxlite.launch", *sys.argv[1:]], "recipe_args": list(job.recipe_args),
        "script": str(script), "run_status": run_status_path(job, exp_dir), "job_id": None, "dry_run": dry_run,
        "submitted": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if not dry_run:
        try:
            meta["job_id"] = submit(script)
        except LaunchError:
            shutil.rmtree(exp_dir)  # nothing was queued: leave nothing behind
            raise
    experiment.write_json(exp_dir / "experiment.json", meta)
    return exp_dir
