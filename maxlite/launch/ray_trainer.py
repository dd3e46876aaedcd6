"""Ray Train launcher: one maxlite loop per Ray worker (= host), driven by `JaxTrainer`.

The driver builds ScalingConfig/RunConfig/FailureConfig from the Config, connects to a cluster
(RAY_ADDRESS — which `ray job submit` sets — or a private local one it starts and stops) and runs
`JaxTrainer.fit()`. Each worker runs `_worker_loop`: on CPU it starts jax.distributed itself
(JaxTrainer only does so for TPU/GPU), then calls `maxlite.train.train` and reports metrics to Ray
(at checkpoint steps and the last: `reports_to_ray`).
Each `fit()` is one attempt (Ray's own restarts are off: `FailureConfig(max_failures=0)`); after
it the driver asks maxlite.policy what follows (restart, requeue, fail or done) against the run's
one restart count, kept in the run directory, so neither a requeue nor a new driver resets it; the
new worker group resumes from maxlite's own checkpoints or in-memory snapshots (the source of truth,
not Ray's reported checkpoints). The driver writes status.json from that answer: a worker that died
without a word leaves no status of its own. Ctrl-C on the driver stops the run as it stops a local
one: the workers save at an agreed step, status.json says `stopped`, exit 130 (Ctrl-C again: at
once, no save).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import sys
import time
import uuid
from typing import Any

from maxlite import config as C, outcome, policy
from maxlite.launch.ray_cluster import connect, free_port

RAY_RUN_NAME = "ray_train"  # Ray's own records live in {run_dir}/ray_train/
ELASTIC_NEVER_RESIZE_S = 10.0**9  # Ray's resize check of a healthy group: never
GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train passes it to its controller


# ---------------------------------------------------------------- what the trainer is built from


def num_workers(cfg: C.Config) -> int:
    """Ray workers = hosts (config validation checked the keys: `Config.ray_workers`)."""
    return cfg.ray_workers


def elastic(cfg: C.Config) -> bool:
    """ray_min_workers set below the worker count: Ray Train's elastic group (min, max)."""
    return 0 < cfg.ray_min_workers < num_workers(cfg)


def group_config(cfg: C.Config, workers: int) -> C.Config:
    """The recipe for a group of `workers` hosts (elastic: fewer than configured): the same global
    batch, through gradient accumulation raised by the lost share. The one rule: the check before
    any cluster starts and every worker of a smaller group use it."""
    full = num_workers(cfg)
    if workers == full:
        return cfg
    total = cfg.gradient_accumulation_steps * full  # divisible: config_checks.check_group, for every size
    return dataclasses.replace(cfg, gradient_accumulation_steps=total // workers, ray_num_workers=workers)


def tpu_slices(cfg: C.Config) -> int:
    """Slices the workers span: num_slices, with -1 (read from the devices) meaning one here."""
    return cfg.num_slices if cfg.ray_use_tpu and cfg.num_slices > 0 else 1


def devices_per_worker(cfg: C.Config) -> int:
    if cfg.ray_use_tpu:
        return cfg.tpu_chips_per_host
    if cfg.ray_use_gpu:
        return cfg.ray_gpus_per_worker
    return cfg.ray_simulated_devices_per_worker


def check(cfg: C.Config) -> C.Config:
    """Resolve the recipe against the devices the workers will have: errors before any cluster starts."""
    workers, per_worker = num_workers(cfg), devices_per_worker(cfg)
    platform = "tpu" if cfg.ray_use_tpu else "gpu" if cfg.ray_use_gpu else "cpu"
    sizes = range(cfg.ray_min_workers, workers) if elastic(cfg) else ()
    try:
        for size in sizes:  # every smaller group Ray may start must keep the global batch
            C.resolve(group_config(cfg, size), size * per_worker, tpu_slices(cfg), size, platform)
        return C.resolve(cfg, workers * per_worker, tpu_slices(cfg), workers, platform)
    except C.ConfigError as e:
        raise C.ConfigError(f"{workers} Ray worker(s) × {per_worker} device(s): {e}") from None


def preflight(resolved: C.Config, local_cluster: bool) -> None:
    """What the workers would refuse, checked from the driver before any cluster starts: storage,
    the data (files, tokenizer), and — on a local CPU cluster, whose workers share this host's
    memory — the host-memory fit. Reads only."""
    from maxlite import checkpoints, data

    checkpoints.check_storage(resolved)
    data.check(resolved)
    if local_cluster and not (resolved.ray_use_tpu or resolved.ray_use_gpu):
        from maxlite import optim, state as state_lib
        state_lib.check_fits(resolved, state_lib.abstract_train_state(resolved, optim.make_optimizer(resolved)),
                             share=1.0, on_cpu=True)


def scaling_config(cfg: C.Config):
    from ray.train import ScalingConfig

    workers = num_workers(cfg)
    if cfg.ray_use_tpu:
        return ScalingConfig(num_workers=workers, use_tpu=True, topology=cfg.tpu_topology,
                             accelerator_type=cfg.tpu_accelerator_type,
                             resources_per_worker={"TPU": cfg.tpu_chips_per_host},
                             placement_strategy="SPREAD")
    # elastic: Ray always asks for the full group; a restart that cannot get it within
    # elastic_wait_seconds (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, set by `run`) starts on what is
    # left; a running group is never resized (that would drop the steps since the last save): it
    # grows back at its next restart
    size = dict(num_workers=(cfg.ray_min_workers, workers), elastic_resize_monitor_interval_s=ELASTIC_NEVER_RESIZE_S) \
        if elastic(cfg) else dict(num_workers=workers)
    if cfg.ray_use_gpu:
        return ScalingConfig(**size, use_gpu=True, resources_per_worker={"GPU": cfg.ray_gpus_per_worker},
                             placement_strategy="SPREAD")
    return ScalingConfig(**size, resources_per_worker={"CPU": cfg.ray_cpus_per_worker})


def worker_env(cfg: C.Config) -> dict[str, str]:
    """Env of the worker processes; it reaches them only through RunConfig(worker_runtime_env)."""
    # Ray Train would route print() through its logger too, printing every line twice.
    env = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    if cfg.ray_use_tpu:
        return {**env, "JAX_PLATFORMS": "tpu"}
    if cfg.ray_use_gpu:
        return {**env, "JAX_PLATFORMS": "cuda"}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_worker_xla_flags(cfg.ray_simulated_devices_per_worker)}


