"""The persistent compilation cache across several CPU processes (jax.distributed over gloo): a re-run
loads its programs on every process, not on process 0 only (maxlite/compile_cache.py)."""

from __future__ import annotations

import json

from tests.helpers import run_module, shown


def _probe(cache_dir) -> list[dict]:
    codes, outs = run_module("tests.cache_probe", [str(cache_dir)], processes=2, devices=2, timeout=300)
    assert codes == [0, 0], shown(outs)
    return sorted((json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")),
                  key=lambda r: r["process"])


def test_a_rerun_over_two_processes_finds_its_program_on_both(tmp_path):
    first, again = _probe(tmp_path / "jax"), _probe(tmp_path / "jax")
    assert [r["process"] for r in first] == [0, 1]
    # An empty cache: process 0, the only writer, compiles. Process 1 may already find what process 0
    # wrote if it asks later (its key is the same), so its first answer depends on timing.
    assert first[0]["hit"] is False
    # Both processes load what process 0 wrote (JAX lets only process 0 write): before, process 1's key
    # held its own CPU topology's fingerprint and it compiled every program again on every run.
    assert [r["hit"] for r in again] == [True, True]
    assert len({r["value"] for r in first + again}) == 1  # the loaded program computes what the compiled one did
