"""Group Relative Policy Optimization (Shao et al. 2024), `train_objective: grpo`.

Each step takes a batch of prompts (dataset_type=prompts), samples `grpo_num_generations` (G)
completions of each with the KV-cache sampler (models/decode.py) on the training mesh, scores them
with the recipe's reward functions (maxlite/rewards.py) on the host, normalises the rewards within
each prompt's group, A = (r − mean_group) / (std_group + 1e-4), then makes `grpo_iterations`
updates on those completions with the clipped ratio objective and a KL penalty to the reference
(objectives/reference.py), per completion token t:

    ρ_t = π(y_t) / π_old(y_t)          (π_old: the policy that sampled; ρ = 1 in the first update)
    ℓ_t = −min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A) + β · (π_ref/π − log(π_ref/π) − 1)

averaged over all completion tokens of the batch (ε = grpo_epsilon, β = grpo_beta). With β = 0 and
one iteration the gradient is the policy-gradient estimate −Σ_t A ∇log π(y_t) / (number of tokens).

The sampling key is a function of (seed, step): a resumed run samples what the uninterrupted run
sampled. Metrics under TRL's names: reward, reward_std (the groups' mean std), kl, clip_ratio,
completion_length; and sampling_seconds / training_seconds, the split of the step's time.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxlite.objectives.dpo import view

_SALT = 0x6772706F  # the sampling keys' own stream: not the dropout's


def advantages(rewards_PG: np.ndarray) -> np.ndarray:
    """Rewards [prompts, G] normalised within each group (zero where a group is all equal)."""
    r = np.asarray(rewards_PG, np.float64)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).astype(np.float32)


def token_logps(params, graphdef, rows: dict, dropout_key=None) -> jax.Array:
    """log π(target_t) for every position [B, T]."""
    model = nnx.merge(graphdef, params)
    logits_BTV = model(rows["inputs"], rows["positions"], rows["segment_ids"], dropout_key)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    return jnp.take_along_axis(logp_BTV, rows["targets"][..., None], axis=-1)[..., 0]


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
    after the first iteration, old_logps [R, T]; the denominator is the number of completion tokens."""
    def fn(params, graphdef, batch, dropout_key=None):
        logp = token_logps(params, graphdef, batch, dropout_key)
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logp)
        sums, loss = token_terms(logp, old, batch["ref_logps"], batch["advantages"], batch["weights"],
                                 cfg.grpo_epsilon, cfg.grpo_beta)
        return loss, (sums, jnp.sum(batch["weights"]))
    return fn


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


