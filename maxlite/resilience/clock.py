"""Where a process's time goes: the hang watchdog's heartbeats, the step timer (own work vs waits
on data, devices and peers), goodput, and the timed sections (eval, checkpoint, ...).

For goodput every second from `Resilience()` on belongs to one cause: startup until the loop, then
each step's interval, which runs from its start to the next step's start (or the loop's end), so
the cross-host vote and the one-step-late read that wait for the step and the other hosts are the
step's time; a section (eval, checkpoint, snapshot, sample, rollback, peak_probe) is cut out of
the interval it falls in and charged to its own name. The attempt's first step is compilation; in
a later step or productive section (GRPO's rollout) the seconds XLA spent compiling on this thread
(maxlite/resilience/compiles.py: a new prompt length, a narrower batch) are compilation, the rest
its own cause."""

from __future__ import annotations

import contextlib
import os
import time

from maxlite.resilience import compiles
from maxlite.resilience.goodput import CAUSES, Goodput
from maxlite.resilience.straggler import StepTimer


class Clock:
    def __init__(self, started: float, watchdog=None, now=time.monotonic, compile_seconds=compiles.on_this_thread):
        """`now`: the clock goodput and the step timer measure with; `compile_seconds`: the seconds
        this thread has spent compiling so far (maxlite/resilience/compiles.py; tests inject both)."""
        self.started, self.watchdog, self.now, self.compile_seconds = started, watchdog, now, compile_seconds
        self._compiled_at = 0.0  # compile_seconds() when the open step interval began, its sections' left out
        self._compiled_at_begin = 0.0  # ... and as it was (the straggler timer's step includes its sections)
        self.timer = StepTimer(clock=now)
        self.goodput: Goodput | None = None
        self.steps_this_attempt = 0
        self._seen: dict[str, int] = {}
        self._step_started: float | None = None
        self._data_wait = 0.0
        self._ended: tuple[int, bool] | None = None  # (step, compiling) of the interval still open
        if watchdog:
            watchdog.beat("setup")

    def attach(self, run_dir: str, primary: bool) -> None:
        local = "://" not in run_dir
        self.goodput = Goodput(os.path.join(run_dir, "goodput.json") if (local and primary) else None,
                               self.started, now=self.now)

    def setup_end(self) -> None:
        if self.goodput:
            self.goodput.add("startup", self.now() - self.started)
        if self.watchdog:
            self.watchdog.beat("step")

    def _close_interval(self, cause: str | None = None) -> None:
        """Charge the open step interval: to its step (productive, compilation or recomputed, by
        goodput's rule) once the step ended, else to `cause` (a step abandoned by a rollback)."""
        if self.goodput and self._step_started is not None:
            seconds = self.now() - self._step_started
            if self._ended is not None:
                step, compiling = self._ended
                self.goodput.step(step, seconds, self._data_wait, compiling,
                                  self.compile_seconds() - self._compiled_at)
            elif cause is not None:
                self.goodput.add("data_wait", self._data_wait)
                self.goodput.add(cause, seconds - self._data_wait)
        self._step_started, self._ended, self._data_wait = None, None, 0.0

    def step_begin(self) -> None:
        self._close_interval()
        if self.watchdog:
            self.watchdog.beat("step", completed="step" if self.steps_this_attempt >= 2 else None)
        self._step_started = self.now()
        self._compiled_at = self._compiled_at_begin = self.compile_seconds()
        self._data_wait = 0.0
        self.timer.begin()

    def step_abandoned(self) -> None:
        """The step begun last will not end (a rollback): its time so far is the rollback's."""
        self._close_interval("rollback")

    def loop_end(self) -> None:
        """After the loop's last read: the last step's interval ends here."""
        self._close_interval()

    @contextlib.contextmanager
    def data_wait(self):
        t = self.now()
        try:
            yield
        finally:
            self._data_wait += self.now() - t

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
        """After step `step` was dispatched: the step's own time (slowed by an injected fault; not
        counted where the step compiled); its goodput interval stays open until the next step begins.
        True while this attempt's first step (the compiling one) ends."""
        self.steps_this_attempt += 1
        compiling = self.steps_this_attempt == 1
        # a step that compiled a program (a new shape) is left out of the straggler statistics too
        took = self.timer.end(skip=compiling or self.compile_seconds() > self._compiled_at_begin)
        if faults and took is not None:
            t = self.now()
            faults.slow_down(step, took)
            if not compiling and self.timer.window:
                self.timer.window[-1] += self.now() - t  # the slowed work is own work
        self._ended = (step, compiling)
        return compiling

    @contextlib.contextmanager
    def section(self, name: str, productive: bool = False):
        """Eval, checkpoint (or any blocking work): watched with its own timeout, counted as badput
        under its name (one of goodput.CAUSES) and cut out of the step interval it falls in. A
        `productive` section is part of a step's own work (GRPO's rollout): it is watched and
        accounted under its name too, as productive time (compilation in an attempt's first step)."""
        seen = self._seen.get(name, 0)
        if self.watchdog:
            self.watchdog.beat(name)
        t, compiled = self.now(), self.compile_seconds()
        try:
            yield
        finally:
            self._seen[name] = seen + 1
            took, compiled = self.now() - t, self.compile_seconds() - compiled
            self._compiled_at += compiled  # the section's compiles are its own, not its step's
            if self.goodput and productive:
                self.goodput.productive_part(name, took, compiling=self.steps_this_attempt == 0,
                                             compile_seconds=compiled)
            elif self.goodput and name in CAUSES:
                self.goodput.add(name, took)
            if self.watchdog:
                self.watchdog.beat("step", completed=name if seen >= 1 else None)  # 1st one compiles
            if self._step_started is not None:
                self._step_started += took  # not part of the step interval

    def longest(self, section: str, default: float = 0.0) -> float:
        return (self.watchdog.longest if self.watchdog else {}).get(section, default)

    def close(self, finished: bool = False, save: bool = True) -> dict:
        """Stop the watchdog, save goodput (`finished`: the run is done; not `save`: the run
        directory is no longer this process's); its summary fields."""
        if self.watchdog:
            self.watchdog.close()
        fields = self.goodput.summary() if self.goodput else {}
        if self.goodput and save:
            self.goodput.save(finished)
        return fields
