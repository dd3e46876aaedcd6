"""Group Relative Policy Optimization (Shao et al. 2024), `train_objective: grpo`, and its variants
(`loss_algo`: gspo-token, dapo, dr_grpo; objectives/rl_loss.py has their formulas).

Each step takes a batch of prompts (dataset_type=prompts), samples `grpo_num_generations` (G)
completions of each with the KV-cache sampler on the training mesh and scores them with the
recipe's reward functions on the host (objectives/rollout.py), normalises the rewards within
each prompt's group, A = (r − mean_group) / (std_group + 1e-4) (dr_grpo: r − mean_group), then
makes `grpo_iterations` updates on those completions with the clipped ratio objective and, with
β > 0, a KL penalty to the reference (optim.with_reference), per completion token t:

    ρ_t = π(y_t) / π_old(y_t)          (π_old: the policy that sampled; ρ = 1 in the first update)
    ℓ_t = −min(ρ_t A, clip(ρ_t, 1 − ε_low, 1 + ε_high) A) + β · (π_ref/π − log(π_ref/π) − 1)

averaged over all completion tokens of the batch by default (loss_agg_mode; ε_low = grpo_epsilon,
ε_high = epsilon_high, β = grpo_beta). With β = 0 and one iteration the gradient is the
policy-gradient estimate −Σ_t A ∇log π(y_t) / (number of tokens).

Row filters on the host (zero loss weight): `dynamic_sampling` drops the groups whose rewards are
all equal (DAPO's dynamic sampling; groups_dropped logs the share of the sampled groups dropped);
`overlong_filtering` drops completions that never ended. With `dynamic_sampling_max_batches` N > 1
the step refills, as DAPO does: while fewer groups with differing rewards than its batch holds were
found, it draws the next prompt batch from the run's own data iterator (the checkpoint's data position
counts it) and samples it, up to N batches in all; it trains on the first groups found, in the order
sampled, as many as the batch holds (the surplus dropped), and when still short fills the batch with
all-equal groups, which carry no weight (verl and NeMo-RL raise past their maximum instead). On
several processes each keeps its own share of the batch from the groups it sampled (the global batch
keeps its shape and no rows move between hosts), and all sample the next batch while any one of them
is short of differing groups: one small allgather per batch decides it for all. Asynchronous
(off_policy_steps k), a refill takes the batches the sampler read ahead (maxlite/rollout/pipeline.py),
each sampled at most k updates before, and samples the rest when it takes them.
generation_batches logs the batches sampled, groups_kept the share of the train batch's groups that
carry weight; reward and the other figures are over every completion sampled.

A prompt batch's sampling key is a function of (seed, its position in the run's data), whichever
step takes it (its own batch, a refill's, one sampled ahead by an asynchronous run): a resumed run
samples what the uninterrupted run sampled. Metrics under TRL's names: reward,
reward_std (the groups' mean std), kl, clip_ratio, completion_length (the model's tokens: with
rollout_tools the tools' turns are neither counted nor trained on); tis_ratio when the rows carry
the sampler's log-probs; reward_failures / reward_timeouts (scores a failed reward call left at 0,
objectives/rewards.py); with rollout_tools, tool_calls, tool_failures, tool_timeouts (summed) and
turns (the model's turns per completion, mean; maxlite/rollout/tools.py); and sampling_seconds / training_seconds, the split of the step's time.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from maxlite import optim
from maxlite.objectives import NO_CLOCK, Objective, rl_eval, rl_loss
from maxlite.objectives.rollout import Rollout, Scored, process_any, process_mean, process_sum
from maxlite import step as step_lib
from maxlite.step import token_logps

_SALT = 0x6772706F  # the sampling keys' own stream: not the dropout's


# Scored's counts, summed over batches and processes (the tools' three logged with rollout_tools only)
COUNTS = ("reward_failures", "reward_timeouts", "tool_calls", "tool_failures", "tool_timeouts")


def advantages(rewards_PG: np.ndarray, scale: bool = True) -> np.ndarray:
    """Rewards [prompts, G] centred within each group and (`scale`) divided by the group's std + 1e-4
    (zero where a group is all equal)."""
    r = np.asarray(rewards_PG, np.float64)
    centred = r - r.mean(1, keepdims=True)
    return (centred / (r.std(1, keepdims=True) + 1e-4) if scale else centred).astype(np.float32)


def kept_rows(rewards_PG: np.ndarray, ended_R: np.ndarray, dynamic: bool, overlong: bool):
    """(1/0 per row [prompts × G]: whether it keeps its loss weight, the share of groups dropped):
    `dynamic` drops every row of a group whose rewards are all equal, `overlong` a completion that
    did not end."""
    r = np.asarray(rewards_PG)
    equal_P = (r.max(1) == r.min(1)) if dynamic else np.zeros(r.shape[0], bool)
    keep = np.repeat(~equal_P, r.shape[1])
    if overlong:
        keep &= np.asarray(ended_R, bool)
    return keep.astype(np.float32), float(equal_P.mean())


def refill_order(equal_P: np.ndarray, num_groups: int) -> tuple[np.ndarray, int]:
    """(the `num_groups` groups a refilled step trains on, as indices into every group it sampled, in
    order; how many of them have differing rewards): those groups first, in the order sampled, the
    surplus dropped; then, when too few were found, the first all-equal groups (no loss weight)."""
    mixed = np.flatnonzero(~np.asarray(equal_P, bool))
    short = max(num_groups - len(mixed), 0)
    return np.concatenate([mixed[:num_groups], np.flatnonzero(equal_P)[:short]]), min(len(mixed), num_groups)


def concat(parts: list[Scored]) -> Scored:
    """The scored rollouts of several prompt batches as one, groups in order."""
    if len(parts) == 1:
        return parts[0]
    logps = None if parts[0].sampler_logps is None else np.concatenate([p.sampler_logps for p in parts])
    turns = None if parts[0].turns is None else np.concatenate([p.turns for p in parts])
    return Scored(np.concatenate([p.rewards_PG for p in parts]),
                  {k: np.concatenate([p.rows[k] for p in parts]) for k in parts[0].rows},
                  np.concatenate([p.lengths for p in parts]), np.concatenate([p.ended for p in parts]), logps,
                  *(sum(getattr(p, k) for p in parts) for k in COUNTS), turns)


def take_groups(got: Scored, groups_P: np.ndarray) -> Scored:
    """The groups `groups_P` of a scored rollout (each group's G rows with it)."""
    G = got.rewards_PG.shape[1]
    rows_R = (np.asarray(groups_P)[:, None] * G + np.arange(G)).reshape(-1)
    return got._replace(rewards_PG=got.rewards_PG[groups_P], rows={k: v[rows_R] for k, v in got.rows.items()},
                        lengths=got.lengths[rows_R], ended=got.ended[rows_R],
                        sampler_logps=None if got.sampler_logps is None else got.sampler_logps[rows_R],
                        turns=None if got.turns is None else got.turns[rows_R])


def loss_fn(cfg):
    """The objective as a `LossFn` (maxlite/step.py) over the sampled rows: inputs, targets, positions,
    segment_ids, weights (completion tokens), advantages [R], with β > 0 ref_logps [R, T], after the
    first iteration old_logps [R, T] and, when the rollout engine gives them, sampler_logps [R, T];
    the denominator is loss_agg_mode's (rl_loss.aggregate). A mixture of experts adds its auxiliary
    losses per unit of it (routing of every real token of the rows, prompt included, as in pre-training)."""
    def fn(params, graphdef, batch, dropout_key=None):
        logp, stats = step_lib.token_logps_and_stats(params, graphdef, batch, dropout_key)
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logp)
        tis = rl_loss.tis_RT(old, batch["sampler_logps"], cfg.tis_cap) if "sampler_logps" in batch else None
        beta = cfg.rl_beta
        sums, loss, denominator = rl_loss.token_terms(
            logp, old, batch["ref_logps"] if beta else None, batch["advantages"], batch["weights"],
            algo=cfg.loss_algo, agg=cfg.rl_loss_agg_mode, eps_low=cfg.grpo_epsilon, eps_high=cfg.rl_epsilon_high,
            beta=beta, max_new_tokens=cfg.grpo_max_new_tokens, tis_weights_RT=tis)
        return step_lib.with_aux_losses(cfg, loss, sums, stats, denominator)
    return fn