class GRPOStep:
    """The train step of a GRPO run: `(state, batch) → (state, metrics)` like the jitted LM step,
    but sampling and rewards run between compiled pieces, so it is a Python object."""

    def __init__(self, cfg, graphdef, tx, schedule, shardings, batch_sharding):
        from maxlite import rewards, step as step_lib
        from maxlite.data.chat import ChatTemplate
        from maxlite.data.tokenizer import load_tokenizer
        from maxlite.models import decode
        from maxlite.objectives import reference as ref_lib
        from maxlite.state import split_trainable

        self.cfg, self.batch_sharding = cfg, batch_sharding
        self.tok = load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
        self.marker = end_of_turn(ChatTemplate.for_config(cfg, self.tok))
        self.reward_fns = rewards.load(cfg.reward_functions)
        self.reward_weights = list(cfg.reward_weights) or [1.0] * len(self.reward_fns)
        G, N = cfg.grpo_num_generations, cfg.grpo_max_new_tokens
        eos = -1 if self.tok.eos_id is None else int(self.tok.eos_id)

        def sample(params, prompt_ids, lengths, key, temperature, generations):
            return decode.generate_tokens(
                graphdef, params, jnp.repeat(prompt_ids, generations, 0), jnp.repeat(lengths, generations, 0),
                key, max_new_tokens=N, temperature=temperature, top_k=0, top_p=1.0, eos_id=eos)[0]

        self.sample = jax.jit(functools.partial(sample, temperature=cfg.grpo_temperature, generations=G))
        self.greedy = jax.jit(functools.partial(sample, temperature=0.0, generations=1))

        def logps(state, rows, with_old: bool):
            trainable, frozen = split_trainable(state.params)
            out = {"ref_logps": token_logps(ref_lib.policy(state.opt_state, frozen), graphdef, rows)}
            if with_old:
                out["old_logps"] = token_logps(state.params, graphdef, rows)
            return out

        self.logps = jax.jit(logps, static_argnums=2)
        common = (cfg, graphdef, tx, schedule, shardings, batch_sharding)
        self.updates = [step_lib.jit_step(*common, loss_fn(cfg), advance=a) for a in (0, 1)]
        self.warm = (step_lib.jit_step(*common, step_lib.lm_loss(cfg.z_loss_weight), set_reference=True)
                     if cfg.alignment_sft_steps else None)
        self.step = None  # the host's count, read from the state once

    def __call__(self, state, batch):
        if self.step is None:
            self.step = int(jax.device_get(state.step))
        step, self.step = self.step, self.step + 1
        records = batch.pop("host_records")
        if step < self.cfg.alignment_sft_steps:
            return self.warm(state, view(batch, "sft_"))
        return self._grpo(state, batch, records, step)

    def _local_rows(self, global_array) -> np.ndarray:
        """This process's rows of a batch-sharded array, in order."""
        from jax.experimental import multihost_utils

        full = np.asarray(multihost_utils.process_allgather(global_array, tiled=True))
        n = full.shape[0] // jax.process_count()
        return full[jax.process_index() * n:(jax.process_index() + 1) * n]

    def completions(self, params, batch, key, greedy: bool = False):
        """(local prompt ids, their lengths, the sampled tokens per local row [n·G, N])."""
        fn = self.greedy if greedy else self.sample
        tokens = self._local_rows(fn(params, batch["prompt_ids"], batch["prompt_lengths"], key))
        return self._local_rows(batch["prompt_ids"]), self._local_rows(batch["prompt_lengths"]), tokens

    def score(self, prompt_ids, lengths, tokens, records, generations: int):
        """(rewards [n, G], rows for training (numpy, local), completion lengths, ended flags)."""
        from maxlite import rewards
        from maxlite.data.preference import row

        decode = self.tok.decode
        prompts, texts, rows, lens, ended = [], [], [], [], []
        recs = [json.loads(str(r)) for r in records]
        for i, toks in enumerate(tokens.tolist()):
            p = i // generations
            prompt = prompt_ids[p, :lengths[p]]
            done, text, end = cut(toks, decode, self.marker, self.tok.eos_id)
            prompts.append(decode(prompt.tolist()))
            texts.append(text)
            lens.append(len(done))
            ended.append(end)
            ids = np.concatenate([prompt, np.asarray(done, np.int32)])
            mask = np.arange(len(ids)) >= len(prompt)
            rows.append(row(ids, mask, self.cfg.max_target_length))
        r = rewards.score(self.reward_fns, self.reward_weights, self.cfg.reward_functions, prompts, texts,
                          [recs[i // generations] for i in range(len(texts))])
        stacked = {k: np.stack([x[k] for x in rows]) for k in rows[0]}
        return np.asarray(r, np.float32).reshape(-1, generations), stacked, np.asarray(lens), np.asarray(ended)

    def _grpo(self, state, batch, records, step: int):
        cfg = self.cfg
        started = time.perf_counter()
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), _SALT), step)
        prompt_ids, lengths, tokens = self.completions(state.params, batch, key)
        rewards_PG, rows, lens, ended = self.score(prompt_ids, lengths, tokens, records, cfg.grpo_num_generations)
        rows["advantages"] = advantages(rewards_PG).reshape(-1)
        sampled = time.perf_counter()
        train = {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in rows.items()}
        train.update(self.logps(state, train, cfg.grpo_iterations > 1))
        for i in range(cfg.grpo_iterations):
            state, metrics = self.updates[int(i == cfg.grpo_iterations - 1)](state, train)
        jax.block_until_ready(metrics["loss"])
        local = {"reward": rewards_PG.mean(), "reward_std": rewards_PG.std(1).mean(),
                 "completion_length": lens.mean(), "completions_ended": ended.mean()}
        if jax.process_count() > 1:  # every process's share: the metric of the global batch
            from jax.experimental import multihost_utils
            local = {k: float(np.mean(multihost_utils.process_allgather(np.float32(v)))) for k, v in local.items()}
        done = time.perf_counter()
        return state, {**metrics, **{k: float(v) for k, v in local.items()},
                       "sampling_seconds": sampled - started, "training_seconds": done - sampled}

    def evaluate(self, params, batches, steps: int) -> dict[str, float]:
        """Greedy completions of the eval prompts: their mean reward and completion length."""
        rewards, lens = [], []
        for _ in range(steps):
            try:
                local = next(batches)
            except StopIteration:
                break
            records = local.pop("host_records")
            batch = {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local.items()}
            prompt_ids, lengths, tokens = self.completions(params, batch, jax.random.key(0), greedy=True)
            r, _, n, _ = self.score(prompt_ids, lengths, tokens, records, 1)
            rewards.append(r.reshape(-1))
            lens.append(n)
        if not rewards:
            raise ValueError("the eval split gave no batch: check eval_dataset_path")
        out = {"reward": float(np.concatenate(rewards).mean()), "completion_length": float(np.concatenate(lens).mean())}
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            out = {k: float(np.mean(multihost_utils.process_allgather(np.float32(v)))) for k, v in out.items()}
        return out
