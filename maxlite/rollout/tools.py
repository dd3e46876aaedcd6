"""Multi-turn rollouts with tools (`rollout_tools`; MaxText/Tunix call them agentic rollouts, NeMo-RL
multi-turn environments), built on the rollout engine's interface (engine.py):

    tools = Tools.for_config(cfg, tok)
    got = tools.generate(engine, params, prompts, sampling, key)   # Turns

Round 0 is the engine's own call (the same completions a run without tools samples up to their
first `tool_call_end`). A completion that ends on `tool_call_end` (one token: the engine stops on it
as on an end-of-turn marker) has its call parsed from the text after the last `tool_call_start` of
that turn and of what came just before it (the prompt, or the last tool answer: either may open the
call itself):

    {"name": "add", "arguments": {"a": 1, "b": 2}}    → add(a=1, b=2)      (Hermes / Qwen's format)
    add 1 2                                           → add("1 2")         (the name, one space, the rest)

The tool runs in a worker process with `tool_timeout_seconds` (objectives/reward_pool.py, the reward
functions' pool); its answer, `str` of what it returned, goes into `tool_response_format` in place of
`{answer}`, is tokenized and appended, and round r ≥ 1 calls `engine.generate` again on each calling
completion's whole context (prompt + model and tool tokens so far, one generation each), up to
`max_tool_turns` calls. A call that cannot be parsed, names no tool, raises, kills its worker or runs
past the limit is answered with an error text instead, and counted (`failures`, `timeouts`); never fatal.

The completion (what the row trains on) is prompt + [model tokens, tool tokens, model tokens, ...],
all within `sampling.max_new_tokens` (grpo_max_new_tokens): a tool answer or a later turn is cut
where the budget ends (stop "length"). A call past `max_tool_turns` is not run: the completion ends
on it (stop "tool_turns", not ended). Tool tokens carry log-prob 0 and `model` False: the loss mask.

Keys: round r ≥ 1 samples under fold_in(fold_in(key, _SALT), r), its prompts being the calling
completions in order; everything is a function of the step's key, so a resumed run samples the same.
A later round's max_new_tokens is the largest budget left, rounded up to a power of two (at most the
budget): few distinct shapes for the engine to compile; each completion is cut at its own budget.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import NamedTuple, Sequence

import numpy as np

from maxlite.objectives import reward_pool, rewards
from maxlite.rollout.sampling import Sampling, bucket
from maxlite.schema import ConfigError

_SALT = 0x746F6F6C  # the later rounds' keys: a stream of their own
OK, FAILED, TIMEOUT = "ok", "failed", "timeout"


class Call(NamedTuple):
    name: str
    args: tuple
    kwargs: dict


def parse_call(text: str, start: str) -> Call | str:
    """The call in `text` (after its last `start`), or why there is none."""
    at = text.rfind(start)
    if at < 0:
        return f"no {start} before the call's end"
    body = text[at + len(start):].strip()
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return f"the call is not JSON ({e})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                not isinstance(obj.get("arguments", {}), dict):
            return 'a JSON call is {"name": "...", "arguments": {...}}'
        return Call(obj["name"], (), obj.get("arguments", {}))
    found = re.match(r"(\S+)\s?(.*)", body, re.S)
    return Call(found.group(1), (found.group(2),), {}) if found else "the call names no tool"


def one_token(tok, text: str, key: str) -> int:
    """The id of `text` as one token of `tok`, or the one line saying it is not one."""
    ids = tok.encode(text).tolist()
    if len(ids) != 1 or tok.decode(ids) != text:
        raise ConfigError(f"{key}={text!r} is {len(ids)} tokens of this tokenizer ({ids[:8]}): the rollout engine "
                          "stops on one token id; name a text that is one token (a special token of the tokenizer)")
    return ids[0]


class Turns(NamedTuple):
    """Per completion (p·G + g, as engine.Completions): its tokens after the prompt, model's and tools'."""
    tokens: list  # int32 [n]
    logps: list  # float32 [n]: the sampling policy's log-prob of each model token, 0 at tool tokens
    model: list  # bool [n]: the model's own tokens (the loss mask)
    last_turn: list  # where the last model turn starts (its end is the completion's)
    stops: list  # the last turn's: eos | marker | length | tool_turns (a call past max_tool_turns)
    calls: np.ndarray  # tool calls answered (tools run, or an error answered), per completion
    turns: np.ndarray  # the model's turns, per completion
    failures: int  # calls answered with an error: unparsable, unknown tool, raised, worker died
    timeouts: int  # calls past tool_timeout_seconds


@dataclasses.dataclass
class _Seq:
    prompt: list
    tokens: list = dataclasses.field(default_factory=list)
    logps: list = dataclasses.field(default_factory=list)
    model: list = dataclasses.field(default_factory=list)
    last_turn: int = 0
    last_tool: int = 0  # where the last tool answer starts
    stop: str = ""
    calls: int = 0
    turns: int = 0

    def add(self, tokens, logps, model: bool, stop: str = "") -> None:
        if model:
            self.last_turn, self.stop, self.turns = len(self.tokens), stop, self.turns + 1
        else:
            self.last_tool = len(self.tokens)
        self.tokens += [int(t) for t in tokens]
        self.logps += [float(v) for v in logps] if model else [0.0] * len(tokens)
        self.model += [model] * len(tokens)


class Tools:
    """The recipe's tools, called by their functions' names, run in `workers` processes."""

    def __init__(self, names: Sequence[str], tok, *, start: str, end: str, response_format: str,
                 max_turns: int, timeout_seconds: float, workers: int):
        rewards.load(names, key="rollout_tools")  # one line for a module or function that does not load
        self.names = {str(n).partition(":")[2]: str(n) for n in names}
        self.tok, self.start, self.format, self.max_turns = tok, start, response_format, max_turns
        self.end_id = one_token(tok, end, "tool_call_end")
        self.timeout = timeout_seconds
        self.pool = reward_pool.Pool(list(self.names.values()), workers, timeout_seconds, convert=str, what="tool")
        self.said: set[tuple[str, str]] = set()

    @classmethod
    def for_config(cls, cfg, tok) -> "Tools":
        return cls(cfg.rollout_tools, tok, start=cfg.tool_call_start, end=cfg.tool_call_end,
                   response_format=cfg.tool_response_format, max_turns=cfg.max_tool_turns,
                   timeout_seconds=cfg.tool_timeout_seconds, workers=cfg.tool_workers)

    def close(self) -> None:
        self.pool.close()

    def answer(self, texts: Sequence[str]) -> list[tuple[str, str]]:
        """(the answer text, OK | FAILED | TIMEOUT) of the call in each text."""
        out: list = [None] * len(texts)
        tasks, where = [], []
        for j, text in enumerate(texts):
            call = parse_call(text, self.start)
            if isinstance(call, str):
                out[j] = self._error(call, FAILED, "unparsable")
            elif call.name not in self.names:
                out[j] = self._error(f"no tool named {call.name!r} (tools: {', '.join(self.names)})", FAILED,
                                     "unknown")
            else:
                tasks.append((self.names[call.name], call.args, call.kwargs))
                where.append(j)
        for j, (full, _, _), got in zip(where, tasks, self.pool.run(tasks) if tasks else []):
            name = full.partition(":")[2]
            if got.status == reward_pool.OK:
                out[j] = (got.value, OK)
            elif got.status == reward_pool.TIMEOUT:
                out[j] = self._error(f"{name} ran past tool_timeout_seconds={self.timeout:g}", TIMEOUT, name)
            elif got.status == reward_pool.CRASHED:
                out[j] = self._error(f"{name} ended its worker process (exit code {got.value})", FAILED, name)
            else:
                out[j] = self._error(f"{name} raised {got.value}", FAILED, name)
        return out

    def _error(self, what: str, status: str, kind: str) -> tuple[str, str]:
        """The error answered to the model; one line the first time each kind happens (counted, not silent)."""
        if (kind, status) not in self.said:
            self.said.add((kind, status))
            counter = "tool_timeouts" if status == TIMEOUT else "tool_failures"
            print(f"maxlite: a tool call failed ({what}): the model is answered the error (counted in {counter}; "
                  "said once)", flush=True)
        return f"error: {what}", status

    def generate(self, engine, params, prompts: Sequence[Sequence[int]], sampling: Sampling, key) -> Turns:
        """Each prompt's `sampling.generations` completions, tool turns included (the module's docstring)."""
        import jax

        if self.end_id not in sampling.marker_ids:
            sampling = dataclasses.replace(sampling, marker_ids=(*sampling.marker_ids, self.end_id))
        budget, G = sampling.max_new_tokens, sampling.generations
        seqs = [_Seq(list(map(int, prompts[i // G]))) for i in range(len(prompts) * G)]
        done = engine.generate(params, prompts, sampling, key)
        for s, tokens, logps, stop in zip(seqs, done.tokens, done.logps, done.stops):
            s.add(tokens, logps, True, stop)
        failures = timeouts = 0
        for r in range(1, self.max_turns + 2):
            calling = [i for i, s in enumerate(seqs) if s.stop == "marker" and s.tokens[-1] == self.end_id]
            if r > self.max_turns:  # a call past max_tool_turns: not run, the completion ends on it
                for i in calling:
                    seqs[i].stop = "tool_turns"
                break
            for i in [i for i in calling if len(seqs[i].tokens) >= budget]:
                seqs[i].stop = "length"  # no room left for an answer
            calling = [i for i in calling if len(seqs[i].tokens) < budget]
            if not calling:
                break
            answers = self.answer([self._call_text(seqs[i], r) for i in calling])
            for i, (text, status) in zip(calling, answers):
                s = seqs[i]
                s.calls += 1
                failures, timeouts = failures + (status == FAILED), timeouts + (status == TIMEOUT)
                s.add(self.tok.encode(self.format.replace("{answer}", text))[:budget - len(s.tokens)], (), False)
                if len(s.tokens) >= budget:
                    s.stop = "length"
            going = [i for i in calling if len(seqs[i].tokens) < budget]
            if not going:
                break
            room = {i: budget - len(seqs[i].tokens) for i in going}
            later = dataclasses.replace(sampling, generations=1, max_new_tokens=bucket(max(room.values()), budget))
            done = engine.generate(params, [seqs[i].prompt + seqs[i].tokens for i in going], later,
                                   jax.random.fold_in(jax.random.fold_in(key, _SALT), r))
            for i, tokens, logps, stop in zip(going, done.tokens, done.logps, done.stops):
                cut = len(tokens) > room[i]
                seqs[i].add(tokens[:room[i]], logps[:room[i]], True, "length" if cut else stop)
        return Turns([np.asarray(s.tokens, np.int32) for s in seqs], [np.asarray(s.logps, np.float32) for s in seqs],
                     [np.asarray(s.model, bool) for s in seqs], [s.last_turn for s in seqs], [s.stop for s in seqs],
                     np.asarray([s.calls for s in seqs]), np.asarray([s.turns for s in seqs]), failures, timeouts)

    def _call_text(self, s: _Seq, r: int) -> str:
        """The text the call of round `r` is parsed from: its turn after the prompt (round 1) or the last
        tool answer, the end marker left out."""
        return self.tok.decode(s.prompt + s.tokens[:-1] if r == 1 else s.tokens[s.last_tool:-1])
