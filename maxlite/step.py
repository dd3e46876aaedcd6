"""Loss, train_step and eval_step: pure functions of (state, batch); no I/O, no host syncs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from maxlite import optim
from maxlite.models import context, loss as loss_lib, moe, mtp
from maxlite.models.vision.towers import batch_images
from maxlite.state import TrainState, join, split_trainable

Batch = dict[str, jax.Array]  # inputs, targets, positions, segment_ids: int32 [B, T]; weights: f32


def loss_sums(params, graphdef, batch: Batch, z_loss_weight: float = 0.0, dropout_key=None):
    """(sum of weighted loss incl. z-loss and a MoE model's auxiliary losses, ({metric: sum},
    number of real tokens)): the metrics are "loss" (the cross-entropy) and, for a mixture of
    experts, moe.step_metrics' (per-batch means, weighted by the batch's tokens so that they add up
    over micro-batches like the rest); `dropout_key` only when training with lora_dropout > 0. With
    context parallelism and load balance every [B, T] array is put into the balanced layout here,
    once, together (after the step's batch_hash, which sees the batch as the data gave it):
    maxlite/models/context.py."""
    model = nnx.merge(graphdef, params)
    shards = context.shards()
    if context.balanced(model.cfg):
        batch = context.balance_batch(batch, shards)
    weights_BT = batch["weights"]
    weights = jnp.sum(weights_BT)
    x_BTD, stats = model.forward(batch["inputs"], batch["positions"], batch["segment_ids"], dropout_key,
                                 batch_images(model.cfg, batch))
    n = loss_lib.num_chunks(model.cfg, batch["inputs"].shape[1], shards)
    if n > 1:  # never holds [B, T, V] logits
        spec, head = model.head()
        loss_sum, xent_sum = loss_lib.chunked_loss_sums(x_BTD, head, batch["targets"], weights_BT,
                                                        float(z_loss_weight), n, spec,
                                                        float(model.cfg.final_logit_softcapping))
    else:
        logits_BTV = model.logits(x_BTD)
        log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
        target_logit_BT = jnp.take_along_axis(logits_BTV, batch["targets"][..., None], axis=-1)[..., 0]
        xent_sum = jnp.sum((log_z_BT - target_logit_BT) * weights_BT)
        loss_sum = xent_sum + z_loss_weight * jnp.sum(jnp.square(log_z_BT) * weights_BT)
    sums = {"loss": xent_sum}
    if model.cfg.mtp_num_layers:  # multi-token prediction: its own loss, scaled into the objective
        mtp_loss, mtp_stats = mtp.loss(model, x_BTD, batch)
        if mtp_stats is not None:  # the depths' MoE layers after the model's (moe.update_routed_bias)
            stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats)
        loss_sum = loss_sum + weights * model.cfg.mtp_loss_scaling_factor * mtp_loss
        sums["mtp_loss"] = weights * mtp_loss
    return with_aux_losses(model.cfg, loss_sum, sums, stats, weights)


def with_aux_losses(cfg, loss_sum, sums: dict, stats, denominator):
    """A mixture of experts' auxiliary losses (load balance, router z) added to an objective's
    (loss sum, {metric: sum}) for the policy's forward pass(es) whose routing statistics are
    `stats` (None: a dense model, nothing added): per unit of the objective's denominator (tokens,
    preference pairs), so that after the division they add as they do to the mean cross-entropy,
    and their metrics (moe.step_metrics) reported as sums like the rest. Every objective's policy
    forward goes through here; a reference policy's adds nothing."""
    if stats is None:
        return loss_sum, (sums, denominator)
    losses = moe.aux_losses(cfg, stats)
    loss_sum = loss_sum + denominator * moe.objective_terms(cfg, losses)
    sums = {**sums, **{k: denominator * v for k, v in moe.step_metrics(cfg, losses).items()}}
    if moe.balances_routing(cfg):  # the per-expert load the train step balances the routing bias by
        sums["moe_expert_load"] = denominator * losses["moe_expert_load"]
    return loss_sum, (sums, denominator)


def pooled_stats(*stats):
    """Routing statistics of several forward passes as those of one pass over all their rows
    (they are sums over tokens): DPO's chosen and rejected sides, as TRL's concatenated forward."""
    return None if stats[0] is None else jax.tree.map(lambda *a: sum(a), *stats)


