"""Wall time of the README's first command on a fresh clone, and where it goes.

    python benchmarks/bench_readme_demo.py --out benchmarks/results/readme_demo.json [--venv PATH]

Clones this checkout's HEAD into a temporary directory with a fresh HOME (no pip cache, no compile
cache, no cpu_matmul.json: a new machine as far as this user is concerned), then runs
`python3.11 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python -m ray_entry.train demo.yml`,
stamping every output line. `--venv` skips the install and runs the clone's code with an existing
venv's Python (the demo's own phases only). The JSON has the phases (install, driver start → Ray up, worker
set-up, first steps with the compile, steps, evals, sample, report, shutdown), the command, the
CPU's flags and the load average at each phase (the machine may be shared: read the figures with it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKS = [  # (phase ending at the first line matching, pattern)
    ("driver_start_and_ray_up", r"maxlite: Ray: "),
    ("workers_and_setup", r"maxlite: run "),
    ("init_compile_and_5_steps", r"completed step: 5,"),
    ("steps_to_last", r"completed step: (\d+),(?!.*completed)"),
    ("sample", r"maxlite: sampled "),
    ("final_save_and_summary", r"maxlite summary"),
    ("report", r"maxlite: report"),
    ("shutdown", r"maxlite: Ray run finished"),
]


def load() -> str:
    return pathlib.Path("/proc/loadavg").read_text().strip()


def flags() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].strip()
    return ""


def stamped(cmd: list[str], cwd: str, env: dict, log: list) -> int:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        log.append((time.time(), line.rstrip("\n")))
    return proc.wait()


def phases(start: float, log: list, end: float) -> dict:
    """Seconds of each phase, from the stamped demo output (the last completed step for the steps);
    `exit`: from the last phase's line to the process's end."""
    out, t = {}, start
    last_step = max((ts for ts, line in log if "completed step:" in line), default=None)
    for name, pattern in MARKS:
        hits = [ts for ts, line in log if re.search(pattern, line)]
        end = last_step if name == "steps_to_last" else (hits[0] if hits else None)
        if end is not None:
            out[name] = round(end - t, 2)
            t = end
    out["exit"] = round(end - t, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--venv", default="", help="an installed venv: skip the clone's install")
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="maxlite_readme_"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS", "XLA_FLAGS")}
    env["HOME"] = str(work / "home")
    (work / "home").mkdir()
    record = {"cpu_flags": flags(), "load_start": load(), "phases_seconds": {}}
    t0 = time.time()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work / "repo")], check=True)
    repo = str(work / "repo")
    if args.venv:
        python = str(pathlib.Path(args.venv) / "bin" / "python")
        env["PYTHONPATH"] = repo  # the clone's code, wherever the venv's own install points
        record["command"] = (f"PYTHONPATH=<clone> {python} -m ray_entry.train demo.yml  "
                             "(fresh clone, fresh HOME, existing venv)")
    else:
        record["command"] = ("python3.11 -m venv .venv && .venv/bin/pip install -e . && "
                             ".venv/bin/python -m ray_entry.train demo.yml  (fresh clone, fresh HOME)")
        subprocess.run(["python3.11", "-m", "venv", ".venv"], cwd=repo, env=env, check=True)
        subprocess.run([".venv/bin/pip", "install", "-q", "-e", "."], cwd=repo, env=env, check=True)
        record["phases_seconds"]["venv_and_install"] = round(time.time() - t0, 2)
        record["load_after_install"] = load()
        python = ".venv/bin/python"
    start, log = time.time(), []
    rc = stamped([python, "-u", "-m", "ray_entry.train", "demo.yml"], repo, env, log)
    end = time.time()
    record["phases_seconds"].update(phases(start, log, end))
    record.update(exit_code=rc, demo_seconds=round(end - start, 2),
                  total_seconds=round(time.time() - t0, 2), load_end=load(),
                  lines=[line for _, line in log if "maxlite" in line and "completed step" not in line][-12:])
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "cpu_flags" and k != "lines"}, indent=1))
    sys.exit(rc)


if __name__ == "__main__":
    main()
