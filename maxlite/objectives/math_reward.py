"""Verifiable math answers: `maxlite.objectives.math_reward:math_verify` in `reward_functions`.

The completion's answer (the content of its last `\\boxed{...}`, else its last number) is checked
against the record's `answer` with Hugging Face's Math-Verify (`math_verify.parse` / `verify`:
12 = 12.0 = \\frac{24}{2}, 1/2 = 0.5, 1,000 = 1000). It needs the `rl` extra
(`pip install -e ".[rl]"`); a recipe naming it without the package stops at the start with one line.

Marked per completion: each answer is verified in a worker process under its own
`reward_timeout_seconds` (objectives/reward_pool.py), so Math-Verify's own signal-based timeouts
are turned off and its one warning about that is silenced; a slow or crashing parse scores that
answer 0 and is counted.
"""

from __future__ import annotations

import logging
import re
from typing import Sequence

from maxlite.config import ConfigError
from maxlite.objectives.rewards import last_boxed, per_completion

try:
    import math_verify as _mv
except ImportError:  # the recipe's loader turns this into one line (rewards.load)
    raise ConfigError("maxlite.objectives.math_reward needs Math-Verify: pip install -e \".[rl]\" "
                      "(math-verify[antlr4_13_2])") from None

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": the pool bounds it

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def answer_text(completion: str) -> str | None:
    """What the completion answers: its last `\\boxed{...}` (kept boxed, Math-Verify's anchor), else
    its last number, else None."""
    box = last_boxed(completion)
    if box is not None:
        return completion[box[0]:box[1]]
    numbers = _NUMBER.findall(completion)
    return numbers[-1].rstrip(",") if numbers else None


def verified(gold: str, completion: str) -> bool:
    """Whether the completion's answer equals `gold` by Math-Verify; a gold that does not parse is
    the data's mistake (raised: the caller counts it)."""
    gold_parsed = _mv.parse(gold, parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"the record's answer {gold!r} does not parse as math")
    text = answer_text(completion)
    if text is None:
        return False
    return bool(_mv.verify(gold_parsed, _mv.parse(text, parsing_timeout=None), timeout_seconds=None))


@per_completion
def math_verify(prompts: Sequence[str], completions: Sequence[str], records: Sequence[dict]) -> list[float]:
    """1 when the completion's final answer equals the record's `answer` (Math-Verify); else 0."""
    out = []
    for c, r in zip(completions, records):
        if r.get("answer") is None:
            raise ValueError("the record has no 'answer' to verify against")
        out.append(float(verified(str(r["answer"]), c)))
    return out
