"""Fault injection from the config, for tests and demos: crash, hang, slow-down, starve (the
process keeps computing, as a starved or compiling one does, for 3× its watchdog's step timeout:
slow, not hung), a SIGTERM to the process itself (what a scheduler sends on preemption), a crash in the middle of an in-memory
snapshot or in the middle of a checkpoint save (its files half written, never renamed complete), a
batch whose loss is not finite (nan: its rows' weights), a pause of `fault_pause_seconds` (a known
stall), at `fault_step` on process `fault_process`.

A crash, hang, starve, SIGTERM, nan or pause fires once per run directory (a marker file in the run directory, local or
gs://), so the restarted job runs through.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import fsspec

_ONCE = ("crash", "hang", "starve", "sigterm", "crash_in_snapshot", "crash_in_checkpoint", "nan", "pause")


class Faults:
    def __init__(self, cfg, run_dir: str, process_index: int, sleep=time.sleep):
        """`sleep`: how a slowed step waits (tests inject a clock's)."""
        mine = bool(cfg.fault_type) and cfg.fault_process == process_index  # config: fault_step >= 0
        self.type = cfg.fault_type if mine else ""
        self.step, self.factor, self.pause = cfg.fault_step, cfg.fault_slowdown_factor, cfg.fault_pause_seconds
        self.marker = f"{run_dir.rstrip('/')}/.fault_{cfg.fault_type}_{cfg.fault_step}_p{process_index}"
        if self.type in _ONCE and fsspec.url_to_fs(self.marker)[0].exists(self.marker):
            self.type = ""  # already fired in an earlier attempt
        # the step at which some process's injected crash fires in this attempt (-1: none), known to
        # every process, so all of them can meet at one defined point before it (Resilience.step_end)
        target = f"{run_dir.rstrip('/')}/.fault_crash_{cfg.fault_step}_p{cfg.fault_process}"
        self.crash_step = (cfg.fault_step if cfg.fault_type == "crash"
                           and not fsspec.url_to_fs(target)[0].exists(target) else -1)
        self.step_timeout = lambda: 0.0  # starve: the watchdog's current step timeout (Resilience sets it)
        self.sleep = sleep

    def _fire_once(self) -> None:
        fs, path = fsspec.url_to_fs(self.marker)
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, b"")

    def at_step(self, step: int) -> None:
        """After `step` was dispatched: crash or hang here."""
        if self.type == "crash" and step == self.step:
            self._fire_once()
            print(f"maxlite: fault injection: crash at step {step}", file=sys.stderr, flush=True)
            os._exit(1)  # like a killed process: no cleanup, no final save
        if self.type == "sigterm" and step == self.step:
            self._fire_once()
            print(f"maxlite: fault injection: SIGTERM to this process at step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # handled like a scheduler's: a save at an agreed step
        if self.type == "starve" and step == self.step:
            self._fire_once()
            seconds = 3 * self.step_timeout()
            print(f"maxlite: fault injection: starve at step {step}: computing for {seconds:.0f}s", file=sys.stderr,
                  flush=True)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                sum(i * i for i in range(10_000))
        if self.type == "pause" and step == self.step:  # a known stall: where the peers' goodput puts it
            self._fire_once()
            print(f"maxlite: fault injection: pause of {self.pause:g}s at step {step}", file=sys.stderr, flush=True)
            time.sleep(self.pause)
        if self.type == "hang" and step == self.step:
            self._fire_once()
            print(f"maxlite: fault injection: hang at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def corrupt(self, step: int, batch: dict, prefix: str = "") -> dict:
        """This process's rows of the batch of step `step` (a count: its loss is logged as `step`);
        nan: NaN loss weights (the `prefix`ed ones: what the step trains on), so the step's loss is
        not finite. Rows without loss weights (GRPO's prompts: its sampled rows come later) are
        left alone, and the fault waits for the rows that have them."""
        poisoned = [k for k in batch if k.startswith(prefix) and k.endswith("weights")]
        if self.type == "nan" and step == self.step and poisoned:
            self._fire_once()
            self.type = ""  # the step runs again after the rollback: with good data
            print(f"maxlite: fault injection: a non-finite loss at step {step}", file=sys.stderr, flush=True)
            import numpy as np
            return {k: np.full_like(v, np.nan) if k in poisoned else v for k, v in batch.items()}
        return batch

    def slow_down(self, step: int, took: float) -> None:
        """Stretch this step's own work to `factor` × what it took."""
        if self.type == "slow" and step >= self.step and took > 0:
            self.sleep((self.factor - 1.0) * took)

    def armed_in_checkpoint(self) -> bool:
        return self.type == "crash_in_checkpoint"

    def in_checkpoint(self, step: int) -> None:
        """A checkpoint save of `step` has written its files and is not yet complete (Orbax's
        commit is next): dying here leaves exactly what a kill in the middle of a save leaves."""
        if self.type == "crash_in_checkpoint" and step == self.step:
            self._fire_once()
            print(f"maxlite: fault injection: crash during the checkpoint save of step {step}",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def in_snapshot(self, step: int) -> None:
        """While a snapshot of `step` is half written."""
        if self.type == "crash_in_snapshot" and step >= self.step:
            self._fire_once()
            print(f"maxlite: fault injection: crash during the snapshot of step {step}", file=sys.stderr, flush=True)
            os._exit(1)
