"""Hang watchdog: one thread per process watching heartbeats of named sections.

Sections are `setup`, `step`, `eval` and `checkpoint`. A section's timeout is
`watchdog_initial_timeout` until one full interval of it was seen (setup, the first compiling
step, the first eval/save), then `max(watchdog_min_timeout, watchdog_factor × longest seen)`.
On a hang every thread's stack goes to stderr and `{run_dir}/hang_p{process}.log`, `on_hang`
runs (status.json), and the process exits with `exit_codes.HANG` so Ray/Slurm restart the job.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Callable

from maxlite.resilience import exit_codes


def all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    def __init__(self, initial_timeout: float, factor: float, min_timeout: float, log_path: str | None = None,
                 on_hang: Callable[[str, float], None] | None = None, poll: float = 1.0,
                 deadline_fn: Callable[[], float | None] | None = None):
        self.initial_timeout, self.factor, self.min_timeout = initial_timeout, factor, min_timeout
        self.log_path, self.on_hang, self.poll, self.deadline_fn = log_path, on_hang, poll, deadline_fn
        self.longest: dict[str, float] = {}  # section → longest full interval seen
        self._section: str | None = None
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maxlite-watchdog", daemon=True)
        self._thread.start()

    # ---- heartbeats (called by the loop thread; cheap) ----
    def beat(self, section: str, completed: str | None = None) -> None:
        """Enter `section` now; if `completed` names the section that just ended, learn its duration."""
        now = time.monotonic()
        with self._lock:
            if completed is not None and completed == self._section:
                took = now - self._since
                self.longest[completed] = max(self.longest.get(completed, 0.0), took)
            self._section, self._since = section, now

    def idle(self) -> None:
        with self._lock:
            self._section = None

    def timeout(self, section: str) -> float:
        seen = self.longest.get(section)
        if seen is None:
            return self.initial_timeout
        return max(self.min_timeout, self.factor * seen)

    # ---- the watching thread ----
    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            with self._lock:
                section, since = self._section, self._since
            deadline = self.deadline_fn() if self.deadline_fn else None
            if deadline is not None and deadline <= 0:
                self._fire("preemption grace", self.poll, exit_codes.PREEMPT_TIMEOUT)
            if section is None:
                continue
            waited, limit = time.monotonic() - since, self.timeout(section)
            if waited > limit:
                self._fire(section, waited, exit_codes.HANG, limit)

    def _fire(self, section: str, waited: float, code: int, limit: float | None = None) -> None:
        what = (f"maxlite: hang detected in section '{section}': no heartbeat for {waited:.0f}s "
                f"(timeout {limit:.1f}s); exiting with code {code}" if limit is not None else
                f"maxlite: no safe point reached within preemption_grace_seconds; exiting with code {code}")
        report = f"{what}\n{all_stacks()}"
        print(report, file=sys.stderr, flush=True)
        if self.log_path:
            try:
                with open(self.log_path, "a") as f:
                    f.write(time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime()) + report + "\n")
            except OSError:
                pass
        if self.on_hang is not None:
            try:
                self.on_hang(section, waited)
            except Exception as e:  # noqa: BLE001 — the exit below matters more
                print(f"maxlite: on_hang failed: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)  # the loop thread is stuck: a normal exit would wait for it forever

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
