"""What the rollout engines take and give (maxlite/rollout/engine.py says what each field means)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

STOPS = ("eos", "marker", "length")


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    generations: int = 1  # completions per prompt (GRPO's G)
    eos_id: int | None = None
    marker_ids: tuple[int, ...] = ()  # end-of-turn marker token id(s)
    top_k: int = 0  # sample among the k most likely tokens (0: all)
    top_p: float = 1.0  # ... then among the fewest top tokens holding this probability (1: all)

    def end_ids(self) -> tuple[int, ...]:
        return (*(() if self.eos_id is None else (int(self.eos_id),)), *map(int, self.marker_ids))

    def stop(self, token: int, count: int) -> str | None:
        """Why a completion whose `count`-th token is `token` stops there, or None."""
        if self.eos_id is not None and token == self.eos_id:
            return "eos"
        if token in self.marker_ids:
            return "marker"
        return "length" if count >= self.max_new_tokens else None


class Completions(NamedTuple):
    tokens: list  # per sequence (p·G + g): int32 [n], the ending token included
    logps: list  # per sequence: float32 [n], log-prob of each token under the sampling policy
    stops: list  # per sequence: one of STOPS
    stats: dict  # steps, slot_steps, ended_slot_steps (no live sequence in the slot), prefills, seconds


def bucket(n: int, most: int, least: int = 1) -> int:
    """`n` rounded up to a power of two (at least `least`), at most `most` unless `n` is more: the
    lengths an engine call is padded to, so that calls of other lengths reuse its compiled programs
    (a batch's prompts, maxlite/rollout/continuous.py; a tool round's token budget, tools.py)."""
    return max(n, min(max(least, 1 << max(n - 1, 0).bit_length()), most))
