"""Mixture of experts: the MLP of the MoE families (maxlite/models/families.py).

A float32 router scores every expert for every token and keeps each token's top k; the experts'
gated MLPs (the family's SwiGLU, `base_moe_mlp_dim` wide) run on the tokens routed to them; their
outputs come back weighted by the router (plus `shared_experts`, an MLP every token goes through).
`moe_implementation` says how the experts run, resolved once with the config
(maxlite.models.names.resolve_moe):

  dense     every expert on every token, weighted by the routing (zero for the rest): the reference
  ragged    each sequence shard's tokens sorted by expert, jax.lax.ragged_dot per group (grouped.py)
  blocked   sorted, each expert's rows padded to blocks, batched matmuls (grouped.py; CPU's choice)
  megablox  sorted, the Pallas TPU grouped matmul (grouped.py)
  capacity  per sequence, a fixed [E, C] buffer of token slots per expert, batched matmuls: fixed
            shapes (what moves between devices most cheaply), tokens past C dropped

Routing (`route`): router logits x·W_r in float32; scores softmax (or sigmoid) of them; the top k
by score (+ `routed_bias` when set, for the choice only; ties go to the lower expert index, as
jax.lax.top_k breaks them); weights the chosen scores, divided by their sum with norm_topk_prob.
With capacity_factor > 0 an expert takes at most C = ceil(capacity_factor · T · k / E) of a
sequence's tokens: first choices first (every token's best expert, then every token's second ...),
in token order within a rank; the rest are dropped (weight 0). The drop decision is part of the
routing, so every implementation computes the same function (`capacity` alone saves the work), and
it is made per sequence: the same whatever the mesh. Padding tokens (segment 0) take no capacity and
stay out of the statistics. Decoding is always dropless (`MoE.__call__`).

The statistics of each layer (sums over the real tokens) give the auxiliary losses exactly as
Hugging Face computes them for Mixtral and Qwen3-MoE with output_router_logits (`aux_losses`: the
routed counts and router probabilities of all layers pooled), the router z-loss, and the per-layer
expert load and dropped fraction the metrics report.

Shape legend as in layers.py, plus E experts, k experts per token, C capacity, X tokens (B·T),
M sorted rows (X·k). Sharding-free: the implementations on one device's tokens are
maxlite/models/moe_kernels.py's, expert parallelism is maxlite/models/moe_parallel.py's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxlite.models import moe_parallel
from maxlite.models.families import family
from maxlite.models.kinds import FEED_FORWARDS, layer_mlps
from maxlite.models.layers import ACTIVATIONS, BTD, GatedMLP, constrain, param
from maxlite.models.moe_kernels import Routing
from maxlite.models.names import MOE_IMPLEMENTATIONS, resolve_moe
from maxlite.models.platform import target_platform

STATS = ("tokens", "routed", "probs", "dropped", "z")  # Routing.stats: each a sum over real tokens


def capacity(cfg, T: int) -> int:
    """Token slots per expert and sequence: ceil(capacity_factor · T · k / E); 0 when dropless."""
    if cfg.capacity_factor <= 0:
        return 0
    return max(1, math.ceil(cfg.capacity_factor * T * cfg.num_experts_per_tok / cfg.num_experts))


def route(cfg, x_BTD, router_DE, bias_E, valid_BT, slots: int) -> Routing:
    """Each token's top-k experts and weights; with `slots` > 0, the capacity drop decision."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), router_DE.astype(jnp.float32))
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    scores_BTE = probs_BTE if cfg.routed_score_func == "softmax" else jax.nn.sigmoid(logits_BTE)
    choice_BTE = scores_BTE if bias_E is None else scores_BTE + bias_E.astype(jnp.float32)
    _, experts_BTk = jax.lax.top_k(jax.lax.stop_gradient(choice_BTE), k)
    weights_BTk = jnp.take_along_axis(scores_BTE, experts_BTk, axis=-1)
    if cfg.norm_topk_prob:
        weights_BTk = weights_BTk / jnp.sum(weights_BTk, axis=-1, keepdims=True)
    if slots:
        slots_BTk, kept_BTk = _capacity_slots(experts_BTk, valid_BT, E, slots)
    else:
        slots_BTk, kept_BTk = jnp.zeros_like(experts_BTk), jnp.ones(experts_BTk.shape, bool)
    valid_f = valid_BT.astype(jnp.float32)
    routed_E = jnp.zeros((E,), jnp.float32).at[experts_BTk.reshape(-1)].add(
        jnp.broadcast_to(valid_f[..., None], experts_BTk.shape).reshape(-1))
    lse_BT = jax.nn.logsumexp(logits_BTE, axis=-1)
    stats = {"tokens": jnp.sum(valid_f), "routed": routed_E,
             "probs": jnp.sum(probs_BTE * valid_f[..., None], axis=(0, 1)),
             "dropped": jnp.sum((~kept_BTk & valid_BT[..., None]).astype(jnp.float32)),
             "z": jnp.sum(jnp.square(lse_BT) * valid_f)}
    return Routing(experts_BTk, jnp.where(kept_BTk, weights_BTk, 0.0), kept_BTk, slots_BTk, stats)


