"""The one way a benchmark reports: its JSON on stdout and in benchmarks/results/."""

from __future__ import annotations

import json
import pathlib
import shlex
import sys


def cpuinfo(field: str) -> str:
    """A field of the first CPU in /proc/cpuinfo ("model name", "flags"), "" where there is none: the
    machine a result was taken on."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() == field:
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return ""


def write_result(result: dict, path: pathlib.Path, indent: int = 2) -> None:
    """Write `result` as JSON to `path` (creating its folder) and echo it; `indent` keeps each
    results file's existing layout so reruns diff cleanly."""
    if "command" not in result:  # every result says how to make it again (the scripts that set their own keep it)
        result = {"command": shlex.join(["python", *sys.argv]), **result}
    text = json.dumps(result, indent=indent) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text, end="")
    print(f"wrote {path}")
