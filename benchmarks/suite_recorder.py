"""pytest plugin of benchmarks/bench_suite.py: one JSON line per test in $SUITE_RECORDER_OUT — its
node id, xdist worker, start and end (epoch s), wall, and the CPU of its process plus the children it
waited for (getrusage), around the whole protocol (setup, call, teardown).

    SUITE_RECORDER_OUT=tests.jsonl PYTHONPATH=benchmarks python -m pytest -p suite_recorder
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, cpu = time.time(), _cpu()
    yield
    end = time.time()
    out = os.environ.get("SUITE_RECORDER_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"nodeid": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                "start": start, "end": end, "wall_s": end - start, "cpu_s": _cpu() - cpu}) + "\n")
