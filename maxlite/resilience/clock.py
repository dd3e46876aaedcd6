"""Where a process's time goes: the hang watchdog's heartbeats, the step timer (own work vs waits
on data, devices and peers), goodput, and the timed sections (eval, checkpoint)."""

from __future__ import annotations

import contextlib
import os
import time

from maxlite.resilience.goodput import Goodput
from maxlite.resilience.straggler import StepTimer


class Clock:
    def __init__(self, started: float, watchdog=None):
        self.started, self.watchdog = started, watchdog
        self.timer = StepTimer()
        self.goodput: Goodput | None = None
        self.steps_this_attempt = 0
        self._seen: dict[str, int] = {}
        self._step_started: float | None = None
        self._data_wait = 0.0
        if watchdog:
            watchdog.beat("setup")

    def attach(self, run_dir: str, primary: bool) -> None:
        local = "://" not in run_dir
        self.goodput = Goodput(os.path.join(run_dir, "goodput.json") if (local and primary) else None, self.started)

    def setup_end(self) -> None:
        if self.goodput:
            self.goodput.add("startup", time.monotonic() - self.started)
        if self.watchdog:
            self.watchdog.beat("step")

    def step_begin(self) -> None:
        if self.watchdog:
            self.watchdog.beat("step", completed="step" if self.steps_this_attempt >= 2 else None)
        self._step_started = time.monotonic()
        self._data_wait = 0.0
        self.timer.begin()

    @contextlib.contextmanager
    def data_wait(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self._data_wait += time.perf_counter() - t

    @contextlib.contextmanager
    def device_wait(self):
        """Around calls that may block on the devices or other hosts — reading results, and the step
        dispatch (on CPU it can run inline and wait in collectives): not this process's own work."""
        self.timer.wait_begin()
        try:
            yield
        finally:
            self.timer.wait_end()

    def step_end(self, step: int, faults=None) -> bool:
        """After step `step` was dispatched: the step's own time (slowed by an injected fault), goodput;
        True while this attempt's first step (the compiling one) ends."""
        self.steps_this_attempt += 1
        compiling = self.steps_this_attempt == 1
        took = self.timer.end(skip=compiling)
        if faults and took is not None:
            t = time.perf_counter()
            faults.slow_down(step, took)
            if not compiling and self.timer.window:
                self.timer.window[-1] += time.perf_counter() - t  # the slowed work is own work
        if self.goodput and self._step_started is not None:
            self.goodput.step(step, time.monotonic() - self._step_started, self._data_wait, compiling)
        return compiling

    @contextlib.contextmanager
    def section(self, name: str):
        """Eval, checkpoint (or any blocking work): watched with its own timeout, counted as badput."""
        seen = self._seen.get(name, 0)
        if self.watchdog:
            self.watchdog.beat(name)
        t = time.monotonic()
        try:
            yield
        finally:
            self._seen[name] = seen + 1
            if self.goodput and name in ("eval", "checkpoint", "rollback"):
                self.goodput.add(name, time.monotonic() - t)
            if self.watchdog:
                self.watchdog.beat("step", completed=name if seen >= 1 else None)  # 1st one compiles
            if self._step_started is not None:
                self._step_started += time.monotonic() - t  # not part of the step interval

    def longest(self, section: str, default: float = 0.0) -> float:
        return (self.watchdog.longest if self.watchdog else {}).get(section, default)

    def close(self, finished: bool = False) -> dict:
        """Stop the watchdog, save goodput (`finished`: the run is done); its summary fields."""
        if self.watchdog:
            self.watchdog.close()
        fields = self.goodput.summary() if self.goodput else {}
        if self.goodput:
            self.goodput.save(finished)
        return fields
