"""Profiles of a run, under `{run_dir}/profile`: jax.profiler traces (`profiler: xplane`) and the
device-memory profile of a step that ran out of memory.

Traces are in the layout TensorBoard's profile plugin and xprof read:
`{run_dir}/profile/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/<host>.xplane.pb`, one session directory
per trace, so `tensorboard --logdir {run_dir}` (or `xprof --logdir {run_dir}`) lists them as the run
`profile/<session>` beside the scalars. A `gs://` run directory gets the same files: the trace is
written locally (jax.profiler writes through its own file layer) and copied up when it stops.
Memory profiles are pprof files (`pprof -http=: FILE`): `memory_oom_p<process>.prof`.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import fsspec

TRACE_GLOB = "profile/plugins/profile/*/*.xplane.pb"  # under a run directory


def _is_remote(path: str) -> bool:
    return "://" in path


class Trace:
    """One jax.profiler trace into `{run_dir}/profile`."""

    def __init__(self, run_dir: str):
        self.dest = f"{run_dir}/profile"
        self.local = tempfile.mkdtemp(prefix="maxlite-trace-") if _is_remote(run_dir) else self.dest

    def start(self) -> None:
        import jax

        jax.profiler.start_trace(self.local)

    def stop(self) -> str:
        """Stop, write (and copy up); returns the session directory written."""
        import jax

        jax.profiler.stop_trace()
        sessions = sorted(os.listdir(f"{self.local}/plugins/profile"))
        session = f"plugins/profile/{sessions[-1]}"  # the newest: this trace's
        if self.local != self.dest:
            fs, _, _ = fsspec.get_fs_token_paths(self.dest)
            fs.put(f"{self.local}/{session}/", f"{self.dest}/{session}/", recursive=True)
            shutil.rmtree(self.local, ignore_errors=True)
        return f"{self.dest}/{session}"


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA's: a device allocation (at compile or run time) that did not fit."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def save_memory_profile(run_dir: str, name: str) -> str:
    """The device memory in use now (live buffers, by allocation site), as pprof `name` under
    `{run_dir}/profile`; returns its path."""
    import jax

    dest = f"{run_dir}/profile/{name}"
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.save_device_memory_profile(f"{tmp}/{name}")
        fs, _, _ = fsspec.get_fs_token_paths(dest)
        fs.makedirs(f"{run_dir}/profile", exist_ok=True)
        fs.put(f"{tmp}/{name}", dest)
    return dest


def files(run_dir: str) -> dict[str, list[str]]:
    """The profiles a run directory holds: {"traces": [...xplane.pb], "memory": [...prof]}."""
    fs, _, _ = fsspec.get_fs_token_paths(run_dir)
    prefix = run_dir.split("://", 1)[0] + "://" if _is_remote(run_dir) else ""

    def found(pattern: str) -> list[str]:
        return sorted(p if "://" in p or not prefix else prefix + p for p in fs.glob(f"{run_dir}/{pattern}"))
    return {"traces": found(TRACE_GLOB), "memory": found("profile/memory_*.prof")}
