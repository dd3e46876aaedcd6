"""Goodput: productive step time against wall time, and badput by cause, across restarts.

Causes: startup (process start → first step, restore included), compilation (first step of an
attempt), data_wait, checkpoint (time the loop blocked on saves), eval, restart (gap between an
attempt's last sign of life and the next attempt's start — unless that attempt finished the run:
a later command that extends a finished run starts a new span, and the time between is nobody's),
recomputed (steps done again after a
restore from an older state), rollback (restoring a good state after a bad loss, and the steps it
abandoned), snapshot (taking in-memory snapshots), sample (`sample_prompts` during and after
training), peak_probe (measuring the device's peak for the MFU), other (the rest: none is left in
the loop, see clock.py). Productive time may be split by part (GRPO's `rollout`: sampling and
rewards inside a step): `productive_<part>_seconds`. The primary process keeps the running totals in
`{run_dir}/goodput.json` so a restarted job continues them.
"""

from __future__ import annotations

import json
import os
import time

from maxlite.rundir import write_text

CAUSES = ("startup", "compilation", "data_wait", "checkpoint", "eval", "restart", "recomputed", "rollback",
          "snapshot", "sample", "peak_probe")


class Goodput:
    def __init__(self, path: str | None, started_monotonic: float, save_every: float = 30.0, now=time.monotonic):
        self.path, self.save_every, self.now = path, save_every, now
        self.started = started_monotonic
        self.productive = 0.0
        self.parts: dict[str, float] = {}  # productive time by part (a productive section's name)
        self.badput = dict.fromkeys(CAUSES, 0.0)
        self.previous_wall = 0.0
        self.max_step = -1  # highest step any attempt completed
        self.attempt = 1
        self._saved = 0.0
        prior = self._load()
        if prior:
            self.previous_wall = prior.get("wall_seconds", 0.0)
            self.productive = prior.get("productive_seconds", 0.0)
            self.parts = dict(prior.get("productive_parts", {}))
            for k, v in prior.get("badput_seconds", {}).items():
                self.badput[k] = v
            self.max_step = prior.get("max_step", -1)
            self.attempt = prior.get("attempt", 1) + 1
            gap = max(0.0, time.time() - (self.now() - started_monotonic) - prior.get("last_alive", time.time()))
            if not prior.get("finished"):  # a restart after a failure or preemption
                self.badput["restart"] += gap
                self.previous_wall += gap

    def _load(self) -> dict | None:
        if not self.path or not os.path.exists(self.path):
            return None
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return None

    def add(self, cause: str, seconds: float) -> None:
        self.badput[cause] += max(0.0, seconds)

    def productive_part(self, part: str, seconds: float, compiling: bool, compile_seconds: float = 0.0) -> None:
        """Productive work done in a section of its own (cut out of its step's interval); of it,
        `compile_seconds` were XLA compiling (the whole section in an attempt's first step)."""
        if compiling:
            self.add("compilation", seconds)
            return
        compiled = min(max(0.0, compile_seconds), max(0.0, seconds))
        self.add("compilation", compiled)
        self.productive += max(0.0, seconds) - compiled
        self.parts[part] = self.parts.get(part, 0.0) + max(0.0, seconds) - compiled

    def step(self, step: int, seconds: float, data_wait: float, compiling: bool, compile_seconds: float = 0.0) -> None:
        """One step's wall interval (`step` = steps done after it); of it, `compile_seconds` were XLA
        compiling (a later program: the whole interval of an attempt's first step is compilation)."""
        self.add("data_wait", data_wait)
        rest = max(0.0, seconds - data_wait)
        if not compiling:
            compiled = min(max(0.0, compile_seconds), rest)
            self.add("compilation", compiled)
            rest -= compiled
        if compiling:
            self.add("compilation", rest)
        elif step <= self.max_step:
            self.add("recomputed", rest)
        else:
            self.productive += rest
        self.max_step = max(self.max_step, step)
        if self.path and self.now() - self._saved > self.save_every:
            self.save()

    def wall(self) -> float:
        return self.previous_wall + self.now() - self.started

    def summary(self) -> dict:
        wall = self.wall()
        out = {"goodput": round(self.productive / wall, 4) if wall > 0 else 0.0,
               "productive_seconds": round(self.productive, 3), "wall_seconds": round(wall, 3),
               "attempt": self.attempt}
        known = sum(self.badput.values())
        for k, v in self.parts.items():
            out[f"productive_{k}_seconds"] = round(v, 3)
        for k, v in self.badput.items():
            out[f"badput_{k}_seconds"] = round(v, 3)
        out["badput_other_seconds"] = round(max(0.0, wall - self.productive - known), 3)
        return out

    def save(self, finished: bool = False) -> None:
        """`finished`: this attempt ended the run (its last save)."""
        if not self.path:
            return
        self._saved = self.now()
        record = {"wall_seconds": self.wall(), "productive_seconds": self.productive, "productive_parts": self.parts,
                  "badput_seconds": self.badput, "max_step": self.max_step, "attempt": self.attempt,
                  "last_alive": time.time(), "finished": finished}
        try:
            write_text(self.path, json.dumps(record))
        except OSError:
            pass
