"""GRPO's eval on the held-out prompts: the greedy completions' mean `reward` and `pass_at_1`, and,
with `eval_pass_k: k`, `pass_at_{k}` from grpo_num_generations samples per prompt at
grpo_temperature. A completion passes when its summed reward is at least `eval_pass_threshold`.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code"): with n samples of which c pass, the chance that k drawn without replacement hold at least
one that passes, 1 − C(n−c, k) / C(n, k), averaged over the prompts. (The names spell `_at_`:
MLflow refuses `@` in a metric name.) The eval samples with keys of (seed, batch) alone: every eval
of a run draws the same way, so two evals differ by the policy only.
"""

from __future__ import annotations

import jax
import numpy as np

from maxlite.objectives.rollout import process_mean, process_sum

_SALT = 0x6576616C  # the eval samples' own key stream: neither the training samples' nor dropout's


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 − C(n−c, k) / C(n, k), as Chen et al.'s numerically stable product."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def evaluate(rollout, cfg, params, batches) -> dict[str, float]:
    """The Evaluator's scorer for GRPO (`rollout`: objectives/rollout.Rollout)."""
    rewards, lengths, sampled, failures, timeouts = [], [], [], 0, 0
    for i, batch in enumerate(batches):
        got = rollout(params, batch, jax.random.key(0), greedy=True)
        rewards.append(got.rewards_PG.reshape(-1))
        lengths.append(got.lengths)
        failures, timeouts = failures + got.reward_failures, timeouts + got.reward_timeouts
        if cfg.eval_pass_k:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), _SALT), i)
            many = rollout(params, batch, key)
            passed = (many.rewards_PG >= cfg.eval_pass_threshold).sum(1)
            sampled += [pass_at_k(many.rewards_PG.shape[1], int(c), cfg.eval_pass_k) for c in passed]
            failures, timeouts = failures + many.reward_failures, timeouts + many.reward_timeouts
    if not rewards:
        return {}
    greedy = np.concatenate(rewards)
    means = {"reward": greedy.mean(), "completion_length": np.concatenate(lengths).mean(),
             "pass_at_1": (greedy >= cfg.eval_pass_threshold).mean()}
    if cfg.eval_pass_k:
        means[f"pass_at_{cfg.eval_pass_k}"] = np.mean(sampled)
    return {**process_mean(means), **process_sum({"reward_failures": failures, "reward_timeouts": timeouts})}
