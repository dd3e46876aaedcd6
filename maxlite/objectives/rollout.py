"""GRPO's rollouts: completions sampled (the rollout engine, maxlite/rollout/), cut at the chat
template's end of turn (or EOS), decoded, scored by the recipe's reward functions on the host (in
worker processes: rewards.Scorer, whose failures are counted, not fatal), and laid out as training
rows (prompt + completion, the loss on the completion's tokens).

One process: the rollout engine `rollout_engine` names samples (in this process, or with
`rollout_workers` in Ray actors of its own: maxlite/rollout/actors.py) (maxlite/rollout/: continuous
batching, each prompt prefilled once for its G completions) and reports each token's log-prob
under the sampling policy (grpo_temperature, cut by grpo_top_k / grpo_top_p and renormalised),
laid out as `sampler_logps` [R, T] like the rows' targets. With `rollout_tools` a completion may
call tools between its turns (maxlite/rollout/tools.py): the row holds the tools' tokens too, with
no loss weight and no sampler log-prob, its length and the reward's completion text counted from
them as said in `__call__`. Several
processes: the static sampler (decode.generate_tokens over prompts repeated G times, `sample_static`):
every process samples the global batch, gathers the sampled tokens and scores its own prompts'
completions (a prompt's G completions are on the process that holds the prompt); no sampler log-probs.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxlite.objectives import rewards
from maxlite.schema import ConfigError


class Scored(NamedTuple):
    rewards_PG: np.ndarray  # [this process's prompts, G]
    rows: dict  # training rows of this process (numpy): inputs, targets, positions, segment_ids, weights
    lengths: np.ndarray  # completion tokens, per row
    ended: np.ndarray  # whether each completion reached its end of turn / EOS
    # log-prob of each completion token under the sampling policy (maxlite/rollout/engine.py), laid
    # out like rows["targets"] [R, T], zero off the completion; None from the static sampler
    sampler_logps: np.ndarray | None
    reward_failures: int = 0  # scores a reward function's raise or dead worker left at 0 (rewards.Scores)
    reward_timeouts: int = 0  # scores a call past reward_timeout_seconds left at 0
    # rollout_tools (maxlite/rollout/tools.py): the calls made, those answered with an error, those past
    # tool_timeout_seconds; the model's turns per row (None: no tools)
    tool_calls: int = 0
    tool_failures: int = 0
    tool_timeouts: int = 0
    turns: np.ndarray | None = None


def end_of_turn(template) -> str:
    """What the chat template writes after an assistant answer ("<|im_end|>" for ChatML), or ""."""
    text = template.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "\x00"}])
    return text.split("\x00", 1)[1].strip() if "\x00" in text else ""


def cut(tokens: list[int], decode, marker: str, eos_id: int | None) -> tuple[list[int], str, bool]:
    """(the completion's tokens up to and including its end — the end-of-turn marker or EOS —, its
    text without the marker, whether it ended)."""
    for k in range(1, len(tokens) + 1):
        if eos_id is not None and tokens[k - 1] == eos_id:
            return tokens[:k], decode(tokens[:k - 1]), True
        if marker:
            text = decode(tokens[:k])
            if marker in text:
                return tokens[:k], text.split(marker, 1)[0], True
    return tokens, decode(tokens), False


def marker_ids(tok, marker: str) -> tuple[int, ...]:
    """The end-of-turn marker as the one token id the engine stops on, or () when it takes several
    (then `cut` finds it in the text and the engine runs on to EOS or the length)."""
    ids = tok.encode(marker).tolist() if marker else []
    return tuple(ids) if len(ids) == 1 and tok.decode(ids) == marker else ()


def sampler_row(logps: np.ndarray, prompt_length: int, length: int) -> np.ndarray:
    """A completion's log-probs at its targets' places in a row of `length` (preference.row's layout:
    completion token k is the target at prompt_length − 1 + k)."""
    out = np.zeros(length, np.float32)
    start = prompt_length - 1
    kept = logps[:max(length - start, 0)]
    out[start:start + len(kept)] = kept
    return out


def local_rows(global_array) -> np.ndarray:
    """This process's rows of a batch-sharded array, in order."""
    from jax.experimental import multihost_utils

    full = np.asarray(multihost_utils.process_allgather(global_array, tiled=True))
    n = full.shape[0] // jax.process_count()
    return full[jax.process_index() * n:(jax.process_index() + 1) * n]


def process_mean(values: dict[str, float]) -> dict[str, float]:
    """Each figure averaged over the processes (equal shares of the global batch)."""
    if jax.process_count() == 1:
        return {k: float(v) for k, v in values.items()}
    from jax.experimental import multihost_utils
    return {k: float(np.mean(multihost_utils.process_allgather(np.float32(v)))) for k, v in values.items()}


