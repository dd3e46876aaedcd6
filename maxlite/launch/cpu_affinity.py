"""Ray CPU runs: each process pinned to as many cores as Ray reserved for it (`ray_cpu_affinity`).

Ray's CPU resources are a count, not a place: two actors that reserved one CPU each on a 2-core
machine both run XLA's thread pools over both cores, and a trainer and a rollout worker that should
overlap take turns instead. Pinned, each process sees only its own cores (XLA sizes its pools by
the process's affinity), like the separate devices of a GPU or TPU placement.

Which cores: the first free ones of this process's own affinity, claimed with a lock file per core
under the machine's temp dir (`flock`: the kernel drops a dead process's claims, so a killed worker
leaves nothing to clean up). Called before JAX starts its CPU client, which fixes its pools then.
"""

from __future__ import annotations

import fcntl
import os
import tempfile

_held: list = []  # this process's claim files, open for as long as it lives


def claims_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "maxlite_cpu_claims")


def pin_if_asked(cfg, num_cpus: float, what: str) -> list[int]:
    """`pin` where the recipe asks (ray_cpu_affinity) and this is a CPU process: a Ray Train CPU
    worker (its env says JAX_PLATFORMS=cpu: ray_trainer.worker_env) or a rollout actor (which gets
    its trainer's). Called by both before JAX starts."""
    if cfg.ray_cpu_affinity and os.environ.get("JAX_PLATFORMS") == "cpu":
        return pin(num_cpus, what)
    return []


def pin(num_cpus: float, what: str, directory: str | None = None) -> list[int]:
    """Pin this process to `num_cpus` (rounded up, at least 1) cores no other pinned process holds;
    returns them. With too few free cores it says so in one line and stays unpinned ([])."""
    want = max(1, int(-(-num_cpus // 1)))
    directory = directory or claims_dir()
    os.makedirs(directory, exist_ok=True)
    claimed = []
    for core in sorted(os.sched_getaffinity(0)):
        handle = open(os.path.join(directory, f"core{core}"), "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        claimed.append((core, handle))
        if len(claimed) == want:
            break
    if len(claimed) < want:
        for _, handle in claimed:
            handle.close()
        print(f"maxlite: ray_cpu_affinity: {what} wanted {want} free core(s), {len(claimed)} left on this "
              "machine: runs unpinned", flush=True)
        return []
    cores = [core for core, _ in claimed]
    os.sched_setaffinity(0, cores)
    _held.extend(handle for _, handle in claimed)
    print(f"maxlite: ray_cpu_affinity: {what} pinned to core(s) {cores}", flush=True)
    return cores
