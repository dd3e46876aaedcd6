"""Wall and CPU time of the README's test command on a fresh clone, and where they go.

    python benchmarks/bench_suite.py --out benchmarks/results/suite_<commit>.json

Clones this checkout's HEAD into a temporary directory and runs the README's second command there
(`python3.11 -m venv .venv && .venv/bin/pip install -e ".[test,tpu]" && .venv/bin/python -m pytest -q`)
with a fresh HOME: no compile cache, no cpu_matmul.json, nothing an earlier run left (pip's own
download cache and configuration are kept, PIP_CACHE_DIR and XDG_CONFIG_HOME, so the install measures
installing, not the network). pytest
runs with benchmarks/suite_recorder.py, which writes each test's wall, CPU (its process and the
children it waited for) and worker; beside it this script samples /proc every second, so the JSON
says how busy the machine's cores were (the suite is CPU-bound when they were busy throughout) and
where the CPU went by kind of process, the tests' own beside what the recorder cannot see (Ray's
clusters, trainers that outlive their waiter, the GCS emulator): every process whose environment
carries BENCH_SUITE_RUN, which the tests' processes pass on. The machine may be shared: read the
figures with its load average, which the JSON keeps.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _results import cpuinfo, write_result  # noqa: E402


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (/proc/stat's first line)."""
    fields = [int(v) for v in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)




# What a process of the run is, by its command line (first match): the suite's CPU beside its test
# processes' own (the Ray clusters, the trainers the tests start) is read per process from /proc.
PROCESS_KINDS = (("pytest workers (the tests in-process)", ("execnet", "import sys;exec(eval(sys.stdin")),
                 ("Ray workers and actors", ("default_worker.py", "ray::")),
                 ("Ray's own processes", ("raylet", "gcs_server", "/ray/dashboard/", "log_monitor.py", "monitor.py",
                                          "runtime_env/agent", "bin/ray ")),
                 ("trainers and other maxlite processes", ("-m maxlite.", "ray_entry.", "maxlite/")),
                 ("test helper processes (python -m tests.*)", ("-m tests.",)),
                 ("pytest's controller", ("-m pytest",)))
MARK = "BENCH_SUITE_RUN"  # in the tests' environment: their processes, and every process they start, carry it


def _kind(cmd: str) -> str:
    return next((kind for kind, needles in PROCESS_KINDS if any(n in cmd for n in needles)), "other")


