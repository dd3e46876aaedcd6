"""The rollout engine's interface and the choice of engine (`rollout_engine`).

    engine = make_engine(cfg, graphdef)
    done = engine.generate(params, prompts, Sampling(max_new_tokens=64, temperature=1.0, generations=8,
                                                     eos_id=tok.eos_id, marker_ids=(im_end,)), key)

`prompts` are lists of token ids; completion g of prompt p is sequence p·G + g of the result. Each
completion holds its sampled tokens up to and including the one that ended it, the log-probability
of each under the sampling policy, and why it stopped: "eos" (the tokenizer's end of text),
"marker" (an end-of-turn marker id: the chat template's `<|im_end|>`) or "length" (max_new_tokens).

Log-probability under the sampling policy: log softmax(logits / T)[token] in float32, the
distribution the token was drawn from. At T = 1 that is the policy's own log p(token), what the
trainer recomputes (maxlite.step.token_logps) up to float32 rounding; at T ≠ 1 it is the
temperature-scaled distribution's, not the policy's (an importance ratio against the trainer's
log p needs the same scaling on the trainer's side); greedy (T = 0) reports the T = 1 value.

Importable without JAX (config_checks asks `refusal` before any work).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import NamedTuple, Protocol, Sequence

STOPS = ("eos", "marker", "length")
ENGINES = ("maxlite", "vllm")


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    generations: int = 1  # completions per prompt (GRPO's G)
    eos_id: int | None = None
    marker_ids: tuple[int, ...] = ()  # end-of-turn marker token id(s)

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


class Engine(Protocol):
    def generate(self, params, prompts: Sequence[Sequence[int]], sampling: Sampling, key) -> Completions: ...


def refusal(name: str) -> str | None:
    """The one line saying why engine `name` cannot run here, or None."""
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        return ("rollout_engine=vllm needs the vllm package (GPU): pip install vllm, or set "
                "rollout_engine=maxlite")
    if name == "vllm":
        return "rollout_engine=vllm: the vLLM adapter is not written yet (issue 50); set rollout_engine=maxlite"
    if name not in ENGINES:
        return f"rollout_engine={name!r}: choose one of {', '.join(ENGINES)}"
    return None


def make_engine(cfg, graphdef) -> Engine:
    """The engine `cfg.rollout_engine` names, over the model `graphdef`."""
    from maxlite.config import ConfigError

    if (why := refusal(cfg.rollout_engine)) is not None:
        raise ConfigError(why)
    from maxlite.rollout.continuous import ContinuousEngine

    return ContinuousEngine(cfg, graphdef, cfg.max_num_seqs, cfg.max_num_batched_tokens)