def cpu_worker_xla_flags(devices: int) -> str:
    """A CPU worker's XLA_FLAGS: the driver's own, with the simulated device count set to `devices`
    (the runtime env replaces the variable, so a flag the user gave the driver would not reach them)."""
    own = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*own, f"--xla_force_host_platform_device_count={devices}"])


def run_config(cfg: C.Config, attempt: int = 0):
    from ray.train import FailureConfig, LoggingConfig, RunConfig

    # Ray's records go inside the run directory (not ~/ray_results): one place per run; each
    # attempt (after a failure or a preemption) is a new Ray run beside the first.
    name = RAY_RUN_NAME if attempt == 0 else f"{RAY_RUN_NAME}-attempt{attempt}"
    return RunConfig(name=name, storage_path=cfg.run_dir,
                     failure_config=FailureConfig(max_failures=0),  # maxlite.policy decides, per run
                     worker_runtime_env={"env_vars": worker_env(cfg)},
                     logging_config=LoggingConfig(log_level="WARNING"))  # maxlite prints progress


def build_trainer(cfg: C.Config, attempt: int = 0, job: tuple[str, str] = ("", "Ray Train")):
    """The JaxTrainer for this recipe (cfg already passed through `check`); `job`: this driver's
    (job, words), which every worker group it starts hands to the run's lease (maxlite/lease.py)."""
    from ray.train.v2.jax import JaxTrainer

    return JaxTrainer(_worker_loop, train_loop_config={"config": cfg.to_dict(), "job": list(job)},
                      scaling_config=scaling_config(cfg), run_config=run_config(cfg, attempt))


# ---------------------------------------------------------------- on each worker


def _setup_cpu_distributed(rank: int, world: int) -> None:
    """CPU workers: rank 0 picks the coordinator, everyone learns it; before any JAX call."""
    import ray
    from ray.train.collective import broadcast_from_rank_zero

    address = f"{ray.util.get_node_ip_address()}:{free_port()}" if rank == 0 else None
    address = broadcast_from_rank_zero(address)
    os.environ.update(MAXLITE_COORDINATOR=address, MAXLITE_NUM_PROCESSES=str(world),
                      MAXLITE_PROCESS_ID=str(rank))


