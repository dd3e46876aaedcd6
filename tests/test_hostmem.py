"""The memory a run may use: cgroup v1 and v2 limits read from fake cgroup trees, and a real run in
a memory-limited cgroup refused in one line before training (skipped where none can be made)."""

from __future__ import annotations

import os

import pytest

from maxlite import hostmem
from tests.helpers import memory_cgroup, run_module

GIB = 2**30


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _proc(tmp_path, cgroup: str, mounts: list[str]) -> str:
    proc = str(tmp_path / "proc")
    _write(f"{proc}/self/cgroup", cgroup)
    _write(f"{proc}/self/mountinfo", "".join(f"{i} 23 0:{i} {m}\n" for i, m in enumerate(mounts, 30)))
    _write(f"{proc}/meminfo", f"MemTotal: {24 * GIB // 1024} kB\nMemAvailable: {20 * GIB // 1024} kB\n")
    return proc


def test_cgroup_v2_limit_of_an_ancestor_minus_its_working_set(tmp_path):
    cg = tmp_path / "cg"
    proc = _proc(tmp_path, "0::/kubepods/pod1/c1\n", [f"/ {cg} rw,nosuid - cgroup2 cgroup2 rw"])
    _write(f"{cg}/kubepods/pod1/c1/memory.max", "max\n")  # the container: none of its own
    _write(f"{cg}/kubepods/pod1/memory.max", f"{3 * GIB // 2}\n")  # the pod: 1.5 GiB
    _write(f"{cg}/kubepods/pod1/memory.current", f"{GIB // 2}\n")
    _write(f"{cg}/kubepods/pod1/memory.stat", f"anon 1\ninactive_file {GIB // 4}\nactive_file 5\n")
    _write(f"{cg}/memory.max", "max\n")
    got = hostmem.memory(proc)
    assert (got.limit, got.available, got.source) == (3 * GIB // 2, 3 * GIB // 2 - (GIB // 2 - GIB // 4), "cgroup v2")
    assert got.where == f"{cg}/kubepods/pod1/memory.max"
    assert got.describe().startswith("this container's memory limit is 1.50 GiB (cgroup v2, ")
    _write(f"{cg}/kubepods/pod1/memory.max", "max\n")  # no limit anywhere: the host's memory
    assert hostmem.cgroup(proc) is None
    host = hostmem.memory(proc)
    assert (host.source, host.available, host.limit) == ("host", 20 * GIB, 24 * GIB)
    assert host.describe() == "this host has 20.0 GiB available"


def test_cgroup_v1_tightest_level_and_a_namespaced_root(tmp_path):
    mem = tmp_path / "memory"
    proc = _proc(tmp_path, "5:pids:/x\n4:memory:/slurm/uid_0/job_7\n1:cpu:/\n0::/\n",
                 [f"/ {tmp_path}/cpu rw - cgroup cgroup rw,cpu", f"/ {mem} rw - cgroup cgroup rw,memory"])
    _write(f"{mem}/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    _write(f"{mem}/slurm/memory.limit_in_bytes", f"{16 * GIB}\n")
    _write(f"{mem}/slurm/memory.usage_in_bytes", f"{GIB}\n")
    _write(f"{mem}/slurm/uid_0/job_7/memory.limit_in_bytes", f"{2 * GIB}\n")
    _write(f"{mem}/slurm/uid_0/job_7/memory.usage_in_bytes", f"{GIB}\n")
    _write(f"{mem}/slurm/uid_0/job_7/memory.stat", f"cache 9\ntotal_inactive_file {GIB // 2}\n")
    got = hostmem.memory(proc)
    assert (got.limit, got.available, got.source) == (2 * GIB, 2 * GIB - GIB // 2, "cgroup v1")
    assert got.where == f"{mem}/slurm/uid_0/job_7/memory.limit_in_bytes"
    _write(f"{mem}/slurm/memory.usage_in_bytes", f"{15 * GIB + GIB // 2}\n")  # the job's parent is tighter now
    assert hostmem.memory(proc).where == f"{mem}/slurm/memory.limit_in_bytes"
    # a cgroup namespace: the process's path is not under the mount; the mount is its own cgroup
    ns = _proc(tmp_path, "4:memory:/docker/abc\n", [f"/docker/abc {mem}/slurm/uid_0/job_7 rw - cgroup cgroup rw,memory"])
    assert hostmem.memory(ns).where == f"{mem}/slurm/uid_0/job_7/memory.limit_in_bytes"


def test_a_run_in_a_memory_limited_cgroup_is_refused_in_one_line(run_dir):
    path = memory_cgroup(3 * GIB // 2)
    if path is None:
        pytest.skip("cannot make a memory-limited cgroup here (no writable memory controller under /sys/fs/cgroup)")
    try:
        enter = ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh"]
        codes, outs = run_module("maxlite.train", ["base.yml", "model_name=llama-100m", "steps=2", "run_name=m",
                                                   f"base_output_directory={run_dir}"], devices=1, prefix=enter)
    finally:
        os.rmdir(path)
    assert codes == [2], outs[0][-3000:]
    errors = [line for line in outs[0].splitlines() if line.startswith("maxlite: error: ")]
    assert len(errors) == 1 and "Traceback" not in outs[0] and "completed step" not in outs[0]
    assert "this container's memory limit is 1.50 GiB (cgroup v" in errors[0] and f"{path}/memory." in errors[0]


def test_a_run_killed_for_memory_is_said_so_by_maxlite_status(run_dir):
    """The kernel kills a run whose container is too small (the fit check turned off): the process
    writes nothing more, but its lease names its cgroup's OOM counter, and `maxlite.status` reads
    the run as lost, killed for memory."""
    from maxlite import status

    path = memory_cgroup(3 * GIB // 2)
    if path is None:
        pytest.skip("cannot make a memory-limited cgroup here (no writable memory controller under /sys/fs/cgroup)")
    try:
        enter = ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh"]
        codes, outs = run_module("maxlite.train", ["base.yml", "model_name=llama-100m", "steps=20", "run_name=k",
                                                   "check_memory_fit=false", f"base_output_directory={run_dir}"],
                                 devices=1, prefix=enter)
        assert codes in ([-9], [137]), outs[0][-3000:]  # SIGKILL: no line, no status of its own
        st = status.run_status(f"{run_dir}/k")
    finally:
        os.rmdir(path)
    assert st["state"] == "lost" and st["reason"] == "out_of_memory", st
    assert "its process is gone" in st["lost"] and "killed for memory: its cgroup's OOM killer ran" in st["lost"]
