"""The one error tail of every command-line entry point (train, ray_entry, plan, preprocess,
tokenizer, bridge, checkpoints, launch, status, generate ...).

A user's mistake — a `ConfigError`, or an error type the command names as the user's — becomes one
line `maxlite: error: <first line of the message>` on stderr and exit code 2 (never retried); a
passing condition (`outcome.TransientError`: a live writer holds the run, a staged copy failed its
check) one line and exit `outcome.TRANSIENT` (launchers retry it); anything else is a bug and keeps
its traceback. One of several jax.distributed processes that fails leaves at once (`leave`).

    @cli.entry_point(LaunchError)
    def main(argv=None) -> int: ...
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from typing import Callable, Sequence

from maxlite.config import ConfigError
from maxlite.outcome import CONFIG_ERROR, TRANSIENT, TransientError  # never retried; retried


def several_processes() -> bool:
    """Whether this process is one of several of a jax.distributed run (JAX not imported: no)."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


def leave(code: int):
    """Out now with `code`, from one of several processes that failed: its peers may be waiting for
    it in a barrier it will never reach, and jax.distributed's exit barrier would wait for them for
    minutes (300 s) while they wait for it (Orbax: 300 s more). Gone, it is seen as gone: at once
    when it is process 0 (the coordination service), after the heartbeat timeout (100 s) when not."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def error_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def entry_point(*user_errors: type[BaseException]):
    """Decorate `main(argv=None) -> int` so that the user's errors end it with one line and exit 2."""
    caught = (ConfigError, *user_errors)

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv: Sequence[str] | None = None) -> int:
            try:
                return main(argv)
            except caught as e:
                print(f"maxlite: error: {error_line(e)}", file=sys.stderr, flush=True)
                code = CONFIG_ERROR
            except TransientError as e:
                print(f"maxlite: error: {error_line(e)}", file=sys.stderr, flush=True)
                code = TRANSIENT
            except Exception:  # a bug: its traceback, and out at once when peers wait
                if not several_processes():
                    raise
                traceback.print_exc()
                code = 1
            if several_processes():
                leave(code)
            return code
        return run
    return wrap
