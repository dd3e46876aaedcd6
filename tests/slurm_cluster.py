"""A real one-node Slurm cluster (munged + slurmctld + slurmd) for tests, in a private directory.

Installs Debian's Slurm and munge through apt when missing (root only; the tests are skipped,
saying why, when that is impossible). No systemd here: the daemons are started directly and
stopped by pid. Clients find the cluster through SLURM_CONF (see `SlurmCluster.env`).
Use: `from tests.slurm_cluster import slurm_cluster  # noqa: F401` in a test module.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
from tests.helpers import free_port

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
TOOLS = ["slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel", "munged"]


def ensure_installed() -> None:
    """apt-get install Slurm and munge if a tool is missing; pytest.skip when that cannot be done."""
    if all(shutil.which(t) for t in TOOLS):
        return
    if os.geteuid() != 0:
        pytest.skip("Slurm is not installed and installing it needs root (apt-get)")
    if shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"cannot install Slurm ({' '.join(cmd[:2])} failed: {tail})")
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:
        pytest.skip(f"Slurm installed but {', '.join(missing)} not found")


def _pid(path: pathlib.Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class SlurmCluster:
    """munged, slurmctld and slurmd on this host, everything under one temporary directory."""

    def __init__(self) -> None:
        # Not pytest's tmp_path: munged (running as the munge user) must traverse the directory.
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="maxlite-slurm-"))
        self.dir.chmod(0o755)
        self.conf = self.dir / "slurm.conf"
        self.partition = "debug"
        self._pidfiles: list[pathlib.Path] = []

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=60)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def _start_munge(self) -> pathlib.Path:
        key_dir, run_dir = self.dir / "munge-key", self.dir / "munge-run"
        for d, mode in ((key_dir, 0o700), (run_dir, 0o755)):  # munged checks these permissions
            d.mkdir()
            shutil.chown(d, "munge", "munge")
            d.chmod(mode)
        key, sock = key_dir / "munge.key", run_dir / "munge.sock"
        key.write_bytes(os.urandom(1024))  # what `mungekey --create` does; older munge lacks mungekey
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        pidfile = run_dir / "munged.pid"
        out = subprocess.run(
            ["runuser", "-u", "munge", "--", "munged", f"--socket={sock}", f"--key-file={key}",
             f"--log-file={key_dir / 'munged.log'}", f"--pid-file={pidfile}", f"--seed-file={key_dir / 'seed'}"],
            capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"munged did not start: {out.stderr.strip()}")
        self._pidfiles.append(pidfile)
        return sock

    def _write_conf(self, munge_socket: pathlib.Path) -> None:
        node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        name = node.split()[0].split("=", 1)[1]
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        self.conf.write_text("\n".join([
            "ClusterName=maxlite-test",
            f"SlurmctldHost={name}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire=10: a requeued job is held back cred_expire seconds (120 by default).
            f"AuthInfo=cred_expire=10,socket={munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",  # no cgroups/systemd here
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=10",
            "SchedulerParameters=sched_interval=2,bf_interval=2",  # start requeued jobs promptly
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            f"{node} NodeAddr=127.0.0.1 State=UNKNOWN",
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def start(self, timeout: float = 60) -> "SlurmCluster":
        sock = self._start_munge()
        self._write_conf(sock)
        for daemon, pidfile in ((["slurmctld", "-c", "-i"], "slurmctld.pid"), (["slurmd"], "slurmd.pid")):
            self._pidfiles.insert(0, self.dir / pidfile)  # stopped in reverse: slurmd first
            out = subprocess.run(daemon, capture_output=True, text=True, env=self.env)
            if out.returncode != 0:
                raise RuntimeError(f"{daemon[0]} did not start: {out.stderr.strip()}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%T", check=False)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        tails = [f"{f.name}: " + " | ".join(f.read_text().splitlines()[-5:])
                 for f in (self.dir / "slurmctld.log", self.dir / "slurmd.log") if f.exists()]
        raise RuntimeError(f"Slurm node not idle after {timeout} s; " + "; ".join(tails))

    def stop(self) -> None:
        """Cancel every job, then stop the daemons by pid and remove the directory."""
        if self.conf.exists() and self._pidfiles:
            out = self.run("squeue", "-h", "-o", "%i", check=False)
            jobs = out.stdout.split() if out.returncode == 0 else []
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                    time.sleep(0.5)
        pids = [pid for pid in map(_pid, self._pidfiles) if pid is not None]
        for pid in pids:  # all at once: each takes 1-2 s to shut down
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for pid in pids:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    break
                time.sleep(0.1)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node Slurm cluster with partition `debug`; stopped after the session."""
    ensure_installed()
    if os.geteuid() != 0:
        pytest.skip("a private Slurm cluster needs root (slurmd runs jobs as any user)")
    cluster = SlurmCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()
