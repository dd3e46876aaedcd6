"""Reward functions for GRPO (`reward_functions` in a recipe, `"package.module:function"`).

A reward function is called once per step with three lists of equal length — the prompts (the
rendered text the policy saw), the completions (text, the end-of-turn marker removed) and the
records (the dataset's JSON objects, e.g. with an `answer`) — and returns one float per
completion. Several functions are summed with `reward_weights` (default 1 each).

They run in worker processes (objectives/reward_pool.py), each call bounded by
`reward_timeout_seconds`: a function that raises, kills its worker or runs past the limit scores
the completions of that call 0, and they are counted (`reward_failures`, `reward_timeouts`). A
function marked `@per_completion` is called one completion at a time (its lists of length 1), so
a failure costs one completion: verifiers of model output (math_reward.math_verify) are marked.
A wrong count or a non-number returned is a mistake in the recipe's code and stops the run.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable, NamedTuple, Sequence

from maxlite.config import ConfigError
from maxlite.objectives import reward_pool

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[dict]], Sequence[float]]


def exact_answer(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 when the completion, stripped, is the record's `answer`; else 0."""
    return [float(c.strip() == str(r.get("answer", "")).strip()) for c, r in zip(completions, records)]


def number_format(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 when the completion is a single integer (a format reward to add with a small weight)."""
    return [float(re.fullmatch(r"\s*-?\d+\s*", c) is not None) for c in completions]


def last_boxed(text: str) -> tuple[int, int, str] | None:
    """(start, end, content) of the last balanced `\\boxed{...}` in `text`, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return start, i + 1, text[start + len("\\boxed{"):i]
    return None


def boxed_format(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 when the completion ends with its only `\\boxed{...}` (a final period or `$` may follow); else 0."""
    out = []
    for c in completions:
        box = last_boxed(c)
        out.append(float(box is not None and c.count("\\boxed{") == 1 and box[2].strip() != ""
                         and c[box[1]:].strip(" \t\n.$") == ""))
    return out


_THINK_ANSWER = re.compile(r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)+</answer>\s*", re.S)


def think_answer_format(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 when the completion is `<think>...</think>` then `<answer>...</answer>` and nothing else
    (DeepSeek-R1's format reward); else 0."""
    return [float(_THINK_ANSWER.fullmatch(c) is not None) for c in completions]


def brevity(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 / (1 + characters): shorter completions score higher (a shaping term for terse answers)."""
    return [1.0 / (1.0 + len(c.strip())) for c in completions]


def load(names: Sequence[str], key: str = "reward_functions") -> list[Callable]:
    """The callables named `package.module:function` (config validation checks the spelling); one
    clear line, naming the recipe's `key`, for a name that does not load."""
    out = []
    for name in names:
        module, _, attr = str(name).partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{key}: cannot load {name!r} ({type(e).__name__}: {e})") from None
        if not callable(fn):
            raise ConfigError(f"{key}: {name!r} is not callable")
        out.append(fn)
    return out


def per_completion(fn: RewardFn) -> RewardFn:
    """Mark a reward function to be called one completion at a time: its own time limit, and a
    failure scores that completion alone."""
    fn.per_completion = True
    return fn


class Scores(NamedTuple):
    total: list[float]  # Σ_i weight_i · fn_i per completion
    failures: int  # scores a raise or a dead worker left at 0: (function, completion) pairs
    timeouts: int  # scores a call past reward_timeout_seconds left at 0, counted the same way


class Scorer:
    """The recipe's reward functions, summed with their weights, run in `num_workers` processes."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] = (), timeout_seconds: float = 5.0,
                 num_workers: int = 2):
        self.names = [str(n) for n in names]
        self.per_completion = [bool(getattr(fn, "per_completion", False)) for fn in load(self.names)]
        self.weights = [float(w) for w in weights] or [1.0] * len(self.names)
        self.timeout = timeout_seconds
        self.pool = reward_pool.Pool(self.names, num_workers, timeout_seconds)
        self.said: set[tuple[str, str]] = set()

    def close(self) -> None:
        self.pool.close()

    def __call__(self, prompts, completions, records) -> Scores:
        prompts, completions, records = list(prompts), list(completions), list(records)
        n = len(completions)
        tasks, spans = [], []  # spans: (function index, first completion, end)
        for f, name in enumerate(self.names):
            if self.per_completion[f]:
                for j in range(n):
                    tasks.append((name, ([prompts[j]], [completions[j]], [records[j]])))
                    spans.append((f, j, j + 1))
            else:
                tasks.append((name, (prompts, completions, records)))
                spans.append((f, 0, n))
        total, failures, timeouts = [0.0] * n, 0, 0
        for (f, lo, hi), out in zip(spans, self.pool.run(tasks)):
            name = self.names[f]
            if out.status == reward_pool.NOT_NUMBERS:
                raise ConfigError(f"reward function {name} returned a {out.value}, not a list of numbers")
            if out.status == reward_pool.OK:
                if len(out.value) != hi - lo:
                    raise ConfigError(f"reward function {name} returned {len(out.value)} values for {hi - lo} "
                                      f"completions")
                for j, v in zip(range(lo, hi), out.value):
                    total[j] += self.weights[f] * v
                continue
            if out.status == reward_pool.TIMEOUT:
                timeouts += hi - lo
            else:
                failures += hi - lo
            self._say_once(name, out)
        return Scores(total, failures, timeouts)

    def _say_once(self, name: str, out: reward_pool.Outcome) -> None:
        """One line the first time a function fails in each way: a counted 0 is not a silent one."""
        if (name, out.status) in self.said:
            return
        self.said.add((name, out.status))
        what = {reward_pool.TIMEOUT: f"ran past reward_timeout_seconds={self.timeout:g}",
                reward_pool.CRASHED: f"ended its worker process (exit code {out.value})",
                reward_pool.RAISED: f"raised {out.value}"}[out.status]
        counter = "reward_timeouts" if out.status == reward_pool.TIMEOUT else "reward_failures"
        print(f"maxlite: reward function {name} {what}: those completions score 0 (counted in {counter}; "
              f"said once)", flush=True)
