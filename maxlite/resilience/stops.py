"""The cross-host stop/save vote: every host reaches the same decision at the same step.

Each sync step a process posts one `VoteRow` — its own stop reason (a signal, Ctrl-C or a
launcher's stop request, `max_time`), whether
a straggler report is due, its step-time medians, whether its launcher gave a preemption notice —
and reads the table of all rows posted one sync step earlier (vote.py). The answer: None, a stop
reason ('preempted', 'max_time', 'straggler', 'interrupted'; the user's stop outranks the others)
or SAVE_NOW (a notice: save at this step, go on).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from maxlite.resilience.straggler import format_report, report
from maxlite.rundir import append_jsonl

STOP_CODES = {0: None, 1: "max_time", 2: "preempted", 3: "straggler", 4: "interrupted",  # the highest wins
              5: "lease_lost"}
_CODE_OF = {v: k for k, v in STOP_CODES.items() if v}
SAVE_NOW = "save_now"  # the answer to a preemption notice: checkpoint now, keep training


@dataclasses.dataclass
class VoteRow:
    """What one process posts; the vote's columns, by name."""
    stop: int = 0  # a key of STOP_CODES
    report_due: bool = False  # process 0 asks for a straggler report
    median: float = 0.0  # this window's median step time (own work)
    best_median: float = 0.0  # the best window median so far
    notice: bool = False  # the launcher's preemption notice was seen here, first time

    WIDTH = 8  # the Vote's width (room for more fields)

    def values(self) -> list[float]:
        row = [float(self.stop), float(self.report_due), self.median, self.best_median, float(self.notice)]
        return row + [0.0] * (self.WIDTH - len(row))

    @classmethod
    def column(cls, table: np.ndarray, name: str) -> np.ndarray:
        return table[:, [f.name for f in dataclasses.fields(cls)].index(name)]


class StopVote:
    def __init__(self, cfg, preemption, clock, notice: Callable[[], str | None] | None,
                 log: Callable[[str], None], stop_request: Callable[[], str | None] | None = None):
        """`stop_request()`: a launcher's polled request to stop as Ctrl-C does (the Ray driver's
        Ctrl-C: the loop runs off the main thread there), a line saying who asked, or None."""
        self.cfg, self.preemption, self.clock, self._log = cfg, preemption, clock, log
        self._notice, self._notice_seen = notice, False
        self._stop_request, self._stop_requested = stop_request, False
        self.lease = None  # the primary's run lease (maxlite/lease.py): lost → every host stops
        self.vote, self.primary, self.process_index, self.run_dir = None, True, 0, None
        self._jax_sync = False
        self._last_report = time.monotonic()
        self.scores: dict[str, float] = {}

    def attach(self, vote, primary: bool, process_index: int, run_dir: str, jax_sync: bool) -> None:
        self.vote, self.primary, self.process_index, self.run_dir = vote, primary, process_index, run_dir
        # With jax.distributed up and our handlers not installable (Ray Train runs the loop off the
        # main thread), JAX's own SIGTERM handler stays: its coordination service then picks a
        # step every host stops at (`reached_preemption_sync_point`, asked every step).
        self._jax_sync = jax_sync

    def decide(self, step: int) -> str | None:
        if self._jax_sync and self._jax_preempted(step):
            return "preempted"
        if self.vote is None or step % max(1, self.cfg.resilience_sync_period):
            return None
        return self._sync(step)

    def _reserve_seconds(self) -> float:
        return (2 * self.clock.longest("step") * max(1, self.cfg.resilience_sync_period)
                + self.clock.longest("checkpoint", 60.0))

    def _jax_preempted(self, step: int) -> bool:
        from jax.experimental import multihost_utils

        if not multihost_utils.reached_preemption_sync_point(step):
            return False
        self._log(f"maxlite: a process of this job got SIGTERM (JAX's preemption service): every host "
                  f"stops at step {step}")
        self.preemption.signal_time = self.preemption.signal_time or time.monotonic()  # the grace counts
        return True

    def _noticed(self, step: int) -> bool:
        """True the first time the launcher's notice is seen on this host."""
        if self._notice is None or self._notice_seen:
            return False
        text = self._notice()
        if not text:
            return False
        self._notice_seen = True
        self._log(f"maxlite: {text}: saving a checkpoint at the next agreed step (after step {step}); "
                  f"training goes on until the job is restarted")
        return True

    def _requested(self) -> bool:
        if self._stop_request is None or self._stop_requested:
            return self._stop_requested
        text = self._stop_request()
        if text:
            self._stop_requested = True
            if self.primary:
                self._log(f"maxlite: {text}: saving at the next step every host agrees on, then stopping")
        return self._stop_requested

    def _sync(self, step: int) -> str | None:
        local = "interrupted" if self._requested() else self.preemption.reason(self._reserve_seconds())
        if self.lease is not None and self.lease.lost:
            local = "lease_lost"
        due = self.process_index == 0 and time.monotonic() - self._last_report >= self.cfg.straggler_report_interval
        if due:
            self._last_report = time.monotonic()  # ask once; the report comes one sync step later
        timer = self.clock.timer
        row = VoteRow(stop=_CODE_OF.get(local, 0), report_due=due, median=timer.median(),
                      best_median=timer.best_median or 0.0, notice=self._noticed(step))
        with self.clock.device_wait():  # reading the last vote waits for the slowest host: not own work
            table = self.vote.post(row.values())
        if table is None:
            return None
        code = int(VoteRow.column(table, "stop").max())
        if VoteRow.column(table, "report_due").max() > 0:
            code = max(code, self._straggler_report(step, table))
        if code == 0 and VoteRow.column(table, "notice").max() > 0:  # a host got the notice: all save now
            self._notice_seen = True  # one notice-save per attempt (a restart starts afresh)
            return SAVE_NOW
        return STOP_CODES[code]

    def _straggler_report(self, step: int, table) -> int:
        rep = report(VoteRow.column(table, "median"), VoteRow.column(table, "best_median"),
                     self.cfg.straggler_threshold)
        self._last_report = time.monotonic()
        self.clock.timer.roll()
        me = self.process_index
        self.scores = {"straggler_relative_score": rep["relative"][me],
                       "straggler_individual_score": rep["individual"][me],
                       "straggler_min_relative_score": min(rep["relative"]),
                       "straggler_min_individual_score": min(rep["individual"]),
                       "stragglers": len(rep["stragglers"])}
        if self.primary:
            self._log(format_report(step, rep))
            if self.run_dir:
                append_jsonl(f"{self.run_dir}/stragglers.jsonl", {"step": step, "time": time.time(), **rep})
        return _CODE_OF["straggler"] if (rep["stragglers"] and self.cfg.stop_if_straggler) else 0
