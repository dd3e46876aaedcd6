"""Straggler scores from per-process step-work medians (NeMo-style relative and individual scores).

Each process times its *own* work in a step — data, dispatch, host callbacks — not the time it
spends blocked waiting for the devices (in a synchronous job that wait is where the healthy
processes absorb a straggler's delay, so wall step times are equal everywhere).
relative score = best current median across processes / this process's current median;
individual score = this process's best historical median / its current median. Below
`straggler_threshold` a process is a straggler.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


class StepTimer:
    """Own-work time of each step on this process; a window per report interval."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock  # injectable: tests drive it by hand
        self.window: list[float] = []
        self.best_median: float | None = None  # lowest median of any finished window
        self._start: float | None = None
        self._waited = 0.0
        self._wait_start: float | None = None

    def begin(self) -> None:
        self._start, self._waited = self.clock(), 0.0

    def wait_begin(self) -> None:
        self._wait_start = self.clock()

    def wait_end(self) -> None:
        if self._wait_start is not None:
            self._waited += self.clock() - self._wait_start
            self._wait_start = None

    def end(self, skip: bool = False) -> float | None:
        """Close the step; `skip` (compiling steps) leaves it out of the statistics."""
        if self._start is None:
            return None
        took = self.clock() - self._start - self._waited
        self._start = None
        if not skip:
            self.window.append(took)
        return took

    def median(self) -> float:
        return statistics.median(self.window) if self.window else 0.0

    def roll(self) -> None:
        """A report was made: the window's median becomes history."""
        if self.window:
            m = self.median()
            self.best_median = m if self.best_median is None else min(self.best_median, m)
        self.window = []


def scores(current: np.ndarray, best: np.ndarray) -> dict[str, np.ndarray]:
    """Per-process scores from current medians and best historical medians (0 = not yet known)."""
    current = np.asarray(current, np.float64)
    best = np.asarray(best, np.float64)
    valid = current > 0
    best_now = current[valid].min() if valid.any() else 0.0
    relative = np.where(valid, best_now / np.where(valid, current, 1.0), 1.0)
    best = np.where(best > 0, np.minimum(best, current), current)  # the current window counts as history
    individual = np.where(valid, best / np.where(valid, current, 1.0), 1.0)
    return {"relative": relative, "individual": individual}


def report(current, best, threshold: float, top: int = 5) -> dict:
    """Worst and best `top` processes by relative score, the stragglers, and summary fields."""
    s = scores(current, best)
    order = np.argsort(s["relative"], kind="stable")
    entry = lambda p: {"process": int(p), "relative": round(float(s["relative"][p]), 4),  # noqa: E731
                       "individual": round(float(s["individual"][p]), 4),
                       "median_ms": round(1000 * float(current[p]), 3)}
    stragglers = [int(p) for p in range(len(order))
                  if min(s["relative"][p], s["individual"][p]) < threshold]
    return {
        "worst": [entry(p) for p in order[:top]],
        "best": [entry(p) for p in order[::-1][:top]],
        "stragglers": stragglers,
        "relative": [float(x) for x in s["relative"]],
        "individual": [float(x) for x in s["individual"]],
        "threshold": threshold,
    }


def format_report(step: int, rep: dict) -> str:
    def fmt(entries):
        return ", ".join(f"p{e['process']} rel {e['relative']:.2f} ind {e['individual']:.2f} "
                         f"({e['median_ms']:.1f} ms)" for e in entries)
    flagged = f"STRAGGLERS: {rep['stragglers']}" if rep["stragglers"] else "no stragglers"
    return (f"maxlite: straggler report at step {step}: {flagged} (threshold {rep['threshold']}); "
            f"worst: {fmt(rep['worst'])}; best: {fmt(rep['best'])}")
