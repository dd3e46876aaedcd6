"""Preemption signals and the `max_time` budget: turn them into a local "please stop" flag.

The handler only records the signal (Python runs it between bytecodes, so a signal that arrives
during a long compile or a blocking device wait is handled as soon as control comes back); the
loop acts on the flag at its next safe point, after every host agreed (see `vote.py`).
"""

from __future__ import annotations

import re
import signal
import threading
import time

from maxlite.config import ConfigError


def parse_max_time(text: str) -> float | None:
    """`D:HH:MM:SS` (also `HH:MM:SS`, `MM:SS`, `SS`) → seconds; "" → None."""
    text = text.strip()
    if not text:
        return None
    if not re.fullmatch(r"\d+(:\d+){0,3}", text):
        raise ConfigError(f"max_time={text!r}: expected D:HH:MM:SS, e.g. max_time=0:03:50:00")
    seconds = 0
    for value, unit in zip(reversed([int(p) for p in text.split(":")]), (1, 60, 3600, 86400)):
        seconds += value * unit
    if seconds <= 0:
        raise ConfigError(f"max_time={text!r} must be positive (or \"\" for no limit)")
    return float(seconds)


def parse_signals(text: str) -> list[signal.Signals]:
    out = []
    for name in filter(None, (s.strip().upper() for s in text.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        if not hasattr(signal.Signals, name) or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"preemption_signals: {name} is not a catchable signal (e.g. SIGTERM,SIGUSR1)")
        out.append(signal.Signals[name])
    return out


_noted: list[tuple[int, float]] = []  # (signal, when) caught by `catch_outside_the_loop`


def catch_outside_the_loop(signals: str) -> None:
    """For a process that is only a training (`python -m maxlite.train`), from its first line: a
    signal before the loop's own handlers exist is handed to them (the run stops at its first safe
    point), and one after the run ended is noted instead of killing the finished process (143)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def note(signum, frame) -> None:
        _noted.append((signum, time.monotonic()))

    for sig in parse_signals(signals):
        signal.signal(sig, note)


def noted_signal() -> str | None:
    return signal.Signals(_noted[-1][0]).name if _noted else None


class Preemption:
    """Catches the configured signals; knows when `max_time` is about to run out."""

    def __init__(self, signals: str, max_time: str, grace_seconds: float, started: float | None = None):
        self.started = time.monotonic() if started is None else started
        self.max_time = parse_max_time(max_time)
        self.grace_seconds = grace_seconds
        self.signum: int | None = None
        self.signal_time: float | None = None
        self._previous: dict[int, object] = {}
        self.armed = False  # our handlers are installed (only possible from the main thread)
        self._signals = parse_signals(signals)
        self.arm()
        if _noted:  # it came before these handlers did (process start-up): act on it now
            self._handle(_noted[-1][0], None)
            _noted.clear()

    def arm(self) -> None:
        """(Re)install the handlers. `jax.distributed.initialize` installs its own SIGTERM handler
        (JAX's preemption notifier), so call this again once it has run."""
        if threading.current_thread() is not threading.main_thread():  # handlers only from the main thread
            return
        for sig in self._signals:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        self.armed = True

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self.signal_time = signum, time.monotonic()
            print(f"maxlite: got {signal.Signals(signum).name}: saving at the next safe point "
                  f"(grace {self.grace_seconds:.0f}s)", flush=True)

    def reason(self, reserve_seconds: float = 0.0) -> str | None:
        """'preempted' after a signal; 'max_time' when less than `reserve_seconds` (time to reach a
        safe point and save) remain; else None."""
        if self.signum is not None:
            return "preempted"
        if self.max_time is not None and time.monotonic() - self.started + reserve_seconds >= self.max_time:
            return "max_time"
        return None

    def grace_left(self) -> float | None:
        if self.signal_time is None:
            return None
        return self.grace_seconds - (time.monotonic() - self.signal_time)

    def restore_handlers(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)  # None: set from C
        self._previous.clear()
