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
import optax.contrib
from flax import nnx
from optax.contrib import MuonDimensionNumbers


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


# Muon's matrices: axes that index separate matrices (a scanned stack's layer, an MoE expert), and
# the residual stream's axis, which a projection either reads (q, gate: reduction) or writes (o, down).
BATCH_AXES = ("layers", "exp")
EMBED_AXES = ("embed", "embed_no_exp")


def muon_split(params) -> dict[tuple[str, ...], MuonDimensionNumbers | None]:
    """THE split of opt_type=muon, by each parameter's logical axes: a weight with two or more axes
    besides BATCH_AXES, none of them `vocab` (embeddings, the output head) or `norm`, is a batch of
    matrices for Muon: the axes after the first other axis are its output (q [D, N, H] is a
    D × (N·H) matrix), unless its last axis is the residual stream's, then that one is (o [N, H, D]
    is (N·H) × D). Everything else (None) takes AdamW. Keys: the parameter's path (`path_key`)."""
    split = {}
    for path, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = tuple(v.get_metadata().get("out_sharding") or ()) if isinstance(v, nnx.Variable) else ()
        own = [i for i, name in enumerate(names) if name not in BATCH_AXES]
        if len(own) < 2 or any(names[i] in ("vocab", "norm") for i in own):
            split[path_key(path)] = None
        elif names[own[-1]] in EMBED_AXES:
            split[path_key(path)] = MuonDimensionNumbers(reduction_axis=tuple(own[:-1]), output_axis=own[-1])
        else:
            split[path_key(path)] = MuonDimensionNumbers(reduction_axis=own[0], output_axis=tuple(own[1:]))
    return split


def path_key(path) -> tuple[str, ...]:
    """A parameter's path by its names, the same for a Variable and for its bare array."""
    names = (str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return tuple(n for n in names if n not in ("value", "raw_value"))


def describe_split(split) -> str:
    """One line for the run's log: which parameters Muon updates and which AdamW does."""
    muon = ["/".join(k) for k, d in split.items() if d is not None]
    adamw = ["/".join(k) for k, d in split.items() if d is None]
    return f"maxlite: opt_type=muon: Muon on {', '.join(muon) or 'nothing'}; AdamW on {', '.join(adamw) or 'nothing'}"


def _muon(cfg, schedule, split) -> optax.GradientTransformation:
    """optax's Muon on the matrices of `split`, maxlite's AdamW (no decay on norms and biases) on the rest."""
    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "adamw" if split[path_key(path)] is None else "muon", params)

    def dimensions(params):  # the Muon side's tree: the other leaves arrive masked
        return jax.tree_util.tree_map_with_path(lambda path, _: split[path_key(path)], params)

    return optax.partition({
        "muon": optax.contrib.muon(schedule, beta=cfg.muon_beta, weight_decay=cfg.muon_weight_decay,
                                   consistent_rms=cfg.muon_consistent_rms or None, mu_dtype=cfg.first_moment_dtype,
                                   muon_weight_dimension_numbers=dimensions),
        "adamw": _adamw(cfg, schedule),
    }, labels)


def _adamw(cfg, schedule) -> optax.GradientTransformation:
    """optax's AdamW, no decay on norms and biases; the first moment kept in `first_moment_dtype`
    (MaxText's mu_dtype: weight_dtype unless set), the second in the weights' dtype."""
    return optax.adamw(schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                       weight_decay=cfg.adam_weight_decay, mask=_decay_mask, mu_dtype=cfg.first_moment_dtype)


def make_optimizer(cfg) -> optax.GradientTransformation:
    """Clipping, then AdamW, or Muon + AdamW split over the trainable parameters (LoRA: the adapters)."""
    parts = []
    if cfg.gradient_clipping_threshold > 0:
        parts.append(optax.clip_by_global_norm(cfg.gradient_clipping_threshold))
    schedule = learning_rate_schedule(cfg)
    if cfg.opt_type == "muon":
        parts.append(_muon(cfg, schedule, muon_split(_trainable(cfg))))
    else:
        parts.append(_adamw(cfg, schedule))
    tx = optax.chain(*parts)
    return with_reference(tx) if keeps_reference(cfg) else tx


def _trainable(cfg):
    from maxlite.state import abstract_params, split_trainable
    return split_trainable(abstract_params(cfg)[1])[0]


def keeps_reference(cfg) -> bool:
    """Whether the optimizer state carries the reference's weights: DPO, unless it reads the
    reference's log-probabilities from a table computed before step 0 (dpo_precompute_reference),
    and GRPO with a KL penalty (β = 0 reads no reference: no copy is made)."""
    if cfg.train_objective == "grpo":
        return cfg.rl_beta > 0
    return cfg.train_objective == "dpo" and not cfg.dpo_precompute_reference


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
