"""A private, real Ray head node for tests: `ray start --head --block` and `ray job submit`.

Only this cluster's processes are stopped (by pid: everything in the session `ray start` leads),
never `ray stop`, which would stop every Ray cluster on the machine. Every port is picked free
and the temp dir is private, so it can run beside other clusters.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from tests.helpers import free_ports
from tests.xla_flags import CHEAP_COMPILE, CHEAP_TRACE_ENV

REPO = pathlib.Path(__file__).resolve().parents[1]
VENV_BIN = pathlib.Path(sys.executable).parent


# Ray's own polls, shortened for clusters on this machine (their processes inherit them from `ray
# start`, or from the driver that starts one): Ray Train's controller takes a worker's report, and
# sees a dead worker, at its health check (every 2 s by default; a report blocks the workers until
# then: benchmarks/bench_ray_steps.py, and each run here reports 3 times), and reads drain notices
# every 5 s. And a Ray start prestarts one idle worker per CPU for the first driver, which a job
# with a working dir (every `ray job submit` here) cannot use.
FAST_POLLS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
              "RAY_prestart_worker_first_driver": "0"}


def ray_env(**extra: str) -> dict[str, str]:
    """Env for Ray commands: no auth token (GOTCHAS), `python` = this venv's python, the tests'
    cheaper compile and locations (tests/xla_flags.py), which the launcher passes on to its CPU workers, and
    FAST_POLLS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "JAX_", "XLA_"))}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", XLA_FLAGS=CHEAP_COMPILE,
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", **CHEAP_TRACE_ENV, **FAST_POLLS, **extra)
    return env


def _session_pids(sid: int) -> list[int]:
    """The session's live processes: a zombie (exited, its parent has not reaped it: our own Popen child
    until waited, or an orphan where PID 1 does not reap) keeps its session but needs no stopping, and
    counting it made every stop wait out its whole grace period."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid and _state(entry) != "Z":
                pids.append(int(entry.name))
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def _state(proc: pathlib.Path) -> str:
    """A process's state letter from /proc/PID/stat (after its name, which may hold spaces)."""
    try:
        return proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"  # gone meanwhile


def stop_session(sid: int, grace_s: float = 20.0) -> None:
    """SIGTERM every process of that session (ours), then SIGKILL what is left after grace_s."""
    _signal_session(sid, ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)))


def kill_session(sid: int) -> None:
    """SIGKILL every process of that session at once: a machine that is gone. No SIGTERM first, which
    a trainer answers with a final save (a race with the kill that would decide where it resumes)."""
    _signal_session(sid, ((signal.SIGKILL, 5.0),))


def _signal_session(sid: int, steps) -> None:
    for sig, wait in steps:
        for pid in _session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not _session_pids(sid):
            return


def _ports(*flags: str) -> list[str]:
    return [f"{flag}={port}" for flag, port in zip(flags, free_ports(len(flags), ''))]


_NODE_PORTS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
               "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")


