"""Resilience for long runs, driven by the loop through one `Resilience` object.

Preemption and `max_time` (preemption.py), the hang watchdog (watchdog.py), straggler scores
(straggler.py), checkpointless in-memory recovery (snapshot.py + keeper.py), goodput
(goodput.py) and fault injection (faults.py). Exit codes: exit_codes.py. Every host reaches the
same decision at the same step through a tiny gather read one sync step late (vote.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from maxlite.resilience import exit_codes
from maxlite.resilience.faults import Faults
from maxlite.resilience.goodput import Goodput
from maxlite.resilience.preemption import Preemption
from maxlite.resilience.straggler import StepTimer, format_report, report
from maxlite.resilience.watchdog import Watchdog

STOP_CODES = {0: None, 1: "max_time", 2: "preempted", 3: "straggler"}
_CODE_OF = {v: k for k, v in STOP_CODES.items() if v}
SAVE_NOW = "save_now"  # step_end's answer to a preemption notice: checkpoint now, keep training


@dataclass
class Restored:
    state: Any
    data_state: Any
    step: int
    source: str  # "memory"
    detail: str  # own shards | replica from peer host N
    seconds: float


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Resilience:
    """Create first thing in `train()` (signals are caught from then on, setup is watched)."""

    def __init__(self, cfg, started: float | None = None, log: Callable[[str], None] | None = None,
                 notice: Callable[[], str | None] | None = None, keeper: Callable | None = None):
        """`notice()`: a launcher's polled preemption notice (e.g. Ray's node-drain info) — a line
        describing it, or None. Unlike a signal it does not stop the run: every host saves a
        checkpoint at the same step and trains on until the launcher restarts the job elsewhere.
        `keeper(run_dir, rank)`: a launcher's in-memory snapshot keeper (Ray: detached actors)."""
        self.cfg = cfg
        self._launcher_keeper = keeper
        self._notice, self._notice_seen = notice, False
        self._jax_sync = False
        self.started = time.monotonic() if started is None else started
        self._log = log or (lambda m: print(m, flush=True))
        self.preemption = Preemption(cfg.preemption_signals, cfg.max_time, cfg.preemption_grace_seconds, self.started)
        self.watchdog = (Watchdog(cfg.watchdog_initial_timeout, cfg.watchdog_factor, cfg.watchdog_min_timeout,
                                  on_hang=self._on_hang, deadline_fn=self.preemption.grace_left)
                         if cfg.watchdog else None)
        if self.watchdog:
            self.watchdog.beat("setup")
        self.timer = StepTimer()
        self.primary, self.run_dir, self.process_index = True, None, 0
        self.vote = self.snapshots = self.faults = self.goodput = None
        self.on_status: Callable[..., None] | None = None
        self.scores: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._steps_this_attempt = 0
        self._last_report = time.monotonic()
        self._step_started: float | None = None
        self._data_wait = 0.0
        self._setup_done = False

    # ---- setup ----
    def attach(self, run_dir: str, mesh, shardings=None, primary: bool = True,
               on_status: Callable[..., None] | None = None) -> None:
        """After the mesh and run directory exist (and `jax.distributed` is up): the cross-host
        vote, faults, and — with `inmemory_snapshot_period` > 0 — the keeper and snapshots
        (`shardings`: the TrainState of NamedShardings)."""
        import jax

        from maxlite.resilience.keeper import make_keeper
        from maxlite.resilience.snapshot import Snapshots
        from maxlite.resilience.vote import Vote

        cfg = self.cfg
        self.preemption.arm()  # after jax.distributed.initialize, which takes SIGTERM for itself
        self.run_dir, self.primary, self.on_status = run_dir, primary, on_status
        self.process_index = jax.process_index()
        # With jax.distributed up and our handlers not installable (Ray Train runs the loop off the
        # main thread), JAX's own SIGTERM handler stays: its coordination service then picks a
        # step every host stops at (`reached_preemption_sync_point`, asked every step).
        self._jax_sync = jax.process_count() > 1 and not self.preemption.armed
        local = "://" not in run_dir
        if local:
            os.makedirs(run_dir, exist_ok=True)
        if self.watchdog and local:
            self.watchdog.log_path = os.path.join(run_dir, f"hang_p{self.process_index}.log")
        self.faults = Faults(cfg, run_dir if local else "/tmp/maxlite-faults", self.process_index)
        self.goodput = Goodput(os.path.join(run_dir, "goodput.json") if (local and primary) else None, self.started)
        self.vote = Vote(8)
        if cfg.inmemory_snapshot_period > 0 and shardings is not None:
            keeper = make_keeper(cfg.inmemory_snapshot_keeper, run_dir, self.process_index, self._launcher_keeper)
            max_bytes = cfg.inmemory_snapshot_max_bytes or _host_memory() // 4
            self.snapshots = Snapshots(mesh, shardings, keeper, period=cfg.inmemory_snapshot_period,
                                       max_bytes=max_bytes, faults=self.faults, log=self._log)

    def restore(self, abstract_state, newer_than: int = -1) -> Restored | None:
        """Collective. The newest in-memory snapshot complete across hosts, if newer than the disk
        checkpoint's step `newer_than` (a tie goes to memory: it is faster); else None → use disk."""
        if self.snapshots is None:
            return None
        t = time.perf_counter()
        got = self.snapshots.restore(self.vote, abstract_state)
        if got is None or got[2] < newer_than:
            where = "none complete on all hosts" if got is None else f"step {got[2]} older than disk"
            if self.primary:
                self._log(f"maxlite: in-memory snapshot: {where}; starting from the disk checkpoint "
                          f"(step {newer_than})" if newer_than >= 0 else
                          f"maxlite: in-memory snapshot: {where}; no disk checkpoint either: a fresh start")
            return None
        import jax
        state, data_state, step, detail = got
        jax.block_until_ready(state)
        r = Restored(state, data_state, step, "memory", detail, time.perf_counter() - t)
        self._log(f"maxlite: restored step {step} from memory ({detail}, {self.snapshots.keeper.where}) "
                  f"in {r.seconds:.2f}s")
        return r

    def setup_end(self) -> None:
        if self.goodput:
            self.goodput.add("startup", time.monotonic() - self.started)
        self._setup_done = True
        if self.watchdog:
            self.watchdog.beat("step")

    # ---- the step ----
    def step_begin(self, step: int) -> None:
        now = time.monotonic()
        if self.watchdog:
            self.watchdog.beat("step", completed="step" if self._steps_this_attempt >= 2 else None)
        self._step_started = now
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

    def step_end(self, step: int, state=None, data_state: Callable[[], Any] | Any = None) -> str | None:
        """After step `step` (= steps done) was dispatched and the previous metrics read.

        Takes a due snapshot of `state` (+ data state, a dict or a callable returning it), fires
        injected faults, and returns the stop reason every host agreed on at this step (or None):
        'preempted', 'max_time' (save, exit 0) or 'straggler' (exit 76) — or SAVE_NOW after a
        launcher's preemption notice (save at this step and go on)."""
        cfg = self.cfg
        self._steps_this_attempt += 1
        compiling = self._steps_this_attempt == 1
        if self.faults:
            self.faults.at_step(step)
        took = self.timer.end(skip=compiling)
        if self.faults and took is not None:
            t = time.perf_counter()
            self.faults.slow_down(step, took)
            if not compiling and self.timer.window:
                self.timer.window[-1] += time.perf_counter() - t  # the slowed work is own work
        if self.goodput and self._step_started is not None:
            self.goodput.step(step, time.monotonic() - self._step_started, self._data_wait, compiling)
        if self.snapshots is not None and state is not None and self.snapshots.due(step):
            ds = data_state() if callable(data_state) else data_state
            self.snapshots.take(step, state, ds)
        if self._jax_sync and self._jax_preempted(step):
            return "preempted"
        if self.vote is None or step % max(1, cfg.resilience_sync_period):
            return None
        return self._sync(step)

    def _reserve_seconds(self) -> float:
        longest = self.watchdog.longest if self.watchdog else {}
        return 2 * longest.get("step", 0.0) * max(1, self.cfg.resilience_sync_period) + longest.get("checkpoint", 60.0)

    def _jax_preempted(self, step: int) -> bool:
        from jax.experimental import multihost_utils

        if not multihost_utils.reached_preemption_sync_point(step):
            return False
        self._log(f"maxlite: a process of this job got SIGTERM (JAX's preemption service): every host "
                  f"stops at step {step}")
        self.preemption.signal_time = self.preemption.signal_time or time.monotonic()  # the grace counts
        return True

    def _noticed(self, step: int) -> float:
        """1.0 the first time the launcher's notice is seen on this host, else 0.0."""
        if self._notice is None or self._notice_seen:
            return 0.0
        text = self._notice()
        if not text:
            return 0.0
        self._notice_seen = True
        self._log(f"maxlite: {text}: saving a checkpoint at the next agreed step (after step {step}); "
                  f"training goes on until the job is restarted")
        return 1.0

    def _sync(self, step: int) -> str | None:
        local = self.preemption.reason(self._reserve_seconds())
        due = self.process_index == 0 and time.monotonic() - self._last_report >= self.cfg.straggler_report_interval
        if due:
            self._last_report = time.monotonic()  # ask once; the report comes one sync step later
        best = self.timer.best_median or 0.0
        with self.device_wait():  # reading the last vote waits for the slowest host: not own work
            table = self.vote.post([_CODE_OF.get(local, 0), float(due), self.timer.median(), best,
                                    self._noticed(step), 0, 0, 0])
        if table is None:
            return None
        code = int(table[:, 0].max())
        if table[:, 1].max() > 0:
            code = max(code, self._straggler_report(step, table))
        if code == 0 and table[:, 4].max() > 0:  # a host got the notice: every host saves at this step
            self._notice_seen = True  # one notice-save per attempt (a restart starts afresh)
            return SAVE_NOW
        return STOP_CODES[code]

    def _straggler_report(self, step: int, table) -> int:
        rep = report(table[:, 2], table[:, 3], self.cfg.straggler_threshold)
        self._last_report = time.monotonic()
        self.timer.roll()
        me = self.process_index
        self.scores = {"straggler_relative_score": rep["relative"][me],
                       "straggler_individual_score": rep["individual"][me],
                       "straggler_min_relative_score": min(rep["relative"]),
                       "straggler_min_individual_score": min(rep["individual"]),
                       "stragglers": len(rep["stragglers"])}
        if self.primary:
            self._log(format_report(step, rep))
            if self.run_dir and "://" not in self.run_dir:
                with open(os.path.join(self.run_dir, "stragglers.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, "time": time.time(), **rep}) + "\n")
        return _CODE_OF["straggler"] if (rep["stragglers"] and self.cfg.stop_if_straggler) else 0

    # ---- other sections ----
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
            if self.goodput and name in ("eval", "checkpoint"):
                self.goodput.add(name, time.monotonic() - t)
            if self.watchdog:
                self.watchdog.beat("step", completed=name if seen >= 1 else None)  # 1st one compiles
            if self._step_started is not None:
                self._step_started += time.monotonic() - t  # not part of the step interval

    def metrics(self) -> dict[str, float]:
        """Fields for the metrics record (straggler scores after a report; goodput so far)."""
        out = dict(self.scores)
        if self.goodput:
            out["goodput"] = self.goodput.summary()["goodput"]
        return out

    # ---- the end ----
    def _on_hang(self, section: str, waited: float) -> None:
        if self.on_status is not None:
            self.on_status("failed", error=f"hang in {section}: no heartbeat for {waited:.0f}s",
                           exit_code=exit_codes.HANG)

    def finish(self, reason: str | None) -> tuple[int, str, dict]:
        """(exit code, status.json state, summary fields); stops the watchdog; clears the keeper when
        the run is finished (nothing left to recover)."""
        if self.snapshots is not None:
            self.snapshots.wait()
            if reason is None:
                self.snapshots.keeper.clear()
        if self.watchdog:
            self.watchdog.close()
        self.preemption.restore_handlers()
        fields = self.goodput.summary() if self.goodput else {}
        if self.goodput:
            self.goodput.save()
        if reason is None:
            return exit_codes.FINISHED, "finished", fields
        if reason in ("preempted", "max_time"):
            return exit_codes.PREEMPTED, "preempted", {**fields, "reason": reason}
        return exit_codes.STRAGGLER, "failed", {**fields, "reason": reason}

    def close(self) -> None:
        """On an exception: stop the watchdog thread and give the signals back (keeper kept)."""
        if self.snapshots is not None:
            self.snapshots.wait()
        if self.watchdog:
            self.watchdog.close()
        self.preemption.restore_handlers()
        if self.goodput:
            self.goodput.save()
