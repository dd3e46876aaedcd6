"""Tools for tests/test_rollout_tools.py, named "tests.tool_fns:<name>" in `rollout_tools`: they run in
the tool worker processes like a user's own."""

import os
import threading


def echo(text: str = "", **kwargs) -> str:
    """What it was called with, so a test sees the parsed call in the appended tokens."""
    return f"echo[{text}]" + "".join(f"[{k}={v}]" for k, v in sorted(kwargs.items()))


def assistant(text: str) -> str:
    """A tool the ChatML generation prompt ("<|im_start|>assistant\\n") calls when tool_call_start is
    "<|im_start|>" (the end-to-end run's way to make a random model call a tool)."""
    return f"ok {len(text)}"


def raises(text: str) -> str:
    raise ValueError("this tool is broken")


def hangs(text: str) -> str:
    threading.Event().wait()  # never set: only the time limit ends it


def dies(text: str) -> str:
    os._exit(3)  # the worker ends mid-call, as a segfault would end it
