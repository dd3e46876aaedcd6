"""pytest plugin of benchmarks/bench_suite.py: one JSON line per test in $SUITE_RECORDER_OUT — its
node id, xdist worker, start and end (epoch s), wall, and the CPU of its process plus the children it
waited for (getrusage), around the whole protocol (setup, call, teardown); and, once the test
process has imported JAX, the seconds JAX itself reports (jax.monitoring) for tracing to a jaxpr,
lowering to StableHLO and XLA's backend compile inside it (not its subprocesses'), with the number of
backend compiles.

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


# JAX's duration events, by the short name the records use
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
           "/jax/core/compile/backend_compile_duration": "compile_s"}
_jax_seconds: dict[str, float] = {}
_listening: list[bool] = []


def _listen() -> None:
    """Count JAX's durations from the first test that finds JAX imported on: importing it here, before
    tests/conftest.py sets JAX_PLATFORMS and XLA_FLAGS, would start JAX with other settings."""
    import sys

    if _listening or "jax" not in sys.modules:
        return
    from jax import monitoring

    def add(event: str, seconds: float, **_):
        name = _EVENTS.get(event)
        if name:
            _jax_seconds[name] = _jax_seconds.get(name, 0.0) + seconds
            if name == "compile_s":
                _jax_seconds["compiles"] = _jax_seconds.get("compiles", 0) + 1

    monitoring.register_event_duration_secs_listener(add)
    _listening.append(True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _listen()
    start, cpu, jax_before = time.time(), _cpu(), dict(_jax_seconds)
    yield
    end = time.time()
    _listen()
    out = os.environ.get("SUITE_RECORDER_OUT")
    if out:
        jax_spent = {k: round(v - jax_before.get(k, 0.0), 3) for k, v in _jax_seconds.items()}
        with open(out, "a") as f:
            f.write(json.dumps({"nodeid": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                "start": start, "end": end, "wall_s": end - start, "cpu_s": _cpu() - cpu,
                                **jax_spent}) + "\n")