def _capacity_slots(experts_BTk, valid_BT, E: int, C: int):
    """(slot of each assignment in its expert's buffer, kept) per sequence: assignments queue in
    rank-major order (q = j·T + t) and the first C of each expert's queue are kept."""
    B, T, k = experts_BTk.shape
    key_BQ = jnp.where(jnp.tile(valid_BT, (1, k)), jnp.swapaxes(experts_BTk, 1, 2).reshape(B, k * T), E)

    def row(key_Q):
        order_Q = jnp.argsort(key_Q, stable=True)
        sorted_Q = key_Q[order_Q]
        start = jnp.searchsorted(sorted_Q, jnp.arange(E + 1), side="left")
        rank_Q = jnp.zeros_like(key_Q).at[order_Q].set(jnp.arange(k * T) - start[sorted_Q])
        return rank_Q

    pos_BQ = jax.vmap(row)(key_BQ)
    kept_BQ = (key_BQ < E) & (pos_BQ < C)
    to_BTk = lambda a: jnp.swapaxes(a.reshape(B, k, T), 1, 2)  # noqa: E731
    return to_BTk(jnp.where(kept_BQ, pos_BQ, 0)), to_BTk(kept_BQ)


def aux_losses(cfg, stats_L: dict) -> dict:
    """The objective's terms and the metrics from the stacked per-layer statistics [L, ...]:
    moe_lb_loss, Hugging Face's load_balancing_loss_func over all MoE layers (E · Σ_e f_e · P_e,
    f_e the share of top-k choices and P_e the mean router probability of expert e, both pooled
    over layers and real tokens); moe_z_loss, the mean squared log-sum-exp of the router logits;
    moe_expert_load [L, E], each layer's share of choices per expert (before drops); moe_dropped
    [L], each layer's share of choices dropped."""
    k = cfg.num_experts_per_tok
    tokens_L = jnp.maximum(stats_L["tokens"], 1.0)
    total = jnp.sum(tokens_L)
    f_E = jnp.sum(stats_L["routed"], axis=0) / total
    p_E = jnp.sum(stats_L["probs"], axis=0) / total
    return {"moe_lb_loss": cfg.num_experts * jnp.sum(f_E * p_E),
            "moe_z_loss": jnp.sum(stats_L["z"]) / total,
            "moe_expert_load": stats_L["routed"] / (k * tokens_L[:, None]),
            "moe_dropped": stats_L["dropped"] / (k * tokens_L)}


def step_metrics(cfg, losses: dict) -> dict:
    """The scalars a step reports (metrics.jsonl, TensorBoard, the run report): moe_lb_loss,
    moe_z_loss, moe_dropped (the share of choices dropped, all layers) and per MoE layer i (its
    index among all layers) moe_load_max/i and moe_load_min/i, the share of that layer's choices
    taken by its busiest and idlest expert (1/num_experts each when balanced), moe_dropped/i."""
    out = {"moe_lb_loss": losses["moe_lb_loss"], "moe_z_loss": losses["moe_z_loss"],
           "moe_dropped": jnp.mean(losses["moe_dropped"])}
    moe_layers = [i for i, kind in enumerate(layer_mlps(cfg)) if FEED_FORWARDS[kind].routed]
    for j, i in enumerate(moe_layers):
        out[f"moe_load_max/{i}"] = jnp.max(losses["moe_expert_load"][j])
        out[f"moe_load_min/{i}"] = jnp.min(losses["moe_expert_load"][j])
        out[f"moe_dropped/{i}"] = losses["moe_dropped"][j]
    return out


def objective_terms(cfg, losses: dict):
    """What the auxiliary losses add to the objective (per token, like the mean cross-entropy)."""
    return cfg.load_balance_loss_weight * losses["moe_lb_loss"] + cfg.router_z_loss_weight * losses["moe_z_loss"]


class MoE(nnx.Module):
    """The routed experts of one layer (+ the shared experts' MLP)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, E, F = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        self.router = param(rngs, (D, E), ("embed", None), wd, scale=s)
        if cfg.routed_bias:
            self.router_bias = param(rngs, (E,), (None,), wd, init="zeros")
        self.gate = param(rngs, (E, D, F), ("exp", "embed_no_exp", "mlp"), wd, scale=s)
        self.up = param(rngs, (E, D, F), ("exp", "embed_no_exp", "mlp"), wd, scale=s)
        self.down = param(rngs, (E, F, D), ("exp", "mlp", "embed_no_exp"), wd, scale=s)
        if cfg.shared_experts:
            self.shared = GatedMLP(cfg, rngs=rngs, mlp_dim=cfg.shared_experts * F)
        self.cfg, self.dtype = cfg, jnp.dtype(cfg.dtype)
        self.act = ACTIVATIONS[family(cfg).mlp]

    def __call__(self, x_BTD, dropout_key=None):
        """Decoding's MLP: every token to its top k, nothing dropped."""
        return self.routed(x_BTD, None, dropout_key, dropless=True)[0]

    def routed(self, x_BTD, segment_ids_BT=None, dropout_key=None, dropless: bool = False):
        """(the layer's output, its routing statistics); `segment_ids_BT` marks padding (0)."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        impl = resolve_moe(cfg.moe_implementation, target_platform(), cfg.capacity_factor)
        assert impl in MOE_IMPLEMENTATIONS, impl
        slots = capacity(cfg, T) if not dropless else (T if impl == "capacity" else 0)
        valid_BT = jnp.ones((B, T), bool) if segment_ids_BT is None else segment_ids_BT != 0
        bias = self.router_bias[...] if cfg.routed_bias else None
        routing = route(cfg, x_BTD, self.router[...], bias, valid_BT, slots)
        y_BTD = moe_parallel.experts(impl, x_BTD, routing, slots, self.gate[...], self.up[...],
                                     self.down[...], self.act)
        y_BTD = checkpoint_name(y_BTD.astype(self.dtype), "mlpwo")
        if cfg.shared_experts:
            y_BTD = y_BTD + self.shared(x_BTD, dropout_key)
        return constrain(y_BTD, BTD), routing.stats
