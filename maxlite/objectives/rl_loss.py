"""The policy losses of GRPO-style training (objectives/grpo.py), `loss_algo` × `loss_agg_mode`: pure
functions of per-token log-probabilities. Shapes: R rows (completions), T positions; w_RT is the
loss mask (1 on a completion's tokens; 0 on the prompt, padding and rows filtered out).

Ratio (sg: stop-gradient; old: the policy that sampled, sg[logp] in the first update):

    grpo, dapo, dr_grpo   ρ_t = exp(logp_t − old_t)
    gspo-token            ρ_t = sg[s] · exp(logp_t − sg[logp_t]),  s = exp(Σ_t w_t (logp_t − old_t) / Σ_t w_t)
                          (Zheng et al. 2025: the value is the sequence's ratio s, the gradient each token's)

Per token, with A the row's advantage (objectives/grpo.py: advantages):

    ℓ_t = −c_t · min(ρ_t A, clip(ρ_t, 1 − ε_low, 1 + ε_high) A) + β (exp(ref_t − logp_t) − (ref_t − logp_t) − 1)

c_t = sg[min(exp(old_t − sampler_t), C)] when the batch has the rollout engine's log-probabilities
(truncated importance sampling, Yao et al. 2025; as verl's, it weights the policy term only, the KL
is a regulariser on the sampled tokens), else 1. Aggregation → (loss sum, denominator); the step
divides the (micro-batches') sums by their summed denominators:

    token-mean                 Σ_i Σ_t w ℓ            /  Σ_i Σ_t w
    sequence-mean-token-mean   Σ_i (Σ_t w ℓ / Σ_t w)  /  number of rows with a token
    sequence-sum               Σ_i Σ_t w ℓ / L        /  R          (L = grpo_max_new_tokens: Dr. GRPO)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "sequence-mean-token-mean", "sequence-sum")


def ratio_RT(logp_RT, old_RT, w_RT, algo: str):
    """ρ_t of `algo`: the token's own ratio, or (gspo-token) the sequence's with the token's gradient."""
    if algo != "gspo-token":
        return jnp.exp(logp_RT - old_RT)
    n_R = jnp.maximum(jnp.sum(w_RT, axis=1), 1.0)
    log_s_R = jax.lax.stop_gradient(jnp.sum(w_RT * (logp_RT - old_RT), axis=1) / n_R)
    return jnp.exp(log_s_R[:, None] + (logp_RT - jax.lax.stop_gradient(logp_RT)))


def clipped_RT(ratio_RT, adv_R, eps_low: float, eps_high: float):
    """(−min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high) A), whether the clip is what counts) per token."""
    a = adv_R[:, None]
    unclipped, clipped = ratio_RT * a, jnp.clip(ratio_RT, 1 - eps_low, 1 + eps_high) * a
    per_token = -jnp.minimum(unclipped, clipped)
    is_clipped = ((ratio_RT < 1 - eps_low) & (a < 0)) | ((ratio_RT > 1 + eps_high) & (a > 0))
    return per_token, is_clipped


def kl_RT(logp_RT, ref_RT):
    """Schulman's k3 estimate of KL(π ‖ π_ref) per sampled token (non-negative, unbiased)."""
    diff = ref_RT - logp_RT
    return jnp.exp(diff) - diff - 1


def tis_RT(old_RT, sampler_RT, cap: float):
    """Truncated importance weights min(π_old / π_sampler, cap), no gradient."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_RT - sampler_RT), cap))


def aggregate(x_RT, w_RT, mode: str, max_new_tokens: int):
    """(sum, denominator) of the per-token `x_RT` under `mode` (AGG_MODES)."""
    if mode == "token-mean":
        return jnp.sum(w_RT * x_RT), jnp.sum(w_RT)
    if mode == "sequence-mean-token-mean":
        n_R = jnp.sum(w_RT, axis=1)
        return (jnp.sum(jnp.sum(w_RT * x_RT, axis=1) / jnp.maximum(n_R, 1.0)),
                jnp.sum((n_R > 0).astype(jnp.float32)))
    assert mode == "sequence-sum", mode
    return jnp.sum(w_RT * x_RT) / max_new_tokens, jnp.asarray(x_RT.shape[0], jnp.float32)


def token_terms(logp_RT, old_RT, ref_RT, adv_R, w_RT, *, algo: str = "grpo", agg: str = "token-mean",
                eps_low: float = 0.2, eps_high: float = 0.2, beta: float = 0.04, max_new_tokens: int = 1,
                tis_weights_RT=None):
    """({metric: sum}, loss sum, denominator) of the objective above. The metrics (kl, clip_ratio,
    tis_ratio) are per-token means once divided by the denominator, whatever the aggregation. With
    β = 0 `ref_RT` is not read (None: no reference) and no kl is reported."""
    ratio = ratio_RT(logp_RT, old_RT, w_RT, algo)
    per_token, is_clipped = clipped_RT(ratio, adv_R, eps_low, eps_high)
    metrics_RT = {}
    if tis_weights_RT is not None:
        per_token = tis_weights_RT * per_token
        metrics_RT["tis_ratio"] = tis_weights_RT
    if beta:
        kl = kl_RT(logp_RT, ref_RT)
        per_token = per_token + beta * kl
        metrics_RT["kl"] = kl
    metrics_RT["clip_ratio"] = is_clipped
    loss, denominator = aggregate(per_token, w_RT, agg, max_new_tokens)
    sums = {name: jnp.sum(w_RT * m) for name, m in metrics_RT.items()}
    if agg != "token-mean":  # per-token means still, once divided by a denominator of rows
        scale = denominator / jnp.maximum(jnp.sum(w_RT), 1.0)
        sums = {name: v * scale for name, v in sums.items()}
    return {"loss": loss, **sums}, loss, denominator
