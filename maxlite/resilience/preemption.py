"""Preemption signals, Ctrl-C and the `max_time` budget: turn them into a local "please stop" flag.

The handler only records the signal (Python runs it between bytecodes, so a signal that arrives
during a long compile or a blocking device wait is handled as soon as control comes back); the
loop acts on the flag at its next safe point, after every host agreed (see `vote.py`).

SIGINT (Ctrl-C) is always the user's stop: the first one stops the run the way a preemption does
(a save at the next step every host agrees on, status `stopped`, exit 130, not restarted); a second
one raises KeyboardInterrupt at once (out without a save; the last complete checkpoint stands).
"""

from __future__ import annotations

import signal
import threading
import time

_noted: list[tuple[int, float]] = []  # (signal, when) caught by `catch_outside_the_loop`


def _stop_signals(signals: list[signal.Signals]) -> list[signal.Signals]:
    return [*signals, signal.SIGINT]


def catch_outside_the_loop(signals: list[signal.Signals]) -> None:
    """For a process that is only a training (`python -m maxlite.train`), from its first line: a
    signal before the loop's own handlers exist is handed to them (the run stops at its first safe
    point), and one after the run ended is noted instead of killing the finished process (143)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def note(signum, frame) -> None:
        if signum == signal.SIGINT and any(s == signal.SIGINT for s, _ in _noted):
            raise KeyboardInterrupt  # a second Ctrl-C: the user means it
        _noted.append((signum, time.monotonic()))

    for sig in _stop_signals(signals):
        signal.signal(sig, note)


def noted_signal() -> str | None:
    return signal.Signals(_noted[-1][0]).name if _noted else None


class Preemption:
    """Catches the configured preemption signals and SIGINT; knows when `max_time` is about to run out."""

    def __init__(self, signals: list[signal.Signals], max_time: float | None, grace_seconds: float,
                 started: float | None = None):
        self.started = time.monotonic() if started is None else started
        self.max_time = max_time
        self.grace_seconds = grace_seconds
        self.signum: int | None = None
        self.signal_time: float | None = None
        self._previous: dict[int, object] = {}
        self.armed = False  # our handlers are installed (only possible from the main thread)
        self._signals = _stop_signals(signals)
        self.arm()
        for signum, _ in list(_noted):  # they came before these handlers did (process start-up): act now
            self._handle(signum, None)
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
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            print("maxlite: Ctrl-C again: stopping now, without a save", flush=True)
            raise KeyboardInterrupt
        if self.signum is None or signum == signal.SIGINT:  # the user's stop outranks a preemption
            first = self.signum is None
            self.signum, self.signal_time = signum, self.signal_time or time.monotonic()
            if signum == signal.SIGINT:
                print("maxlite: Ctrl-C: saving at the next step every host agrees on, then stopping "
                      "(Ctrl-C again: stop at once, without a save)", flush=True)
            elif first:
                print(f"maxlite: got {signal.Signals(signum).name}: saving at the next safe point "
                      f"(grace {self.grace_seconds:.0f}s)", flush=True)

    def reason(self, reserve_seconds: float = 0.0) -> str | None:
        """'interrupted' after Ctrl-C, 'preempted' after another signal; 'max_time' when less than
        `reserve_seconds` (time to reach a safe point and save) remain; else None."""
        if self.signum is not None:
            return "interrupted" if self.signum == signal.SIGINT else "preempted"
        if self.max_time is not None and time.monotonic() - self.started + reserve_seconds >= self.max_time:
            return "max_time"
        return None

    def grace_left(self) -> float | None:
        """Seconds left to reach a safe point after a preemption signal (None: no deadline; the
        user's Ctrl-C has none: a second one is theirs to press)."""
        if self.signal_time is None or self.signum == signal.SIGINT:
            return None
        return self.grace_seconds - (time.monotonic() - self.signal_time)

    def restore_handlers(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)  # None: set from C
        self._previous.clear()