class Sampler(threading.Thread):
    """Every `period` s: /proc/stat (the cores' busy fraction over the run) and every process that carries
    MARK in its environment, its CPU so far (a process's figure is its last sample: up to `period` s
    of its end, and a process shorter than `period`, go unseen)."""

    def __init__(self, period: float = 1.0):
        super().__init__(daemon=True)
        self.period, self.samples, self.stop = period, [], threading.Event()
        self.procs: dict[tuple[str, str], dict] = {}  # (pid, start time) → kind, test, cpu
        self.hz = os.sysconf("SC_CLK_TCK")

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), *_busy_jiffies()))
            self._processes()
            self.stop.wait(self.period)

    def _processes(self):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                key, cpu = (pid, fields[19]), (int(fields[11]) + int(fields[12])) / self.hz
                if key not in self.procs:
                    env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    if f"{MARK}=1".encode() not in env:
                        self.procs[key] = None
                        continue
                    test = next((e[20:].decode() for e in env if e.startswith(b"PYTEST_CURRENT_TEST=")), "")
                    cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    self.procs[key] = {"kind": _kind(cmd), "test": test.rsplit(" ", 1)[0], "cpu": cpu}
                elif self.procs[key] is not None:
                    self.procs[key]["cpu"] = cpu
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile, or not ours to read

    def figures(self) -> dict:
        self.samples.append((time.monotonic(), *_busy_jiffies()))
        (t0, b0, a0), (t1, b1, a1) = self.samples[0], self.samples[-1]
        kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        tests: dict[str, float] = collections.defaultdict(float)
        for p in filter(None, self.procs.values()):
            kinds[p["kind"]][0] += p["cpu"]
            kinds[p["kind"]][1] += 1
            if not p["kind"].startswith("pytest"):
                tests[p["test"]] += p["cpu"]  # the test running where the process (or the cluster) started
        return {"busy_fraction": round((b1 - b0) / max(1, a1 - a0), 3),
                "busy_core_seconds": round((b1 - b0) / self.hz), "sampled_s": round(t1 - t0),
                "cpu_by_process_kind": {k: {"cpu_s": round(v[0]), "processes": v[1]}
                                        for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
                # a shared Ray head's workers count for the test that started the head
                "tests_by_cpu_of_their_processes": [{"test": t, "cpu_s": round(c, 1)} for t, c in
                                                    sorted(tests.items(), key=lambda kv: -kv[1])[:25]]}


def _run(cmd: str, cwd: pathlib.Path, env: dict, log: pathlib.Path) -> tuple[int, float, float]:
    """(exit code, wall s, CPU s of the command and every child it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return code, time.monotonic() - start, cpu


def _per_test(records: list[dict]) -> dict:
    """The longest files and tests by CPU, and when each worker ended."""
    if not records:
        return {"tests_recorded": 0}
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in records:
        f = files[r["nodeid"].split("::")[0]]
        f[0] += r["wall_s"]
        f[1] += r["cpu_s"]
        f[2] += 1
    start = min(r["start"] for r in records)
    ends: dict[str, float] = {}
    for r in records:
        ends[r["worker"]] = max(ends.get(r["worker"], 0.0), r["end"] - start)
    jax_spent = {k: round(sum(r.get(k, 0.0) for r in records), 1) for k in ("trace_s", "lower_s", "compile_s", "compiles")}
    jax_by_file: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for r in records:
        for k in ("trace_s", "lower_s", "compile_s", "compiles"):
            jax_by_file[r["nodeid"].split("::")[0]][k] += r.get(k, 0.0)
    top_files = sorted(files.items(), key=lambda kv: -kv[1][1])[:25]
    top_tests = sorted(records, key=lambda r: -r["cpu_s"])[:40]
    waits = sorted(records, key=lambda r: -(r["wall_s"] - r["cpu_s"]))[:10]
    return {
        "tests_recorded": len(records),
        "counted_cpu_s": round(sum(r["cpu_s"] for r in records)),
        "worker_end_s": {w: round(e) for w, e in sorted(ends.items())},
        # what JAX reported inside the test processes (pytest's workers, not their subprocesses): wall
        # seconds tracing, lowering and in XLA's backend compile, and the number of backend compiles
        "jax_in_test_processes": jax_spent,
        "files_by_cpu": [{"file": f, "wall_s": round(v[0]), "cpu_s": round(v[1]), "tests": v[2],
                          **{k: round(n, 1) for k, n in jax_by_file[f].items()}} for f, v in top_files],
        "tests_by_cpu": [{"test": r["nodeid"], "wall_s": round(r["wall_s"], 1), "cpu_s": round(r["cpu_s"], 1),
                          **{k: r[k] for k in ("trace_s", "lower_s", "compile_s", "compiles") if k in r}}
                         for r in top_tests],
        # wall beyond the test process's own CPU and its waited children's: other processes' CPU (Ray
        # workers, the emulator) or waiting
        "tests_by_wall_beyond_cpu": [{"test": r["nodeid"], "wall_s": round(r["wall_s"], 1),
                                      "cpu_s": round(r["cpu_s"], 1)} for r in waits],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments (e.g. a -k for a trial)")
    args = parser.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_suite_"))
    clone, home = work / "clone", work / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    records = work / "tests.jsonl"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "MAXLITE_", "RAY_"))},
           "HOME": str(home), "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", os.path.expanduser("~/.cache/pip")),
           # pip's user configuration (an index or a wheel folder this machine installs from) stays the user's
           "XDG_CONFIG_HOME": os.environ.get("XDG_CONFIG_HOME", os.path.expanduser("~/.config")),
           "SUITE_RECORDER_OUT": str(records), "PYTHONPATH": str(ROOT / "benchmarks"), MARK: "1"}
    print(f"bench_suite: {commit} cloned to {clone}; HOME={home}", flush=True)

    code, install_s, install_cpu = _run('python3.11 -m venv .venv && .venv/bin/pip install -q -e ".[test,tpu]"',
                                        clone, env, work / "install.log")
    if code:
        print(f"bench_suite: the install failed (exit {code}): {work / 'install.log'}", file=sys.stderr)
        return 1
    print(f"bench_suite: installed in {install_s:.0f} s; running the tests (about 30 minutes on 2 cores)", flush=True)
    sampler = Sampler()
    sampler.start()
    load_before = pathlib.Path("/proc/loadavg").read_text().split()[:3]
    code, tests_s, tests_cpu = _run(f".venv/bin/python -m pytest -q -p suite_recorder {args.pytest_args}",
                                    clone, env, work / "pytest.log")
    machine = sampler.figures()
    sampler.stop.set()
    log = (work / "pytest.log").read_text()
    summary = next((line for line in reversed(log.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    result = {
        "commit": commit,
        "measured": 'python3.11 -m venv .venv && .venv/bin/pip install -e ".[test,tpu]" && .venv/bin/python -m pytest -q',
        "machine": {"cpu": cpuinfo("model name") or "unknown", "cores": os.cpu_count(),
                    "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                    "load_average_before": load_before},
        "fresh_home": True,
        "install_s": round(install_s), "install_cpu_s": round(install_cpu),
        "tests_exit_code": code, "tests_s": round(tests_s, 1), "tests_min": round(tests_s / 60, 1),
        "tests_cpu_s": round(tests_cpu), "pytest_summary": summary.strip("= "), "counts": counts,
        "cores": machine,
        **_per_test([json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []),
    }
    write_result(result, args.out)
    print(f"bench_suite: logs in {work}", flush=True)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