class GRPOStep(Objective):
    """The train step of a GRPO run: like the compiled LM step, but the rollout (sampling, rewards)
    runs between compiled pieces, on the host, in the loop's `rollout` section."""

    def __init__(self, cfg, graphdef, tx, schedule, shardings, batch_sharding):
        from maxlite import step as step_lib
        from maxlite.rollout.pipeline import RolloutPipeline
        from maxlite.state import split_trainable

        self.cfg, self.batch_sharding = cfg, batch_sharding
        self.rollout = Rollout(cfg, graphdef)
        self.reads_ahead = cfg.off_policy_steps
        self.draw = None  # the loop's data: the refill's further prompt batches (draw_from)
        self.taken = None  # → the batches of the loop's data taken so far (the next one's position)
        self.rollouts = RolloutPipeline(cfg, self.rollout, self.sampling_key, shardings.params,
                                        list(batch_sharding.mesh.devices.flat))

        def logps(state, rows, with_old: bool):
            reference = optim.reference_policy(state.opt_state, split_trainable(state.params)[1])
            out = {}  # no reference with β = 0 (optim.keeps_reference)
            if reference is not None:
                out["ref_logps"] = token_logps(reference, graphdef, rows)
            if with_old:
                out["old_logps"] = token_logps(state.params, graphdef, rows)
            return out

        self.logps = jax.jit(logps, static_argnums=2)
        common = (cfg, graphdef, tx, schedule, shardings, batch_sharding)
        self.updates = [step_lib.jit_step(*common, loss_fn(cfg), advance=a) for a in (0, 1)]
        super().__init__(self.updates[1], self.evaluate)

    def sampling_key(self, position: int):
        """The sampling key of the prompt batch at `position` in the run's data (the batches read before
        it), a function of (seed, position) alone: a resumed or rolled-back run samples a batch with the
        key the uninterrupted run used for it, whichever step takes it."""
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.seed), _SALT), position)

    def read_ahead(self, peek) -> None:
        self.rollouts.upcoming = peek

    def draw_from(self, draw, taken) -> None:
        self.draw, self.taken = draw, taken

    def refill(self, params, got: Scored, figures: dict, step: int) -> tuple[Scored, Scored, dict]:
        """(the groups step `step` trains on, every completion it sampled, the rollouts' figures with the
        refill's): further prompt batches of the run's data taken while fewer than a batch of groups have
        differing rewards (dynamic_sampling_max_batches in all)."""
        from maxlite.mesh import global_batch

        def equal(s):
            return s.rewards_PG.max(1) == s.rewards_PG.min(1)

        parts, wanted = [got], got.rewards_PG.shape[0]  # this process's groups: its share of the batch
        found = int((~equal(got)).sum())
        # every process samples each further batch (one collective program), so the decisions are global:
        # go on while any process has fewer than its share, stop when the data ended
        while len(parts) < self.cfg.dynamic_sampling_max_batches and process_any(found < wanted):
            local = self.draw()
            if process_any(local is None):  # the data ended (at one global batch for all): train on what was found
                break
            batch = global_batch(local, self.batch_sharding)
            more, seen = self.rollouts.take(params, batch, step, self.taken() - 1)
            parts.append(more)
            # the stalest batch, the longest push, the workers' counts so far; the sampling time summed
            figures = {k: v + seen[k] if k == "rollout_seconds" else max(v, seen[k]) for k, v in figures.items()}
            found += int((~equal(more)).sum())
        every = concat(parts)
        groups, kept = refill_order(equal(every), wanted)
        return take_groups(every, groups), every, {**figures, "generation_batches": len(parts),
                                                   **process_mean({"groups_kept": kept / wanted})}

    def restore(self, state, step: int, files) -> None:
        self.rollouts.restart()  # a resume or rollback: what was sampled ahead is another run's

    def data_rows(self, step: int) -> None:
        return None  # it trains on the completions it samples, not on the prompts' rows

    def __call__(self, state, batch, step: int, clock=NO_CLOCK):
        from maxlite.mesh import global_batch

        cfg = self.cfg
        started = time.perf_counter()
        with clock.section("rollout", productive=True):  # sampling, the host gather, the rewards
            got, placed = self.rollouts.take(state.params, batch, step, self.taken() - 1)  # the loop's batch
            every = got
            if cfg.dynamic_sampling_max_batches > 1:
                got, every, placed = self.refill(state.params, got, placed, step)
            self.rollouts.ahead(state.params, step, self.taken())  # asynchronous: the next batches' samples
        sampled = time.perf_counter()
        filtered = {}
        rows = got.rows
        if got.sampler_logps is not None and cfg.grpo_temperature == 1.0:
            # the engine's log-probs are of the distribution it sampled from, softmax(logits / T) cut by
            # grpo_top_k / grpo_top_p and renormalised: at T = 1 π_old / π_sampler is the importance ratio
            # against that behaviour policy, the cut included (a cut token's ratio is its kept mass Z ≤ 1)
            rows = {**rows, "sampler_logps": got.sampler_logps}
        if cfg.dynamic_sampling or cfg.overlong_filtering:
            keep_R, _ = kept_rows(got.rewards_PG, got.ended, cfg.dynamic_sampling, cfg.overlong_filtering)
            rows = {**rows, "weights": rows["weights"] * keep_R[:, None]}
            equal_P = every.rewards_PG.max(1) == every.rewards_PG.min(1)  # of every group sampled
            filtered = {"groups_dropped": float(equal_P.mean())} if cfg.dynamic_sampling else {}
        with clock.device_wait():
            rows = clock.train_rows(step + 1, rows)  # the loop's look (an injected nan poisons them)
            adv = advantages(got.rewards_PG, scale=cfg.loss_algo != "dr_grpo").reshape(-1)
            train = global_batch({**rows, "advantages": adv}, self.batch_sharding)
            train.update(self.logps(state, train, cfg.grpo_iterations > 1))
            for i in range(cfg.grpo_iterations):  # the step counter moves on the last update only
                state, metrics = self.updates[int(i == cfg.grpo_iterations - 1)](state, train)
            jax.block_until_ready(metrics["loss"])  # training_seconds is the updates' own time
            figures = process_mean({"reward": every.rewards_PG.mean(), "reward_std": every.rewards_PG.std(1).mean(),
                                    "completion_length": every.lengths.mean(), "completions_ended": every.ended.mean(),
                                    **filtered})
            if every.turns is not None:  # rollout_tools: the model's turns per completion, the calls, their failures
                figures.update(process_mean({"turns": every.turns.mean()}))
            figures.update(process_sum({k: getattr(every, k) for k in COUNTS[:2 if every.turns is None else 5]}))
        return state, {**metrics, **figures, **placed, "sampling_seconds": sampled - started,
                       "training_seconds": time.perf_counter() - sampled}

    def evaluate(self, params, opt_state, batches) -> dict[str, float]:
        """The Evaluator's scorer: the eval prompts' greedy mean reward, pass_at_1 and, with
        eval_pass_k, the sampled pass_at_{k} (objectives/rl_eval.py)."""
        return rl_eval.evaluate(self.rollout, self.cfg, params, batches)
