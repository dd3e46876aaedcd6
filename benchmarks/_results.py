"""The one way a benchmark reports: its JSON on stdout and in benchmarks/results/."""

from __future__ import annotations

import json
import pathlib
import shlex
import sys


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