def token_logps_and_stats(params, graphdef, rows: Batch, dropout_key=None):
    """(log p(target_t) at every position [B, T] (float32), the MoE layers' routing statistics or
    None): what the alignment objectives compare, and what their auxiliary losses need. (It holds
    the [B, T, V] logits: the chunked head of `loss_sums` returns sums only.)"""
    model = nnx.merge(graphdef, params)
    x_BTD, stats = model.forward(rows["inputs"], rows["positions"], rows["segment_ids"], dropout_key,
                                 batch_images(model.cfg, rows))
    logits_BTV = model.logits(x_BTD)
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, rows["targets"][..., None], axis=-1)[..., 0]
    return target_logit_BT - log_z_BT, stats


def token_logps(params, graphdef, rows: Batch, dropout_key=None) -> jax.Array:
    """log p(target_t) at every position [B, T] (a reference policy's, or the sampler's old policy)."""
    return token_logps_and_stats(params, graphdef, rows, dropout_key)[0]


def _microbatches(batch: Batch, num: int) -> Batch:
    """[B, T] → [num, B/num, T] so that each micro-batch keeps the rows a device already holds."""
    def split(x):
        b = x.shape[0] // num
        return jnp.swapaxes(x.reshape(b, num, *x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def lm_loss(z_loss_weight: float = 0.0):
    """The language-model objective as a `LossFn`: token-weighted cross-entropy (+ z-loss, + a
    MoE model's auxiliary losses)."""
    def fn(params, graphdef, batch: Batch, dropout_key=None):
        return loss_sums(params, graphdef, batch, z_loss_weight, dropout_key)
    return fn


# LossFn(params, graphdef, batch, dropout_key) → (loss sum to differentiate, ({metric: sum}, denominator)):
#   the step's loss is the sum over the (accumulated) batch divided by the denominator (real tokens,
#   preference pairs, ...), as are the metrics. A LossFn may carry `prepare(reference, graphdef,
#   batch) → {name: array}`: what it needs from the reference policy (log-probs), computed before
#   differentiation, micro-batch by micro-batch, and added to the batch.


def per_microbatch(fn, batch: Batch, num: int) -> Batch:
    """`fn` over the micro-batches one at a time (the memory of one), its outputs put back in the
    batch's row order."""
    if num == 1:
        return fn(batch)
    out = jax.lax.map(fn, _microbatches(batch, num))
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), out)


def gradients(params, graphdef, batch: Batch, accumulation_steps: int, loss_fn, frozen=None,
              dropout_key=None, grad_dtype: str = "float32"):
    """(gradient w.r.t. `params` of the (possibly accumulated) batch's summed loss / its denominator,
    {metric: sum / denominator}, denominator). `frozen` (LoRA's base weights) takes part in the
    loss and gets no gradient; `dropout_key` (LoRA dropout) is folded with each micro-batch's index.
    Micro-batches' gradients are summed in float32; the result is in `grad_dtype` for a float32
    weight (MaxText's grad_dtype), in the weight's own dtype otherwise."""
    if frozen is None:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    else:  # both differentiated (NNX wants one trace level); the base's gradient is unused and XLA drops it
        both = jax.value_and_grad(lambda p, f, *a: loss_fn(join(p, f), *a), argnums=(0, 1), has_aux=True)

        def grad_fn(p, *a):
            value, (g, _) = both(p, frozen, *a)
            return value, g

    def micro_key(i):
        return None if dropout_key is None else jax.random.fold_in(dropout_key, i)

    if accumulation_steps == 1:
        (_, (sums, denominator)), grads = grad_fn(params, graphdef, batch, micro_key(0))
    else:
        def body(carry, micro_i):
            micro, i = micro_i
            (_, (s, d)), g = grad_fn(params, graphdef, micro, micro_key(i))
            grads_acc, sums_acc, d_acc = carry
            return (jax.tree.map(jnp.add, grads_acc, g), jax.tree.map(jnp.add, sums_acc, s), d_acc + d), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        micro_i = (_microbatches(batch, accumulation_steps), jnp.arange(accumulation_steps))
        shapes = jax.eval_shape(lambda: grad_fn(params, graphdef, jax.tree.map(lambda x: x[0], micro_i[0]),
                                                micro_key(0))[0][1][0])
        init = (zeros, jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shapes), jnp.zeros((), jnp.float32))
        (grads, sums, denominator), _ = jax.lax.scan(body, init, micro_i)
    d = jnp.maximum(denominator, 1.0)
    grads = jax.tree.map(lambda g, p: (g / d).astype(grad_dtype if p.dtype == jnp.float32 else p.dtype), grads, params)
    return grads, jax.tree.map(lambda x: x / d, sums), denominator


