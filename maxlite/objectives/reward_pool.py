"""Reward functions (and rollout tools, maxlite/rollout/tools.py) run in worker processes, so that
one that raises, kills its process or hangs costs the completions it was scoring (the caller scores
them 0, or answers the model an error, and counts them), never the run.

A task is one call of a function by name, `(name, args)` or `(name, args, kwargs)`; the worker
turns its result into what goes back with the pool's `convert` (reward functions: a list of floats,
NOT_NUMBERS when it is not; tools: `str`). Its time limit (`timeout_seconds`) starts when a
ready worker receives it: a worker's start (a fresh interpreter importing the functions' modules,
sympy for math_verify) never counts, nor does waiting for a free worker. A worker that runs past
the limit is killed and a fresh one started; one that dies mid-task (os._exit, a segfault, the OOM
killer) is replaced the same way. Workers are spawned, never forked: the trainer holds JAX's
threads. They ignore Ctrl-C (the trainer decides) and exit when the trainer's process is gone.
"""

from __future__ import annotations

import collections
import importlib
import multiprocessing
import os
import signal
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, NamedTuple

OK, RAISED, TIMEOUT, CRASHED, NOT_NUMBERS = "ok", "raised", "timeout", "crashed", "not_numbers"
START_SECONDS = 300.0  # a worker that has not imported the functions by then is broken, not slow


class Outcome(NamedTuple):
    status: str  # OK | RAISED | TIMEOUT | CRASHED | NOT_NUMBERS
    value: Any = None  # OK: the floats; RAISED: "Type: message"; CRASHED: the exit code; NOT_NUMBERS: the type


def resolve(name: str):
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(0)


def floats(result) -> list[float]:
    """A reward function's answer: one float per completion (TypeError / ValueError: NOT_NUMBERS)."""
    return [float(v) for v in result]


def _serve(conn, names: list[str], convert) -> None:
    """A worker: load the functions, say ready, then answer (name, args[, kwargs]) → (status, value)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, daemon=True).start()  # a hung worker outlives no trainer
    try:
        fns = {name: resolve(name) for name in names}
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which stops with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        name, args, kwargs = task if len(task) == 3 else (*task, {})
        try:
            result = fns[name](*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the function's own failure: counted by the caller
            conn.send((RAISED, f"{type(e).__name__}: {e}"[:500]))
            continue
        try:
            conn.send((OK, convert(result)))
        except (TypeError, ValueError):
            conn.send((NOT_NUMBERS, type(result).__name__))


class _Worker:
    def __init__(self, ctx, names: list[str], convert, what: str):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, names, convert), daemon=True, name=f"maxlite-{what}")
        self.process.start()
        child.close()  # the parent's copy: a dead worker's pipe then reads as EOF
        self.ready, self.task, self.deadline = False, None, time.monotonic() + START_SECONDS

    def give(self, index: int, task, timeout_seconds: float) -> None:
        self.conn.send(task)
        self.task, self.deadline = index, time.monotonic() + timeout_seconds

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def _stop(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class Pool:
    """`num_workers` workers that can call `names`; `run` answers a list of tasks with one
    Outcome each, in order. `convert` (a module-level function: it is pickled into the workers) makes
    a result what goes back; `what` names the functions in the workers' name and in errors."""

    def __init__(self, names, num_workers: int, timeout_seconds: float, convert=floats, what: str = "reward"):
        self.names, self.size, self.timeout = list(names), num_workers, timeout_seconds
        self.convert, self.what = convert, what
        self.ctx = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []  # started at the first run
        self._lock = threading.Lock()  # asynchronous GRPO scores in its rollout thread while eval scores in the loop's
        self._finalizer = weakref.finalize(self, _stop, self.workers)

    def close(self) -> None:
        self._finalizer()

    def run(self, tasks: list[tuple[str, tuple]]) -> list[Outcome]:
        with self._lock:
            return self._run(tasks)

    def _run(self, tasks: list[tuple[str, tuple]]) -> list[Outcome]:
        from maxlite.config import ConfigError

        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.ctx, self.names, self.convert, self.what))
        results: list[Outcome | None] = [None] * len(tasks)
        queue = collections.deque(range(len(tasks)))
        while queue or any(w.task is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.task is None and queue:
                    i = queue.popleft()
                    w.give(i, tasks[i], self.timeout)
            waiting = [w for w in self.workers if w.task is not None or not w.ready]
            left = min(w.deadline for w in waiting) - time.monotonic()
            answered = set(wait([w.conn for w in waiting], timeout=max(left, 0.0)))
            for k, w in enumerate(self.workers):
                if w not in waiting:
                    continue
                if w.conn in answered:
                    try:
                        status, value = w.conn.recv()
                    except (EOFError, OSError):  # the process died (its pipe's end is closed)
                        w.process.join()
                        status, value = CRASHED, w.process.exitcode
                    if not w.ready:
                        if status == "ready":
                            w.ready = True
                            continue
                        self.close()
                        raise ConfigError(f"a {self.what} worker process could not load {self.names} "
                                          f"({value if status == 'error' else f'it exited with {value}'})")
                    results[w.task], w.task = Outcome(status, value), None
                    if status == CRASHED:
                        w.kill()
                        self.workers[k] = _Worker(self.ctx, self.names, self.convert, self.what)
                elif time.monotonic() >= w.deadline:
                    if not w.ready:
                        self.close()
                        raise ConfigError(f"a {self.what} worker process did not load {self.names} within "
                                          f"{START_SECONDS:.0f} s")
                    results[w.task] = Outcome(TIMEOUT)
                    w.kill()
                    self.workers[k] = _Worker(self.ctx, self.names, self.convert, self.what)
        return results  # type: ignore[return-value]