def process_any(flag: bool) -> bool:
    """Whether `flag` holds on any process (one small allgather): a decision every process must take
    alike, such as whether to sample another batch, a collective program."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.bool_(flag))))


def process_sum(values: dict[str, float]) -> dict[str, float]:
    """Each figure summed over the processes (counts)."""
    return {k: v * jax.process_count() for k, v in process_mean(values).items()}


class Rollout:
    def __init__(self, cfg, graphdef):
        from maxlite.data.chat import ChatTemplate
        from maxlite.data.tokenizer import load_tokenizer
        from maxlite.models import decode
        from maxlite.rollout.engine import make_engine

        self.cfg = cfg
        self.tok = load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
        self.marker = end_of_turn(ChatTemplate.for_config(cfg, self.tok))
        self.scorer = rewards.Scorer(cfg.reward_functions, cfg.reward_weights, cfg.reward_timeout_seconds,
                                     cfg.reward_workers)
        eos = -1 if self.tok.eos_id is None else int(self.tok.eos_id)
        self.markers = marker_ids(self.tok, self.marker)
        if cfg.rollout_workers:  # Ray actors of their own (maxlite/rollout/actors.py), behind the same interface
            from maxlite.rollout.actors import WorkerPool
            self.engine = WorkerPool(cfg)
        else:
            self.engine = make_engine(cfg, graphdef) if jax.process_count() == 1 else None
        self.tools = None
        if cfg.rollout_tools:
            from maxlite.rollout.tools import Tools
            assert self.engine is not None, "config_checks refuses rollout_tools on several processes"
            self.tools = Tools.for_config(cfg, self.tok)
            if self.tools.end_id in (*self.markers, self.tok.eos_id):
                raise ConfigError(f"tool_call_end={cfg.tool_call_end!r} is also the end of a turn: name another token")

        def sample(params, prompt_ids, lengths, key, temperature, generations):
            return decode.generate_tokens(
                graphdef, params, jnp.repeat(prompt_ids, generations, 0), jnp.repeat(lengths, generations, 0),
                key, max_new_tokens=cfg.grpo_max_new_tokens, temperature=temperature, top_k=cfg.grpo_top_k,
                top_p=cfg.grpo_top_p, eos_id=eos)[0]

        self._sample = {True: jax.jit(functools.partial(sample, temperature=0.0, generations=1)),
                        False: jax.jit(functools.partial(sample, temperature=cfg.grpo_temperature,
                                                         generations=cfg.grpo_num_generations))}

    def sample_static(self, params, batch, key, greedy: bool = False) -> list[list[int]]:
        """This process's completions from the static sampler: every row runs to grpo_max_new_tokens
        or until all rows ended (EOS after a row's end)."""
        return local_rows(self._sample[greedy](params, batch["prompt_ids"], batch["prompt_lengths"], key)).tolist()

    def sample_engine(self, params, prompt_ids, lengths, key, greedy: bool = False):
        """(completions, their sampler log-probs, Turns or None) from the rollout engine, prompt-major
        (p·G + g); with rollout_tools, tool turns included (maxlite/rollout/tools.py)."""
        from maxlite.rollout.engine import Sampling

        cfg = self.cfg
        sampling = Sampling(cfg.grpo_max_new_tokens, 0.0 if greedy else cfg.grpo_temperature,
                            1 if greedy else cfg.grpo_num_generations, self.tok.eos_id, self.markers,
                            top_k=cfg.grpo_top_k, top_p=cfg.grpo_top_p)
        prompts = [ids[:n].tolist() for ids, n in zip(prompt_ids, lengths)]
        if self.tools is not None:
            got = self.tools.generate(self.engine, params, prompts, sampling, key)
            return [t.tolist() for t in got.tokens], got.logps, got
        done = self.engine.generate(params, prompts, sampling, key)
        return [t.tolist() for t in done.tokens], done.logps, None

    def __call__(self, params, batch, key, greedy: bool = False) -> Scored:
        """Sample (G per prompt, or one greedy), cut, score and lay out this process's rows.

        With tools, the end of turn is looked for in the last model turn only (a tool's turn may hold
        the chat template's markers); the reward functions see the whole completion's text, tool turns
        included; the row's loss weights and the length (`lengths`, completion_length) count the model's
        tokens only."""
        from maxlite.data.preference import row

        generations = 1 if greedy else self.cfg.grpo_num_generations
        prompt_ids, lengths = local_rows(batch["prompt_ids"]), local_rows(batch["prompt_lengths"])
        turns = None
        if self.engine is not None:
            tokens, logps, turns = self.sample_engine(params, prompt_ids, lengths, key, greedy)
        else:
            tokens = self.sample_static(params, batch, key, greedy)
            logps = [np.zeros(len(t), np.float32) for t in tokens]
        records = [json.loads(str(r)) for r in batch["host_records"]]
        prompts, texts, rows, lens, ended, sampler = [], [], [], [], [], []
        for i, toks in enumerate(tokens):
            prompt = prompt_ids[i // generations, :lengths[i // generations]]
            start = 0 if turns is None else turns.last_turn[i]
            done, text, end = cut(toks[start:], self.tok.decode, self.marker, self.tok.eos_id)
            done = toks[:start] + done
            model = np.ones(len(done), bool) if turns is None else turns.model[i][:len(done)]
            prompts.append(self.tok.decode(prompt.tolist()))
            texts.append(self.tok.decode(toks[:start]) + text if start else text)
            lens.append(int(model.sum()))
            ended.append(end)
            ids = np.concatenate([prompt, np.asarray(done, np.int32)])
            rows.append(row(ids, np.concatenate([np.zeros(len(prompt), bool), model]), self.cfg.max_target_length))
            sampler.append(sampler_row(logps[i][:len(done)], len(prompt), self.cfg.max_target_length))
        r = self.scorer(prompts, texts, [records[i // generations] for i in range(len(texts))])
        tools = {} if turns is None else dict(tool_calls=int(turns.calls.sum()), tool_failures=turns.failures,
                                              tool_timeouts=turns.timeouts, turns=turns.turns)
        return Scored(np.asarray(r.total, np.float32).reshape(-1, generations),
                      {k: np.stack([x[k] for x in rows]) for k in rows[0]}, np.asarray(lens), np.asarray(ended),
                      None if self.engine is None else np.stack(sampler), r.failures, r.timeouts, **tools)
