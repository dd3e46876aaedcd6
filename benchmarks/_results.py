"""The one way a benchmark reports: its JSON on stdout and in benchmarks/results/."""

from __future__ import annotations

import json
import pathlib


def write_result(result: dict, path: pathlib.Path, indent: int = 2) -> None:
    """Write `result` as JSON to `path` (creating its folder) and echo it; `indent` keeps each
    results file's existing layout so reruns diff cleanly."""
    text = json.dumps(result, indent=indent) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text, end="")
    print(f"wrote {path}")
