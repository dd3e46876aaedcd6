"""Group Relative Policy Optimization (Shao et al. 2024), `train_objective: grpo`.

Each step takes a batch of prompts (dataset_type=prompts), samples `grpo_num_generations` (G)
completions of each with the KV-cache sampler on the training mesh and scores them with the
recipe's reward functions on the host (objectives/rollout.py), normalises the rewards within
each prompt's group, A = (r − mean_group) / (std_group + 1e-4), then makes `grpo_iterations`
updates on those completions with the clipped ratio objective and a KL penalty to the reference
(optim.with_reference), per completion token t:

    ρ_t = π(y_t) / π_old(y_t)          (π_old: the policy that sampled; ρ = 1 in the first update)
    ℓ_t = −min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A) + β · (π_ref/π − log(π_ref/π) − 1)

averaged over all completion tokens of the batch (ε = grpo_epsilon, β = grpo_beta). With β = 0 and
one iteration the gradient is the policy-gradient estimate −Σ_t A ∇log π(y_t) / (number of tokens).

The sampling key is a function of (seed, step): a resumed run samples what the uninterrupted run
sampled. Metrics under TRL's names: reward, reward_std (the groups' mean std), kl, clip_ratio,
completion_length; reward_failures / reward_timeouts (scores a failed reward call left at 0,
objectives/rewards.py); and sampling_seconds / training_seconds, the split of the step's time.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlite import optim
from maxlite.objectives import NO_CLOCK, Objective, rl_eval
from maxlite.objectives.rollout import Rollout, process_mean, process_sum
from maxlite import step as step_lib
from maxlite.step import token_logps

_SALT = 0x6772706F  # the sampling keys' own stream: not the dropout's


def advantages(rewards_PG: np.ndarray) -> np.ndarray:
    """Rewards [prompts, G] normalised within each group (zero where a group is all equal)."""
    r = np.asarray(rewards_PG, np.float64)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).astype(np.float32)


def token_terms(logp, old_logp, ref_logp, adv_B, weights, epsilon: float, beta: float):
    """({metric: sum over weighted tokens}, the loss sum) of the clipped objective + KL."""
    ratio = jnp.exp(logp - old_logp)
    a = adv_B[:, None]
    unclipped, clipped = ratio * a, jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * a
    per_token = -jnp.minimum(unclipped, clipped)
    diff = ref_logp - logp
    kl = jnp.exp(diff) - diff - 1
    per_token = per_token + beta * kl
    is_clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + epsilon) & (a > 0))
    loss = jnp.sum(weights * per_token)
    return {"loss": loss, "kl": jnp.sum(weights * kl), "clip_ratio": jnp.sum(weights * is_clipped)}, loss


def loss_fn(cfg):
    """The GRPO objective as a `LossFn` (maxlite/step.py) over the sampled rows: inputs, targets,
    positions, segment_ids, weights (completion tokens), advantages [R], ref_logps [R, T] and,
    after the first iteration, old_logps [R, T]; the denominator is the number of completion tokens.
    A mixture of experts adds its auxiliary losses per completion token (routing of every real
    token of the rows, prompt included, as in pre-training)."""
    def fn(params, graphdef, batch, dropout_key=None):
        logp, stats = step_lib.token_logps_and_stats(params, graphdef, batch, dropout_key)
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logp)
        sums, loss = token_terms(logp, old, batch["ref_logps"], batch["advantages"], batch["weights"],
                                 cfg.grpo_epsilon, cfg.grpo_beta)
        return step_lib.with_aux_losses(cfg, loss, sums, stats, jnp.sum(batch["weights"]))
    return fn


class GRPOStep(Objective):
    """The train step of a GRPO run: like the compiled LM step, but the rollout (sampling, rewards)
    runs between compiled pieces, on the host, in the loop's `rollout` section."""

    def __init__(self, cfg, graphdef, tx, schedule, shardings, batch_sharding):
        from maxlite import step as step_lib
        from maxlite.state import split_trainable

        self.cfg, self.batch_sharding = cfg, batch_sharding
        self.rollout = Rollout(cfg, graphdef)

        def logps(state, rows, with_old: bool):
            frozen = split_trainable(state.params)[1]
            out = {"ref_logps": token_logps(optim.reference_policy(state.opt_state, frozen), graphdef, rows)}
            if with_old:
                out["old_logps"] = token_logps(state.params, graphdef, rows)
            return out

        self.logps = jax.jit(logps, static_argnums=2)
        common = (cfg, graphdef, tx, schedule, shardings, batch_sharding)
        self.updates = [step_lib.jit_step(*common, loss_fn(cfg), advance=a) for a in (0, 1)]
        super().__init__(self.updates[1], self.evaluate)

    def sampling_key(self, step: int):
        """The step's sampling key, a function of (seed, step) alone: a resumed or rolled-back run
        samples step `step` with the key the uninterrupted run used."""
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.seed), _SALT), step)

    def data_rows(self, step: int) -> None:
        return None  # it trains on the completions it samples, not on the prompts' rows

    def __call__(self, state, batch, step: int, clock=NO_CLOCK):
        from maxlite.mesh import global_batch

        cfg = self.cfg
        started = time.perf_counter()
        with clock.section("rollout", productive=True):  # sampling, the host gather, the rewards
            got = self.rollout(state.params, batch, self.sampling_key(step))
        sampled = time.perf_counter()
        with clock.device_wait():
            rows = clock.train_rows(step + 1, got.rows)  # the loop's look (an injected nan poisons them)
            train = global_batch({**rows, "advantages": advantages(got.rewards_PG).reshape(-1)},
                                 self.batch_sharding)
            train.update(self.logps(state, train, cfg.grpo_iterations > 1))
            for i in range(cfg.grpo_iterations):  # the step counter moves on the last update only
                state, metrics = self.updates[int(i == cfg.grpo_iterations - 1)](state, train)
            jax.block_until_ready(metrics["loss"])  # training_seconds is the updates' own time
            figures = process_mean({"reward": got.rewards_PG.mean(), "reward_std": got.rewards_PG.std(1).mean(),
                                    "completion_length": got.lengths.mean(), "completions_ended": got.ended.mean()})
            figures.update(process_sum({"reward_failures": got.reward_failures,
                                        "reward_timeouts": got.reward_timeouts}))
        return state, {**metrics, **figures, "sampling_seconds": sampled - started,
                       "training_seconds": time.perf_counter() - sampled}

    def evaluate(self, params, opt_state, batches) -> dict[str, float]:
        """The Evaluator's scorer: the eval prompts' greedy mean reward, pass_at_1 and, with
        eval_pass_k, the sampled pass_at_{k} (objectives/rl_eval.py)."""
        return rl_eval.evaluate(self.rollout, self.cfg, params, batches)
