"""Reward functions for GRPO (`reward_functions` in a recipe, `"package.module:function"`).

A reward function is called once per step with three lists of equal length — the prompts (the
rendered text the policy saw), the completions (text, the end-of-turn marker removed) and the
records (the dataset's JSON objects, e.g. with an `answer`) — and returns one float per
completion. Several functions are summed with `reward_weights` (default 1 each).
"""

from __future__ import annotations

import importlib
import re
from typing import Callable, Sequence

from maxlite.config import ConfigError

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[dict]], Sequence[float]]


def exact_answer(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 when the completion, stripped, is the record's `answer`; else 0."""
    return [float(c.strip() == str(r.get("answer", "")).strip()) for c, r in zip(completions, records)]


def number_format(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 when the completion is a single integer (a format reward to add with a small weight)."""
    return [float(re.fullmatch(r"\s*-?\d+\s*", c) is not None) for c in completions]


def brevity(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 / (1 + characters): shorter completions score higher (a shaping term for terse answers)."""
    return [1.0 / (1.0 + len(c.strip())) for c in completions]


def load(names: Sequence[str]) -> list[RewardFn]:
    """The callables named `package.module:function` (config validation checks the spelling); one
    clear line for a name that does not load."""
    out = []
    for name in names:
        module, _, attr = str(name).partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"reward_functions: cannot load {name!r} ({type(e).__name__}: {e})") from None
        if not callable(fn):
            raise ConfigError(f"reward_functions: {name!r} is not callable")
        out.append(fn)
    return out


def score(fns: Sequence[RewardFn], weights: Sequence[float], names: Sequence[str], prompts, completions,
          records) -> list[float]:
    """Σ_i weight_i · fn_i(...) per completion; a function that returns the wrong count or a
    non-number stops the run with one line naming it."""
    total = [0.0] * len(completions)
    for fn, w, name in zip(fns, weights, names):
        values = list(fn(list(prompts), list(completions), list(records)))
        if len(values) != len(completions):
            raise ConfigError(f"reward function {name} returned {len(values)} values for {len(completions)} completions")
        try:
            total = [t + w * float(v) for t, v in zip(total, values)]
        except (TypeError, ValueError):
            raise ConfigError(f"reward function {name} returned a non-number") from None
    return total
