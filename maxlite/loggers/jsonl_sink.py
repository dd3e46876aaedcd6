"""metrics.jsonl: one JSON object per record, the summary last; what status, report and tests read."""

from __future__ import annotations

import json
from typing import Any

import fsspec

from maxlite.loggers import Sink


class JsonlSink(Sink):
    name = "jsonl"

    def __init__(self, run_dir: str):
        # appends across restarts locally; object stores cannot append
        self.file = fsspec.open(f"{run_dir}/metrics.jsonl", "a" if "://" not in run_dir else "w").open()

    def write(self, record: dict[str, Any], group: str) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        self.file.write(json.dumps({"summary": summary}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
