"""The one error tail of every command-line entry point (train, ray_entry, plan, preprocess,
tokenizer, bridge, checkpoints, launch, status, generate ...).

A user's mistake — a `ConfigError`, or an error type the command names as the user's — becomes one
line `maxlite: error: <first line of the message>` on stderr and exit code 2 (never retried); a
passing condition (`outcome.TransientError`: a live writer holds the run, a staged copy failed its
check) one line and exit `outcome.TRANSIENT` (launchers retry it); anything else is a bug and keeps
its traceback.

    @cli.entry_point(LaunchError)
    def main(argv=None) -> int: ...
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, Sequence

from maxlite.config import ConfigError
from maxlite.outcome import CONFIG_ERROR, TRANSIENT, TransientError  # never retried; retried


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
                return CONFIG_ERROR
            except TransientError as e:
                print(f"maxlite: error: {error_line(e)}", file=sys.stderr, flush=True)
                return TRANSIENT
        return run
    return wrap
