"""Direct Preference Optimization (Rafailov et al. 2023), `train_objective: dpo`.

For a pair (prompt x, chosen y_w, rejected y_l), with log π(y|x) summed over the response's
tokens and π_ref the frozen reference (optim.with_reference):

    z = β · [(log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x))]
    loss = −(1 − ε) · log σ(z) − ε · log σ(−z)        (ε = dpo_label_smoothing, cDPO)

averaged over the batch's pairs. Metrics under TRL's names: rewards/chosen = β(log π − log π_ref)
of y_w, rewards/rejected the same of y_l, rewards/margins their difference, rewards/accuracies
the fraction with chosen > rejected; logps/chosen and logps/rejected; and policy_accuracy, the
fraction where the policy itself gives y_w the higher log-probability (what eval reports too).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxlite import optim
from maxlite.objectives import view
from maxlite import step as step_lib

SIDES = ("chosen", "rejected")


def sequence_logps(params, graphdef, rows: dict, dropout_key=None) -> jax.Array:
    """Σ_t weights · log p(target_t): each row's log-probability of its weighted tokens [B]."""
    return sequence_logps_and_stats(params, graphdef, rows, dropout_key)[0]


def sequence_logps_and_stats(params, graphdef, rows: dict, dropout_key=None):
    """(each row's Σ_t weights · log p(target_t) [B], a MoE model's routing statistics or None)."""
    logp_BT, stats = step_lib.token_logps_and_stats(params, graphdef, rows, dropout_key)
    return jnp.sum(logp_BT * rows["weights"], axis=-1), stats


def pair_terms(cfg, policy_w, policy_l, ref_w, ref_l, valid):
    """({metric: sum over valid pairs}, loss per pair) from the four log-probabilities [B]."""
    beta, eps = cfg.dpo_beta, cfg.dpo_label_smoothing
    chosen, rejected = beta * (policy_w - ref_w), beta * (policy_l - ref_l)
    z = chosen - rejected
    losses = -(1 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
    v = valid.astype(jnp.float32)
    sums = {"loss": jnp.sum(v * losses), "rewards/chosen": jnp.sum(v * chosen),
            "rewards/rejected": jnp.sum(v * rejected), "rewards/margins": jnp.sum(v * z),
            "rewards/accuracies": jnp.sum(v * (chosen > rejected)),
            "logps/chosen": jnp.sum(v * policy_w), "logps/rejected": jnp.sum(v * policy_l),
            "policy_accuracy": jnp.sum(v * (policy_w > policy_l))}
    return sums, losses


def reference_logps(reference, graphdef, batch) -> dict:
    """The reference's log-probabilities of each side [B] (before differentiation: no gradient)."""
    return {f"ref_{side}_logps": sequence_logps(reference, graphdef, view(batch, side + "_")) for side in SIDES}


def loss_fn(cfg):
    """The DPO objective as a `LossFn` (maxlite/step.py); the denominator is the number of pairs."""
    def fn(params, graphdef, batch, dropout_key=None):
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        rows = {side: view(batch, side + "_") for side in SIDES}
        policy, stats = zip(*(sequence_logps_and_stats(params, graphdef, rows[s], k) for s, k in zip(SIDES, keys)))
        ref = [batch[f"ref_{s}_logps"] for s in SIDES]
        valid = (jnp.sum(rows["chosen"]["weights"], -1) > 0) & (jnp.sum(rows["rejected"]["weights"], -1) > 0)
        sums, _ = pair_terms(cfg, *policy, *ref, valid)
        return step_lib.with_aux_losses(cfg, sums["loss"], sums, step_lib.pooled_stats(*stats),
                                        jnp.sum(valid.astype(jnp.float32)))
    fn.prepare = reference_logps
    return fn


def eval_step(params, reference, batch, *, graphdef, cfg):
    if reference is not None:  # else the batch carries them (objectives/dpo_reference.py)
        batch = {**batch, **reference_logps(reference, graphdef, batch)}
    _, (sums, pairs) = loss_fn(cfg)(params, graphdef, batch)
    sums.pop("moe_expert_load", None)  # the train step's (routing-bias balance), no figure
    return {**sums, "pairs": pairs}


def eval_score(cfg, graphdef):
    """The Evaluator's scorer: DPO's figures over the eval pairs against the reference (the
    optimizer state's, or the batches' precomputed columns)."""
    from maxlite.state import split_trainable

    step = jax.jit(functools.partial(eval_step, graphdef=graphdef, cfg=cfg))

    def score(params, opt_state, batches) -> dict[str, float]:
        reference = optim.reference_policy(opt_state, split_trainable(params)[1])
        totals = {}
        for batch in batches:
            out = step(params, reference, batch)
            totals = {k: totals.get(k, 0.0) + v for k, v in out.items()}
        pairs = max(float(totals.pop("pairs", 0.0)), 1.0)
        return {k: float(v) / pairs for k, v in totals.items() if not k.startswith("logps/")}
    return score
