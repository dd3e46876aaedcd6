"""Fault injection from the config, for tests and demos: crash, hang, slow-down, a SIGTERM to the
process itself (what a scheduler sends on preemption) or a crash in the middle of an in-memory
snapshot, at `fault_step` on process `fault_process`.

A crash, hang or SIGTERM fires once per run directory (a marker file), so the restarted job runs through.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from maxlite.config import ConfigError

_ONCE = ("crash", "hang", "sigterm", "crash_in_snapshot")


class Faults:
    def __init__(self, cfg, run_dir: str, process_index: int):
        if cfg.fault_type == "slow" and cfg.fault_slowdown_factor < 1.0:
            raise ConfigError("fault_slowdown_factor must be >= 1.0")
        mine = bool(cfg.fault_type) and cfg.fault_step >= 0 and cfg.fault_process == process_index
        self.type = cfg.fault_type if mine else ""
        self.step, self.factor = cfg.fault_step, cfg.fault_slowdown_factor
        self.marker = os.path.join(run_dir, f".fault_{cfg.fault_type}_{cfg.fault_step}_p{process_index}")
        if self.type in _ONCE and os.path.exists(self.marker):
            self.type = ""  # already fired in an earlier attempt

    def _fire_once(self) -> None:
        os.makedirs(os.path.dirname(self.marker), exist_ok=True)
        open(self.marker, "w").close()

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
        if self.type == "hang" and step == self.step:
            self._fire_once()
            print(f"maxlite: fault injection: hang at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def slow_down(self, step: int, took: float) -> None:
        """Stretch this step's own work to `factor` × what it took."""
        if self.type == "slow" and step >= self.step and took > 0:
            time.sleep((self.factor - 1.0) * took)

    def in_snapshot(self, step: int) -> None:
        """While a snapshot of `step` is half written."""
        if self.type == "crash_in_snapshot" and step >= self.step:
            self._fire_once()
            print(f"maxlite: fault injection: crash during the snapshot of step {step}", file=sys.stderr, flush=True)
            os._exit(1)