def _preemption_notice() -> str | None:
    """Ray Train's drain notice for this worker group, or None; read locally, without a barrier.

    Ray Train's PreemptionWatcher (on by default) polls Ray Core for nodes being drained for
    preemption (KubeRay / the autoscaler on a spot or maintenance event, or `ray drain-node`) and
    marks every worker. The public `ray.train.get_preemption_info()` reads the same field but is a
    ~10 ms barrier across workers; maxlite's own cross-host vote already makes every host act at the
    same step, so the local field is read (pinned Ray: see pyproject.toml; tests/test_ray.py drains a
    real node)."""
    info = _ray_preemption_info()
    if info is None:
        return None
    deadline = (f", to be reclaimed at {time.strftime('%H:%M:%S', time.localtime(info.deadline_ms / 1000))}"
                if info.deadline_ms else "")
    nodes = ", ".join(n[:12] for n in info.preempted_node_ids)
    return f"Ray: node {nodes} is being drained for preemption (ranks {info.preempted_ranks}{deadline})"


RAY_PRIVATE_API = "2.60."  # the Ray minor whose private train context `_ray_preemption_info` reads


def _ray_preemption_info():
    """Ray Train's private per-worker preemption field — the one private Ray read in maxlite, checked
    against the Ray version it was written for; on another version it warns once and sees nothing
    (a drain then ends the attempt as a failure, and Ray restarts it)."""
    import ray

    if not ray.__version__.startswith(RAY_PRIVATE_API):
        if not getattr(_ray_preemption_info, "warned", False):
            _ray_preemption_info.warned = True
            print(f"maxlite: warning: Ray {ray.__version__} is not {RAY_PRIVATE_API}x: node-drain notices "
                  f"are not read (pin ray as pyproject.toml does)", flush=True)
        return None
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


