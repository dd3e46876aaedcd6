"""The Ray cluster a launch runs on: the one in RAY_ADDRESS (what `ray job submit` sets), or a
private local one started for the run and stopped after it (its own temp dir, dashboard port and
state-API address, so it never mistakes another cluster on the machine for its own)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def connect(cpus_needed: int) -> Iterator[str]:
    """Attach to RAY_ADDRESS (set by `ray job submit`), else start a private local cluster with at
    least `cpus_needed` CPUs and stop it."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        try:
            yield f"cluster at {os.environ['RAY_ADDRESS']}"
        finally:
            ray.shutdown()
        return
    # A local ray.init() would write an auth token that later breaks `ray job submit`; a private
    # temp dir (short: it holds unix sockets) keeps this cluster apart from any other on the machine.
    temp_dir = tempfile.mkdtemp(prefix="ray_maxlite_", dir="/tmp")
    # Ray streams /tmp/tpu_logs to the driver when it exists (any libtpu user on the machine
    # writes there); this CPU cluster has no TPU logs of its own, so point it at an empty dir.
    # A local machine is never drained for preemption; Ray's watcher for it only logs an error here.
    env = {"RAY_AUTH_MODE": "disabled", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
           "TPU_LOG_DIR": os.environ.get("TPU_LOG_DIR") or
           tempfile.mkdtemp(prefix="tpu_logs_", dir=temp_dir)}
    saved = {k: os.environ.get(k) for k in (*env, "RAY_API_SERVER_ADDRESS")}
    os.environ.update(env)
    cpus = max(cpus_needed, os.cpu_count() or 1)
    try:
        # The dashboard serves the state API that Ray Train's placement-group cleaner polls. The
        # free port we pick can be taken by one of Ray's own (random) ports before the dashboard
        # binds it (seen once in CI): pick another.
        for tries_left in (2, 1, 0):
            port = free_port()
            # Ray Train's placement-group cleaner finds the state API by scanning the machine's
            # clusters unless told; with another cluster on the machine it fails with "Found
            # multiple active Ray instances". The cluster's processes inherit the address instead.
            os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
            try:
                with _children_ignore_sigint():
                    ray.init(address="local", num_cpus=cpus, include_dashboard=True, dashboard_port=port,
                             _temp_dir=temp_dir, log_to_driver=True, logging_level="WARNING")
                break
            except ValueError as e:
                ray.shutdown()
                if "already occupied" not in str(e) or not tries_left:
                    raise
        yield f"local Ray cluster ({cpus} CPUs, temp dir {temp_dir})"
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _children_ignore_sigint():
    """The local cluster's processes (GCS, raylet, dashboard, and the workers the raylet starts)
    inherit an ignored SIGINT: a terminal's Ctrl-C reaches the driver's whole process group, and
    the driver alone decides what it means (a stop request the workers read, `_DriverInterrupt`)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
