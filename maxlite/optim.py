"""The optax chain: warmup then cosine/linear/constant, global-norm clipping, AdamW."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warmup from 0 over warmup_steps, then decay to lr × final_fraction at `steps`."""
    peak, warmup = cfg.learning_rate, cfg.warmup_steps
    decay_steps = max(cfg.steps - warmup, 1)
    final = peak * cfg.learning_rate_final_fraction
    if cfg.lr_schedule_type == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.learning_rate_final_fraction)
    elif cfg.lr_schedule_type == "linear":
        decay = optax.linear_schedule(peak, final, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


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
    if cfg.train_objective in ("dpo", "grpo"):  # the reference policy rides in the optimizer state
        from maxlite.objectives import reference
        tx = reference.wrap(tx)
    return tx
