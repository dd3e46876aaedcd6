"""The loop's one handle on resilience, composed of one object per idea:

- `Clock` (clock.py): watchdog heartbeats, the step timer, goodput, timed sections; the
  watchdog judges a late section by the work done meanwhile (`Progress`, progress.py);
- `StopVote` (stops.py): the cross-host stop/save vote (signals, max_time, stragglers, notices);
- `Snapshots` (snapshot.py + keeper.py): in-memory checkpointless copies, restored by
  `maxlite.resume` through `restore()`;
- `Faults` (faults.py): injected crashes, hangs, slow-downs, starvation for tests and demos.

How a run ends (exit codes, status, what a launcher does next): maxlite/outcome.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from maxlite import outcome
from maxlite.resilience.clock import Clock
from maxlite.resilience.faults import Faults
from maxlite.resilience.progress import Progress
from maxlite.resilience.preemption import Preemption
from maxlite.resilience.stops import StopVote
from maxlite.resilience.watchdog import Watchdog


@dataclass
class Restored:
    state: Any
    data_state: Any
    step: int
    source: str  # "memory"
    detail: str  # own shards | replica from peer host N
    seconds: float


def _host_memory() -> int:
    from maxlite import hostmem
    return hostmem.memory().limit  # the container's limit when it is tighter than the machine


class Resilience:
    """Create first thing in `train()` (signals are caught from then on, setup is watched)."""

    def __init__(self, cfg, started: float | None = None, log: Callable[[str], None] | None = None,
                 notice: Callable[[], str | None] | None = None, keeper: Callable | None = None,
                 stop_request: Callable[[], str | None] | None = None):
        """`notice()`: a launcher's polled preemption notice (e.g. Ray's node-drain info) — a line
        describing it, or None. Unlike a signal it does not stop the run: every host saves a
        checkpoint at the same step and trains on until the launcher restarts the job elsewhere.
        `keeper(run_dir, rank)`: a launcher's in-memory snapshot keeper (Ray: detached actors).
        `stop_request()`: a launcher's polled request to stop as Ctrl-C does (stops.py)."""
        self.cfg = cfg
        self._launcher_keeper = keeper
        self.started = time.monotonic() if started is None else started
        self._log = log or (lambda m: print(m, flush=True))
        self.preemption = Preemption(cfg.preemption_signal_numbers, cfg.max_time_seconds,
                                     cfg.preemption_grace_seconds, self.started)
        self.progress = Progress()  # the watchdog's measure of work: own, and the peers' once attached
        watchdog = (Watchdog(cfg.watchdog_initial_timeout, cfg.watchdog_factor, cfg.watchdog_min_timeout,
                             on_hang=self._on_hang, deadline_fn=self.preemption.grace_left,
                             progress=self.progress)
                    if cfg.watchdog else None)
        self.clock = Clock(self.started, watchdog)
        self.stops = StopVote(cfg, self.preemption, self.clock, notice, self._log, stop_request)
        self.primary, self.run_dir, self.process_index = True, None, 0
        self.vote = self.snapshots = self.faults = None
        self.on_status: Callable[..., None] | None = None

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
        local = "://" not in run_dir
        if local:
            os.makedirs(run_dir, exist_ok=True)
        self.progress.share()  # jax.distributed is connected by now
        if self.clock.watchdog and local:
            self.clock.watchdog.log_path = os.path.join(run_dir, f"hang_p{self.process_index}.log")
        self.faults = Faults(cfg, run_dir, self.process_index)
        if self.clock.watchdog:
            self.faults.step_timeout = lambda: self.clock.watchdog.timeout("step")
        self.clock.attach(run_dir, primary)
        self.vote = Vote(8)
        self.stops.attach(self.vote, primary, self.process_index, run_dir,
                          jax_sync=jax.process_count() > 1 and not self.preemption.armed)
        if cfg.inmemory_snapshot_period > 0 and shardings is not None:
            keeper = make_keeper(cfg.inmemory_snapshot_keeper, run_dir, self.process_index, self._launcher_keeper)
            max_bytes = cfg.inmemory_snapshot_max_bytes or _host_memory() // 4
            self.snapshots = Snapshots(mesh, shardings, keeper, period=cfg.inmemory_snapshot_period,
                                       max_bytes=max_bytes, faults=self.faults, log=self._log)

    def restore(self, abstract_state, newer_than: int = -1, at_most: int | None = None) -> Restored | None:
        """Collective. The newest in-memory snapshot complete across hosts (of a step <= `at_most`
        when given), if newer than the disk checkpoint's step `newer_than` (a tie goes to memory: it
        is faster); else None → use disk."""
        if self.snapshots is None:
            return None
        t = time.perf_counter()
        self.snapshots.wait()  # one being written now is complete first
        got = self.snapshots.restore(self.vote, abstract_state, at_most)
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
        self.clock.setup_end()

    # ---- the step: the clock's parts, used by the loop by name ----
    def step_begin(self, step: int) -> None:
        self.clock.step_begin()

    def data_wait(self):
        return self.clock.data_wait()

    def device_wait(self):
        return self.clock.device_wait()

    def section(self, name: str, productive: bool = False):
        return self.clock.section(name, productive)

    def train_rows(self, step: int, rows: dict, prefix: str = "") -> dict:
        """This process's rows that step `step` (a count) trains on, before they become a global
        batch: where they are laid out — the loop for the data's rows (`prefix`: the objective's share
        of them), GRPO for its sampled ones — hands them here; an injected `nan` poisons them."""
        return self.faults.corrupt(step, rows, prefix) if self.faults else rows

    def step_end(self, step: int) -> None:
        """After step `step` (= steps done) was dispatched and the previous metrics read, before the
        hooks (eval, checkpoint, snapshot: their time is their own): fires injected faults, times
        the step."""
        if self.faults:
            if self.snapshots is not None and step == self.faults.crash_step:
                # An injected crash lands at one defined point: after the last snapshot is written on
                # every host. Each host waits for its own write, then all meet; only then does the
                # target crash. Without the wait the crash raced the crashing host's write (the
                # survivor's exchange failed: "Gloo ... Connection closed by peer"); without the
                # meeting it raced the survivor's (on a slow CPU with the Ray keeper, the survivor
                # was still handing step 6 to its keeper when it was stopped, so a restart found 4).
                self.snapshots.wait()
                import jax
                if jax.process_count() > 1:
                    from jax.experimental import multihost_utils
                    multihost_utils.sync_global_devices(f"maxlite: before the injected crash at step {step}")
            self.faults.at_step(step)
        self.clock.step_end(step, self.faults)

    def step_abandoned(self) -> None:
        """The step begun last is dropped by a rollback: its time is the rollback's."""
        self.clock.step_abandoned()

    def loop_end(self) -> None:
        """After the loop's last read (the last step's time ends there)."""
        self.clock.loop_end()

    def decide(self, step: int) -> str | None:
        """After the hooks: the vote's answer at this step, the same on every host (stops.py)."""
        return self.stops.decide(step)

    @property
    def scores(self) -> dict[str, float]:
        return self.stops.scores

    def metrics(self) -> dict[str, float]:
        """Fields for the metrics record (straggler scores after a report; goodput so far)."""
        out = dict(self.stops.scores)
        if self.clock.goodput:
            out["goodput"] = self.clock.goodput.summary()["goodput"]
        return out

    # ---- the end ----
    def _on_hang(self, section: str, waited: float, reason: str) -> None:
        if self.on_status is not None:
            what = (f"hang in {section}: no heartbeat for {waited:.0f}s" if reason == "hang" else
                    f"no safe point within preemption_grace_seconds ({waited:.0f}s)")
            self.on_status("failed", outcome=outcome.decide(reason), error=what)

    def finish(self, reason: str | None) -> dict:
        """The goodput summary's fields; stops the watchdog; clears the keeper when the run is
        finished (nothing left to recover)."""
        if self.snapshots is not None:
            self.snapshots.wait()
            if reason is None:
                self.snapshots.keeper.clear()
        fields = self.clock.close(finished=reason is None, save=reason != "lease_lost")
        self.preemption.restore_handlers()
        return fields

    def close(self) -> None:
        """On an exception: stop the watchdog thread and give the signals back (keeper kept)."""
        if self.snapshots is not None:
            self.snapshots.wait()
        self.clock.close()
        self.preemption.restore_handlers()
