"""Hang watchdog: one thread per process watching heartbeats of named sections.

Sections are `setup`, `step`, `eval` and `checkpoint`. A section's timeout is
`watchdog_initial_timeout` until one full interval of it was seen (setup, the first compiling
step, the first eval/save), then `max(watchdog_min_timeout, watchdog_factor × longest seen)`.

Past its timeout a section is hung only if no work was done meanwhile: a process that used at
least MIN_WORK_SHARE of a core over the last timeout's span (at least SPAN_SECONDS) — itself
(compiling a new program, writing a checkpoint, starved by a loaded machine) or its peers (one it
waits for) — is slow, not hung (resilience/progress.py), and is said so once; it is given up to
SLOW_CAP × the timeout. On a hang every thread's stack goes to stderr and
`{run_dir}/hang_p{process}.log`, `on_hang` runs (status.json), and the process exits with the code
maxlite.outcome gives a hang, so Ray/Slurm restart the job.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import traceback
from typing import Callable

from maxlite import outcome

MIN_WORK_SHARE = 0.05  # CPU seconds per second over the timeout's span that count as progress
SLOW_CAP = 10.0  # a section still working is hung after this × its timeout all the same


def all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    def __init__(self, initial_timeout: float, factor: float, min_timeout: float, log_path: str | None = None,
                 on_hang: Callable[[str, float, str], None] | None = None, poll: float = 1.0,
                 deadline_fn: Callable[[], float | None] | None = None,
                 progress: Callable[[], float] | None = None, clock: Callable[[], float] = time.monotonic,
                 start: bool = True):
        """`progress()`: work done so far by this process and its peers, in CPU seconds
        (resilience/progress.py), judged over at least SPAN_SECONDS (the peers' figures arrive
        late); `clock`: seconds; `start=False`: no thread (tests call `check`)."""
        from maxlite.resilience.progress import SPAN_SECONDS, Progress

        self.initial_timeout, self.factor, self.min_timeout = initial_timeout, factor, min_timeout
        self.log_path, self.on_hang, self.poll, self.deadline_fn = log_path, on_hang, poll, deadline_fn
        self.progress, self.clock = progress or Progress(), clock
        self.min_span = SPAN_SECONDS
        self.longest: dict[str, float] = {}  # section → longest full interval seen
        self._section: str | None = None
        self._since = clock()
        self._samples: collections.deque = collections.deque()  # (time, progress), one per poll
        self._said_slow: tuple | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maxlite-watchdog", daemon=True)
        if start:
            self._thread.start()

    # ---- heartbeats (called by the loop thread; cheap) ----
    def beat(self, section: str, completed: str | None = None) -> None:
        """Enter `section` now; if `completed` names the section that just ended, learn its duration."""
        now = self.clock()
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

    def work_in(self, span: float) -> float:
        """Work done (CPU seconds, this process and its peers) over the last `span` seconds of samples."""
        if not self._samples:
            return 0.0
        now, latest = self._samples[-1]
        before = self._samples[0][1]
        for t, p in self._samples:
            if t > now - span:
                break
            before = p
        return latest - before

    def check(self) -> tuple[str, float, float] | None:
        """One look: (section, waited, timeout) when it is hung, else None (slow sections are said once)."""
        now = self.clock()
        self._samples.append((now, self.progress()))
        with self._lock:
            section, since = self._section, self._since
        if section is None:
            return None
        waited, limit = now - since, self.timeout(section)
        while self._samples and self._samples[0][0] < now - 2 * max(limit, waited, self.min_span):
            self._samples.popleft()
        if waited <= limit:
            return None
        span = max(limit, self.min_span)
        worked = self.work_in(span)
        if worked < MIN_WORK_SHARE * span or waited > SLOW_CAP * limit:
            return section, waited, limit
        if self._said_slow != (section, since):
            self._said_slow = (section, since)
            print(f"maxlite: watchdog: section '{section}' has run {waited:.0f}s, past its {limit:.1f}s "
                  f"timeout, but this process and its peers did {worked:.1f} CPU-s of work in the last "
                  f"{span:.0f}s: slow, not hung; waiting up to {SLOW_CAP * limit:.0f}s", file=sys.stderr, flush=True)
        return None

    # ---- the watching thread ----
    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            deadline = self.deadline_fn() if self.deadline_fn else None
            if deadline is not None and deadline <= 0:
                self._fire("preemption grace", self.poll, "preempt_timeout")
            hung = self.check()
            if hung is not None:
                self._fire(*hung[:2], "hang", hung[2])

    def _fire(self, section: str, waited: float, reason: str, limit: float | None = None) -> None:
        """`on_hang(section, waited, reason)` (status.json), then out with the reason's exit code."""
        code = outcome.decide(reason).code
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
                self.on_hang(section, waited, reason)
            except Exception as e:  # noqa: BLE001 — the exit below matters more
                print(f"maxlite: on_hang failed: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)  # the loop thread is stuck: a normal exit would wait for it forever

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
