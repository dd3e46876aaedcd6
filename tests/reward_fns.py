"""Reward functions that misbehave, for tests/test_rewards.py, or that make all-equal groups on
purpose (tests/test_rl_refill.py): named "tests.reward_fns:<name>" in a recipe, they run in the
reward worker processes like a user's own."""

import os
import threading

from maxlite.objectives.rewards import per_completion


def length(prompts, completions, records):
    return [float(len(c)) for c in completions]


def index_if_odd(prompts, completions, records):
    """0 for every completion of a question whose answer is even (a group of equal rewards); else the
    completion's place in the call (a group's completions are consecutive: their rewards differ)."""
    return [float(i) if int(r["answer"]) % 2 else 0.0 for i, r in enumerate(records)]


def raises(prompts, completions, records):
    raise ValueError("this reward function is broken")


def hangs(prompts, completions, records):
    threading.Event().wait()  # never set: only the time limit ends it


def dies(prompts, completions, records):
    os._exit(3)  # the worker process ends mid-call, as a segfault or the OOM killer would end it


@per_completion
def hangs_on_hang(prompts, completions, records):
    """1 per completion, but hangs on the completion "hang" and kills its worker on "die"."""
    if completions[0] == "hang":
        threading.Event().wait()
    if completions[0] == "die":
        os._exit(3)
    return [1.0]


def one_too_many(prompts, completions, records):
    return [0.0] * (len(completions) + 1)


def not_numbers(prompts, completions, records):
    return ["yes"] * len(completions)


def pid(prompts, completions, records):
    return [float(os.getpid())] * len(completions)