def _worker_loop(loop_config: dict[str, Any]) -> dict[str, Any]:
    """Runs on every worker; rank 0's return value (the summary) reaches the driver."""
    import logging

    import ray.train

    from maxlite import train as train_lib

    # Ray Train sets the root logger to INFO on workers, which floods the console with library
    # chatter (Orbax, Ray's own per-report lines); maxlite prints its progress itself.
    logging.getLogger().setLevel(logging.WARNING)
    cfg = C.Config(**loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    facts = {}
    if world != num_workers(cfg):  # an elastic group started on the hosts that were left
        full, cfg = num_workers(cfg), group_config(cfg, world)
        facts["elastic"] = {"workers": world, "of": full, "gradient_accumulation_steps": cfg.gradient_accumulation_steps}
        if rank == 0:
            print(f"maxlite: elastic: training on {world} of {full} Ray workers (a host is gone and none came "
                  f"back within elastic_wait_seconds={cfg.elastic_wait_seconds:g}); gradient_accumulation_steps "
                  f"{cfg.gradient_accumulation_steps} keeps the global batch; the group grows back at its next restart",
                  flush=True)
    from maxlite.launch.cpu_affinity import pin_if_asked
    pin_if_asked(cfg, cfg.ray_cpus_per_worker, f"training worker {rank}")  # before JAX sizes its thread pools
    if world > 1 and not (cfg.ray_use_tpu or cfg.ray_use_gpu):
        _setup_cpu_distributed(rank, world)

    def on_metrics(record: dict[str, Any]) -> None:
        if reports_to_ray(cfg, record["step"]):
            ray.train.report({k: v for k, v in record.items() if isinstance(v, (int, float))})

    # Python signal handlers cannot be installed from this thread (Ray Train runs the loop off the
    # main thread). With 2+ workers JAX's own SIGTERM handler (jax.distributed) catches a SIGTERM
    # to any worker and every host stops at one step with a final save (see resilience); a planned
    # preemption also comes as Ray's drain notice: save at once and train on.
    from maxlite.launch.ray_keeper import RayKeeper

    try:
        summary = train_lib.train(cfg, on_metrics=on_metrics,  # faults (fault_*) fire inside the loop
                                  preemption_notice=_preemption_notice, snapshot_keeper=RayKeeper,
                                  status_fields=facts, stop_request=_stop_request(cfg.run_dir),
                                  job=tuple(loop_config.get("job", ("", "Ray Train"))))
    except BaseException as e:  # noqa: BLE001 — maxlite.outcome says whether a restart can help
        end = outcome.decide(error=e)
        if end.next == outcome.FAIL:  # a wrong recipe, a diverged loss: every worker ends alike
            return end.fields()
        raise  # Ray ends the whole group (a peer may wait in a collective); the driver decides
    return summary  # its `next` (maxlite.outcome) is the driver's to follow (maxlite.policy)


def reports_to_ray(cfg: C.Config, step: int) -> bool:
    """Whether a worker hands this step's metrics to `ray.train.report`: at each checkpoint step and
    the last. A report is a barrier across the workers, and Ray's controller takes one report per
    poll (every 2 s, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), so a report every step held each step to
    2 s. maxlite's own metrics (console, metrics.jsonl, loggers) keep every log_period step."""
    period = cfg.checkpoint_period
    return step == cfg.steps or (period > 0 and step % period == 0)


STOP_REQUEST = "stop_request.json"  # the driver's Ctrl-C, for workers that cannot get the signal
STOP_POLL_SECONDS = 2.0


def request_stop(run_dir: str, why: str) -> None:
    """Ask the run's workers to stop as Ctrl-C stops a local run (they poll for it)."""
    import json

    from maxlite.rundir import write_text

    write_text(f"{run_dir}/{STOP_REQUEST}", json.dumps({"time": time.time(), "why": why}))


def _stop_request(run_dir: str, now=time.time):
    """A worker's poll of the driver's stop request: a request made after this attempt started
    (an earlier run's Ctrl-C is not this one's), read at most every STOP_POLL_SECONDS."""
    import json

    import fsspec

    started, last = now(), [0.0]

    def poll() -> str | None:
        if now() - last[0] < STOP_POLL_SECONDS:
            return None
        last[0] = now()
        try:
            with fsspec.open(f"{run_dir}/{STOP_REQUEST}", "r") as f:
                request = json.load(f)
        except (FileNotFoundError, ValueError):
            return None
        return request.get("why", "stop requested") if request.get("time", 0) >= started else None

    return poll


# ---------------------------------------------------------------- the driver


def _first_cause(error: Exception) -> str:
    """One line for the user: which worker failed and how (the full traceback is in the logs)."""
    failures = getattr(error, "worker_failures", None) or {}
    if failures:
        rank, cause = sorted(failures.items())[0]
        lines = [ln for ln in str(cause).splitlines() if ln.strip()]
        return f"worker rank {rank}: {type(cause).__name__}: {lines[-1] if lines else ''}"[:300]
    cause = getattr(error, "controller_failure", error)
    lines = [ln for ln in str(cause).splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"[:300]


def _killed_for_memory(error: Exception) -> bool:
    """Whether Ray's memory monitor killed a worker of the failed attempt (its OutOfMemoryError).
    A worker that died otherwise is a crash, whatever Ray's text lists among possible causes."""
    import ray.exceptions

    causes = list((getattr(error, "worker_failures", None) or {}).values()) or [getattr(error, "controller_failure", error)]
    seen, stack = set(), causes
    while stack:  # Ray wraps the monitor's error (RayTaskError, ActorDiedError ...): follow the causes
        cause = stack.pop()
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, ray.exceptions.OutOfMemoryError):
            return True
        stack += [getattr(cause, "cause", None), cause.__cause__, cause.__context__]
    return False


def _warn_if_inside_job_copy(cfg: C.Config) -> None:
    """Config paths are absolute (config.resolve_path); under `ray job submit` a relative one lands in
    Ray's temporary copy of the working dir, which goes away with the cluster."""
    path = cfg.base_output_directory
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ and path.startswith(os.getcwd() + os.sep):
        print(f"maxlite: warning: base_output_directory is {path}, inside Ray's copy of the job's "
              f"working dir, which goes away with the cluster; pass an absolute path or gs://...", flush=True)


class _DriverInterrupt:
    """Ctrl-C on the driver while the workers train: the first asks them to stop as a local run
    stops (a save at an agreed step); the second stops everything at once."""

    def __init__(self, cfg: C.Config):
        self.cfg, self.count, self.previous = cfg, 0, None

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            print("maxlite: Ctrl-C again: stopping the workers now, without a save", flush=True)
            raise KeyboardInterrupt
        print("maxlite: Ctrl-C: the workers save at the next step they agree on, then stop "
              "(Ctrl-C again: stop at once, without a save)", flush=True)
        request_stop(self.cfg.run_dir, f"Ctrl-C on the Ray driver (host {socket.gethostname()}, pid {os.getpid()})")

    def __exit__(self, *exc):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        return False


def _fit(trainer):
    """`trainer.fit()` on a thread of its own while this main thread waits, so the driver's Ctrl-C
    is ours (`_DriverInterrupt`): Ray Train registers its own SIGINT handler — an abort without a
    save — only when fit() runs on the main thread."""
    import threading

    box: dict[str, Any] = {}

    def target():
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 — handed to the main thread as it is
            box["error"] = e

    thread = threading.Thread(target=target, name="maxlite-ray-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)  # wakes up for signals
    if "error" in box:
        raise box["error"]
    return box["result"]


def _attempt_status(run_dir: str, started: str) -> dict | None:
    """status.json as this attempt's workers ended it, or None (they died without a word)."""
    from maxlite.rundir import read_status

    status = read_status(run_dir)
    fresh = status is not None and str(status.get("time", "")) >= started and "exit_code" in status
    return status if fresh else None


def _attempt(cfg: C.Config, number: int, job: tuple[str, str]) -> tuple[dict, policy.Decision, str]:
    """One `fit()`: (rank 0's summary, maxlite.policy's answer, the failure's cause in one line)."""
    from ray.train import TrainingFailedError

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        result = _fit(build_trainer(cfg, number, job))
    except TrainingFailedError as e:
        cause = _first_cause(e)
        print(f"maxlite: Ray: attempt {number} failed: {cause}", file=sys.stderr, flush=True)
        decision = policy.after_attempt(cfg.run_dir, cfg.max_restarts, None, _attempt_status(cfg.run_dir, started),
                                        killed_for_memory=_killed_for_memory(e))
        return {}, decision, cause
    summary = dict(result.return_value or {})
    decision = policy.after_attempt(cfg.run_dir, cfg.max_restarts, int(summary.get("exit_code", outcome.FINISHED)),
                                    summary if "next" in summary else None)
    return summary, decision, summary.get("error", "")


def run(cfg: C.Config) -> dict[str, Any]:
    """Train on a Ray cluster; returns rank 0's run summary with maxlite.policy's answer
    (`exit_code` is the job's, as status.json says)."""
    import fsspec

    _warn_if_inside_job_copy(cfg)
    resolved = check(cfg)  # the recipe against the workers' devices, then what they would refuse:
    preflight(resolved, local_cluster=not os.environ.get("RAY_ADDRESS"))  # before any cluster starts
    if elastic(cfg):
        os.environ[GROUP_START_TIMEOUT_ENV] = str(cfg.elastic_wait_seconds)

    fs, path = fsspec.url_to_fs(f"{cfg.run_dir}/{STOP_REQUEST}")
    if fs.exists(path):
        fs.rm(path)  # an earlier run's Ctrl-C
    budget = "unlimited" if cfg.max_restarts < 0 else cfg.max_restarts
    # every worker group this driver starts (restarts, elastic groups) is the same job: a later
    # group takes the run's lease over from the one before at once
    job = (f"ray:{uuid.uuid4().hex}", f"Ray job (driver on {socket.gethostname()}, pid {os.getpid()})")
    with connect(num_workers(cfg) * cfg.ray_cpus_per_worker) as where:
        print(f"maxlite: Ray: {num_workers(cfg)} worker(s) × {devices_per_worker(cfg)} device(s) on "
              f"{where}; run directory {cfg.run_dir}; max_restarts={budget} "
              f"({policy.restarts(cfg.run_dir)} made so far)", flush=True)
        try:
            with _DriverInterrupt(cfg):
                for number in itertools.count():
                    summary, decision, cause = _attempt(cfg, number, job)
                    if decision.action not in (outcome.RESTART, outcome.REQUEUE):
                        break
                    print(f"maxlite: Ray: {decision.note}", flush=True)
        except KeyboardInterrupt as e:  # Ctrl-C twice: the workers are gone without a save
            end = outcome.decide(error=e)
            return policy.after_attempt(cfg.run_dir, cfg.max_restarts, end.code, end.fields()).fields()
    summary.update(decision.fields())
    if decision.action == outcome.FAIL:
        if decision.end.reason == "out_of_memory":
            print(f"maxlite: error: a Ray worker was killed for memory ({cause}); lower per_device_batch_size or "
                  f"check the fit with python -m maxlite.plan; status in {cfg.run_dir}/status.json",
                  file=sys.stderr, flush=True)
        else:
            print(f"maxlite: error: {decision.note}: {cause or decision.end.error}; status in "
                  f"{cfg.run_dir}/status.json", file=sys.stderr, flush=True)
        return summary
    loss = f", final loss {summary['final_loss']:.4f}" if "final_loss" in summary else ""
    attempt = f" (the last attempt ran {summary.get('steps', 0)})" \
        if summary.get("steps", cfg.steps) != cfg.steps else ""
    what = {"finished": "finished", "stopped": "stopped by the user", "preempted": "stopped at its max_time"}.get(
        summary.get("state", "finished"), summary.get("state", "finished"))
    print(f"maxlite: Ray run {what}: {cfg.steps} steps{attempt}{loss}; run directory {cfg.run_dir}", flush=True)
    return summary