class RayHead:
    """`with RayHead(num_cpus=4) as head:` → head.dashboard_url, head.submit(args); more nodes on
    this machine with head.add_node(name, num_cpus) (a real raylet each: drains, node failures)."""

    def __init__(self, num_cpus: int = 4):
        self.num_cpus = num_cpus
        self.nodes: dict[str, subprocess.Popen] = {}
        self._node_logs: list = []
        self.temp_dir = tempfile.mkdtemp(prefix="ray_mlt_", dir="/tmp")  # short: holds unix sockets
        # every port the head is given, different from each other (tests.helpers.free_ports)
        self.dashboard_port, self.gcs_port, *self._head_ports = free_ports(3 + len(_NODE_PORTS), '')
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "RayHead":
        flags = ("--ray-client-server-port", *_NODE_PORTS)
        cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--num-cpus={self.num_cpus}",
               f"--temp-dir={self.temp_dir}", "--disable-usage-stats", f"--port={self.gcs_port}",
               f"--dashboard-port={self.dashboard_port}",
               *(f"{flag}={port}" for flag, port in zip(flags, self._head_ports))]
        self.log = open(f"{self.temp_dir}/ray_start.log", "w")
        # An empty TPU_LOG_DIR: else Ray streams any /tmp/tpu_logs on the machine into job logs.
        os.makedirs(f"{self.temp_dir}/tpu_logs", exist_ok=True)
        env = ray_env(TPU_LOG_DIR=f"{self.temp_dir}/tpu_logs")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own session: we stop exactly it
        try:
            self._wait_ready(timeout_s=120)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: "
                                   f"{pathlib.Path(self.log.name).read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"Ray head not ready after {timeout_s} s")

    @property
    def gcs_address(self) -> str:
        """host:port of the GCS (RAY_ADDRESS for drivers, --address for more nodes)."""
        from ray._private.services import get_node_ip_address  # the IP `ray start` binds to

        return f"{get_node_ip_address()}:{self.gcs_port}"

    def add_node(self, name: str, num_cpus: int, timeout_s: float = 120) -> str:
        """Start another raylet on this machine (its own session, stopped with the head); its node id."""
        log = open(f"{self.temp_dir}/node_{name}.log", "w")
        self._node_logs.append(log)
        cmd = [str(VENV_BIN / "ray"), "start", f"--address={self.gcs_address}", "--block",
               f"--num-cpus={num_cpus}", f"--node-name={name}", *_ports(*_NODE_PORTS)]
        self.nodes[name] = subprocess.Popen(cmd, env=ray_env(TPU_LOG_DIR=f"{self.temp_dir}/tpu_logs"),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            node_id = self.node_id(name)
            if node_id:
                return node_id
            time.sleep(1)
        raise TimeoutError(f"Ray node {name} did not join in {timeout_s} s")

    def node_id(self, name: str) -> str | None:
        """The ALIVE node of that name, or None: the state API over HTTP (what `ray list nodes` asks;
        polled every second while a node joins, the CLI was a Ray import, 1-2 CPU-s, per poll)."""
        import json
        import urllib.parse

        query = urllib.parse.urlencode([("filter_keys", "node_name"), ("filter_predicates", "="), ("filter_values", name),
                                        ("filter_keys", "state"), ("filter_predicates", "="), ("filter_values", "ALIVE")])
        try:
            with urllib.request.urlopen(f"{self.dashboard_url}/api/v0/nodes?{query}", timeout=60) as reply:
                rows = json.load(reply)["data"]["result"]["result"]
        except OSError:
            return None
        return rows[0]["node_id"] if rows else None

    def drain_for_preemption(self, node_id: str, deadline_s: int) -> None:
        """What the autoscaler / KubeRay do on a spot reclaim or maintenance event."""
        subprocess.run([str(VENV_BIN / "ray"), "drain-node", f"--address={self.gcs_address}",
                        f"--node-id={node_id}", "--reason=DRAIN_NODE_REASON_PREEMPTION",
                        "--reason-message=test: spot reclaim", f"--deadline-remaining-seconds={deadline_s}"],
                       env=ray_env(), check=True, capture_output=True, text=True, timeout=60)

    def submit(self, args: list[str], timeout_s: float = 480) -> subprocess.CompletedProcess:
        """`ray job submit --working-dir <repo> -- python -m ray_entry.train ARGS`, waits for the end."""
        cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", self.dashboard_url,
               "--working-dir", str(REPO), "--", "python", "-m", "ray_entry.train", *args]
        return subprocess.run(cmd, env=ray_env(), cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every node and the head, remove the temp dir; a second call finds nothing to do."""
        if self.proc is None:
            return
        for node in self.nodes.values():  # the cluster's end: nothing left to save (20 s of SIGTERM grace saved)
            stop_session(node.pid, grace_s=2.0)
            node.wait(timeout=10)
        for log in self._node_logs:
            log.close()
        stop_session(self.proc.pid, grace_s=2.0)
        self.proc.wait(timeout=10)
        self.proc = None
        self.log.close()
        import shutil

        shutil.rmtree(self.temp_dir, ignore_errors=True)
