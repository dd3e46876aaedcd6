"""benchmarks/_results.py: every result written records the command that made it."""

from __future__ import annotations

import json
import sys

from benchmarks._results import write_result


def test_a_result_records_its_command_and_keeps_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_x.py", "--steps", "3", "model_name=tiny"])
    write_result({"tokens_per_s": 1.0}, tmp_path / "x.json")
    assert json.loads((tmp_path / "x.json").read_text())["command"] == "python benchmarks/bench_x.py --steps 3 model_name=tiny"
    write_result({"command": "JAX_PLATFORMS=cpu python benchmarks/bench_x.py", "tokens_per_s": 1.0}, tmp_path / "y.json")
    assert json.loads((tmp_path / "y.json").read_text())["command"] == "JAX_PLATFORMS=cpu python benchmarks/bench_x.py"
    capsys.readouterr()