def batch_hash(batch: Batch) -> jax.Array:
    """A uint32 fingerprint of the global batch's integer arrays, position by position (row order
    included): the same data gives the same number whatever the mesh or the number of processes
    (integer sums wrap, so the reduction order cannot change it). Compare two runs' data with it."""
    total = jnp.zeros((), jnp.uint32)
    for i, name in enumerate(sorted(batch)):
        x = batch[name]
        if not jnp.issubdtype(x.dtype, jnp.integer):
            continue
        v = x.astype(jnp.uint32) ^ (jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * jnp.uint32(0x9E3779B1)
                                    + jnp.uint32(2 * i + 1))
        v = v * jnp.uint32(0x85EBCA6B)
        total = total + jnp.sum(v ^ (v >> 13), dtype=jnp.uint32)
    return total


def dropout_key(seed: int | None, step: jax.Array):
    """The step's dropout key, a function of (seed, step) alone (a resumed run draws the same
    masks); None when the recipe has no dropout."""
    return None if seed is None else jax.random.fold_in(jax.random.key(seed), step)


def train_step(state: TrainState, batch: Batch, *, graphdef, tx, schedule, accumulation_steps: int,
               loss_fn, dropout_seed: int | None = None, set_reference: bool = False,
               advance=1, balance=None, grad_dtype: str = "float32") -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update. The alignment objectives' reference policy lives in the optimizer
    state (optim.with_reference): `set_reference` makes the updated weights the reference
    (warm-up steps); `advance` is what the step counter moves by (GRPO's inner iterations: 0).
    `balance` (the config, when routed_bias_update_rate > 0): after the update the MoE routing
    biases move toward balance by the step's expert load (moe.update_routed_bias). `grad_dtype`:
    what `gradients` casts a float32 weight's gradient to before the optimizer sees it."""
    trainable, frozen = split_trainable(state.params)
    reference = optim.reference_policy(state.opt_state, frozen)
    if getattr(loss_fn, "prepare", None) is not None and reference is not None:
        batch = {**batch, **per_microbatch(lambda b: loss_fn.prepare(reference, graphdef, b), batch,
                                           accumulation_steps)}
    grads, means, weights = gradients(trainable, graphdef, batch, accumulation_steps, loss_fn, frozen,
                                      dropout_key(dropout_seed, state.step), grad_dtype)
    updates, opt_state = tx.update(grads, state.opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    if set_reference:
        opt_state = optim.set_reference(opt_state, trainable)
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))  # summed in float32
    params = join(trainable, frozen)
    if balance is not None:  # outside the gradient: the bias only chooses experts
        load_LE = means.pop("moe_expert_load")
        means = {**means, "moe_bias_spread": moe.update_routed_bias(balance, params, load_LE)}
    metrics = {
        **means,
        "total_weights": weights,
        "grad_norm": grad_norm,
        "learning_rate": schedule(state.step),
        "finite": jnp.isfinite(means["loss"]) & jnp.isfinite(grad_norm),  # else the update spoils the weights
        "batch_hash": batch_hash(batch),
    }
    return TrainState(step=state.step + advance, params=params, opt_state=opt_state), metrics


def eval_step(params, batch: Batch, *, graphdef) -> dict[str, jax.Array]:
    _, (sums, weights) = loss_sums(params, graphdef, batch)
    return {"loss_sum": sums["loss"], "total_weights": weights}


def jit_train_step(cfg, graphdef, tx, schedule, state_shardings, batch_sharding):
    """The language-model step compiled once with explicit shardings and the state donated (the
    loop's step for every objective comes from maxlite.objectives.make_train_step)."""
    return jit_step(cfg, graphdef, tx, schedule, state_shardings, batch_sharding, lm_loss(cfg.z_loss_weight))


def jit_step(cfg, graphdef, tx, schedule, state_shardings, batch_sharding, loss_fn, **kwargs):
    """A `train_step` with `loss_fn`, compiled once with explicit shardings and the state donated."""
    fn = functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule,
                           accumulation_steps=cfg.gradient_accumulation_steps, loss_fn=loss_fn,
                           dropout_seed=cfg.seed if cfg.lora_rank and cfg.lora_dropout > 0 else None,
                           balance=cfg if moe.balances_routing(cfg) else None, grad_dtype=cfg.grad_dtype,
                           **kwargs)
    return jax.jit(fn, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, None), donate_argnums=0)


def jit_eval_step(graphdef, params_shardings, batch_sharding):
    fn = functools.partial(eval_step, graphdef=graphdef)
    return jax.jit(fn, in_shardings=(params_shardings, batch_sharding))
