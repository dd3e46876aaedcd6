"""ray_cpu_affinity's core claims (maxlite/launch/cpu_affinity.py), in real processes: each pinned
process gets cores no other pinned one holds, a claim that cannot be met leaves the process unpinned
with one line, and a dead process's cores are free again."""

import os
import subprocess
import sys

from tests.helpers import ROOT

PIN = ("import os, sys; from maxlite.launch.cpu_affinity import pin; "
       "cores = pin(float(sys.argv[1]), 'test process', sys.argv[2]); "
       "print(cores, sorted(os.sched_getaffinity(0)), flush=True); sys.stdin.read()")


def _start(num_cpus: float, directory: str) -> tuple[subprocess.Popen, list[str]]:
    """A process that pins itself and holds its claim until its stdin closes; (it, its two lines)."""
    proc = subprocess.Popen([sys.executable, "-c", PIN, str(num_cpus), directory], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = [proc.stdout.readline().strip() for _ in range(2)]
    return proc, lines


def _end(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)


def test_pinned_processes_get_cores_of_their_own_until_they_die(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "needs a machine with two cores"
    claims = str(tmp_path / "claims")
    first, (said, line) = _start(1, claims)
    assert said == f"maxlite: ray_cpu_affinity: test process pinned to core(s) [{cores[0]}]"
    assert line == f"[{cores[0]}] [{cores[0]}]"  # the process runs on that core only
    second, (said, line) = _start(0.5, claims)  # a fraction of a CPU still needs a core of its own
    assert line == f"[{cores[1]}] [{cores[1]}]", said
    everything, (said, line) = _start(len(cores), claims)  # two cores are held: cannot be met
    assert said == (f"maxlite: ray_cpu_affinity: test process wanted {len(cores)} free core(s), "
                    f"{len(cores) - 2} left on this machine: runs unpinned")
    assert line == f"[] {cores}"
    _end(everything)
    first.kill()  # a killed worker: the kernel drops its lock, no cleanup runs
    first.wait(timeout=30)
    again, (said, line) = _start(1, claims)
    assert line == f"[{cores[0]}] [{cores[0]}]", said
    for proc in (second, again):
        _end(proc)
