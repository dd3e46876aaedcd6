"""The optax chain: warmup then cosine/linear/constant/warmup-stable-decay, global-norm clipping, AdamW; for the
alignment objectives, the reference policy carried in the optimizer state.

DPO and GRPO compare the policy with a frozen reference: the weights the run starts from, or those
at the end of its warm-up steps (`alignment_sft_steps`). `with_reference(tx)` keeps a copy of the
trainable weights in the optimizer state, so the reference is sharded like the policy (optax maps
its shardings like Adam's moments), checkpointed, snapshotted and restored with the rest, and a
params-only start (`load_parameters_path`) makes the loaded weights the reference. With LoRA only the
adapters are trainable: the reference is the frozen base with the copied adapters (B = 0 at the
start: the base model itself), at the adapters' memory cost, not the model's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warmup from 0 over warmup_steps, then decay to lr × final_fraction at the schedule's
    end (`schedule_steps`: learning_rate_schedule_steps or `steps`), held after it. An alignment
    run's `alignment_sft_steps` warm-up (a stand-in for an SFT run) trains at its own constant
    `alignment_sft_learning_rate`; the objective's schedule then spans the steps left."""
    n = cfg.alignment_sft_steps  # 0 unless train_objective is dpo or grpo (config checks)
    if not n or not cfg.alignment_sft_learning_rate:
        return _schedule(cfg)
    rest = _schedule(dataclasses.replace(cfg, learning_rate_schedule_steps=max(cfg.schedule_steps - n, 1)))
    return optax.join_schedules([optax.constant_schedule(cfg.alignment_sft_learning_rate), rest], [n])


def _schedule(cfg) -> optax.Schedule:
    peak, warmup = cfg.learning_rate, cfg.warmup_steps
    decay_steps = max(cfg.schedule_steps - warmup, 1)
    final = peak * cfg.learning_rate_final_fraction
    if cfg.lr_schedule_type == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.learning_rate_final_fraction)
    elif cfg.lr_schedule_type == "linear":
        decay = optax.linear_schedule(peak, final, decay_steps)
    elif cfg.lr_schedule_type == "wsd":
        decay = _stable_then_decay(cfg, peak, final)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


# Warmup-stable-decay's decay shapes: the fraction of (peak - final) left at t ∈ [0, 1] of the decay.
WSD_SHAPES = {
    "linear": lambda t: 1 - t,
    "cosine": lambda t: 0.5 * (1 + jnp.cos(jnp.pi * t)),
    "1-sqrt": lambda t: 1 - jnp.sqrt(t),
}


def _stable_then_decay(cfg, peak: float, final: float) -> optax.Schedule:
    """After warmup: the peak until the schedule's last `wsd_decay_steps`, then the decay to
    `final`, held after the schedule's end. Only the decay depends on `steps`, so a stable-phase
    checkpoint resumed with a larger `steps` keeps every step already taken (a branched decay)."""
    n, shape = cfg.wsd_decay_steps, WSD_SHAPES[cfg.wsd_decay_style]
    stable = cfg.schedule_steps - cfg.warmup_steps - n

    def decay(count):
        t = jnp.clip(count / max(n, 1), 0.0, 1.0)
        return final + (peak - final) * shape(t)

    return optax.join_schedules([optax.constant_schedule(peak), decay], [stable])


def _decay_mask(params):
    """Weight decay on matrices only: norms' scales and biases are not decayed (as in Megatron)."""
    def is_matrix(path, _):
        name = str(getattr(path[-2] if len(path) > 1 else path[-1], "key", ""))
        return not (name.endswith("bias") or name == "scale")
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg) -> optax.GradientTransformation:
    parts = []
    if cfg.gradient_clipping_threshold > 0:
        parts.append(optax.clip_by_global_norm(cfg.gradient_clipping_threshold))
    parts.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2,
                             eps=cfg.adam_eps, weight_decay=cfg.adam_weight_decay,
                             mask=_decay_mask))
    tx = optax.chain(*parts)
    return with_reference(tx) if keeps_reference(cfg) else tx


def keeps_reference(cfg) -> bool:
    """Whether the optimizer state carries the reference's weights: DPO and GRPO, unless DPO reads
    the reference's log-probabilities from a table computed before step 0 (dpo_precompute_reference)."""
    return cfg.train_objective in ("dpo", "grpo") and not cfg.dpo_precompute_reference


class WithReference(NamedTuple):
    inner: optax.OptState
    ref: Any  # the reference's trainable weights (the frozen ones are the policy's own)


def with_reference(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    def init(params):
        return WithReference(tx.init(params), jax.tree.map(lambda p: p, params))

    def update(grads, state, params=None):
        updates, inner = tx.update(grads, state.inner, params)
        return updates, WithReference(inner, state.ref)

    return optax.GradientTransformation(init, update)


def reference_policy(opt_state, frozen):
    """The reference's full weights (no gradient flows into them), or None without a reference."""
    from maxlite.state import join

    if not isinstance(opt_state, WithReference):
        return None
    return join(jax.lax.stop_gradient(opt_state.ref), frozen)


def set_reference(opt_state, trainable):
    """The same optimizer state with `trainable` as the reference (the end of the warm-up)."""
    return opt_state._replace(ref=trainable) if isinstance(opt_state, WithReference) else opt_state
