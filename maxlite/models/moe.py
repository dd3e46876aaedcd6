"""Mixture of experts: the MLP of the MoE families (maxlite/models/families.py).

A float32 router scores every expert for every token and keeps each token's top k; the experts'
gated MLPs (the family's SwiGLU, `base_moe_mlp_dim` wide) run on the tokens routed to them; their
outputs come back weighted by the router (plus `shared_experts`, an MLP every token goes through,
scaled by sigmoid(x · w) with `shared_expert_gate`: Qwen3-Next's).
`moe_implementation` says how the experts run, resolved once with the config
(maxlite.models.names.resolve_moe):

  dense     every expert on every token, weighted by the routing (zero for the rest): the reference
  ragged    each sequence shard's tokens sorted by expert, jax.lax.ragged_dot per group (grouped.py)
  blocked   sorted, each expert's rows padded to blocks, batched matmuls (grouped.py; CPU's choice)
  megablox  sorted, the Pallas TPU grouped matmul (grouped.py)
  capacity  per sequence, a fixed [E, C] buffer of token slots per expert, batched matmuls: fixed
            shapes (what moves between devices most cheaply), tokens past C dropped

Routing (`route`): router logits x·W_r in float32 (+ a learned bias with router_logit_bias: gpt-oss);
scores softmax (or sigmoid) of them; the top k
by score (+ `routed_bias` when set, for the choice only; ties go to the lower expert index, as
jax.lax.top_k breaks them); weights the chosen scores, divided by their sum with norm_topk_prob; with
routed_weight_on_input (Llama 4, one expert per token) the weight scales the expert's input instead.
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
from maxlite.models.layers import BTD, GatedMLP, constrain, glu, param
from maxlite.models.layout import ROUTED, layer_mlps, layer_place
from maxlite.models.matmul import project
from maxlite.models.moe_kernels import Routing
from maxlite.models.names import MOE_IMPLEMENTATIONS, resolve_moe
from maxlite.models.platform import target_platform

STATS = ("tokens", "routed", "probs", "dropped", "z")  # Routing.stats: each a sum over real tokens


def capacity(cfg, T: int) -> int:
    """Token slots per expert and sequence: ceil(capacity_factor · T · k / E); 0 when dropless."""
    if cfg.capacity_factor <= 0:
        return 0
    return max(1, math.ceil(cfg.capacity_factor * T * cfg.num_experts_per_tok / cfg.num_experts))


SCORES = {"sigmoid": jax.nn.sigmoid, "sqrtsoftplus": lambda logits: jnp.sqrt(jax.nn.softplus(logits))}


def route(cfg, x_BTD, router_DE, bias_E, valid_BT, slots: int, logit_bias_E=None, chosen_BTk=None) -> Routing:
    """Each token's top-k experts and weights; with `slots` > 0, the capacity drop decision.
    `chosen_BTk`: the experts already chosen (hash routing); the router only weighs them."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), router_DE.astype(jnp.float32))
    if logit_bias_E is not None:
        logits_BTE = logits_BTE + logit_bias_E.astype(jnp.float32)
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    scores_BTE = probs_BTE if cfg.routed_score_func == "softmax" else SCORES[cfg.routed_score_func](logits_BTE)
    if chosen_BTk is not None:
        experts_BTk = chosen_BTk.astype(jnp.int32)
    else:
        choice_BTE = scores_BTE if bias_E is None else scores_BTE + bias_E.astype(jnp.float32)
        choice_BTE = jax.lax.stop_gradient(choice_BTE)
        if cfg.n_routing_groups > 0:
            choice_BTE = _best_groups(cfg, choice_BTE)
        _, experts_BTk = jax.lax.top_k(choice_BTE, k)
    weights_BTk = jnp.take_along_axis(scores_BTE, experts_BTk, axis=-1)
    if cfg.norm_topk_prob:
        weights_BTk = weights_BTk / jnp.sum(weights_BTk, axis=-1, keepdims=True)
    weights_BTk = weights_BTk * cfg.routed_scaling_factor
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
    if cfg.routed_seq_aux_loss_weight:
        stats.update(_sequence_balance(cfg, scores_BTE, experts_BTk, valid_f))
    return Routing(experts_BTk, jnp.where(kept_BTk, weights_BTk, 0.0), kept_BTk, slots_BTk, stats)


def _best_groups(cfg, choice_BTE):
    """The choice scores outside each token's best `topk_routing_group` groups set to -inf. A group's
    score is the sum of its best two (sigmoid: DeepSeek-V3, GLM-4.5) or its best one (softmax:
    DeepSeek-V2's group-limited greedy), as transformers' routers compute it."""
    B, T, E = choice_BTE.shape
    G = cfg.n_routing_groups
    grouped_BTGe = choice_BTE.reshape(B, T, G, E // G)
    best = 2 if cfg.routed_score_func == "sigmoid" else 1
    group_BTG = jnp.sum(jax.lax.top_k(grouped_BTGe, best)[0], axis=-1)
    _, groups_BTg = jax.lax.top_k(group_BTG, cfg.topk_routing_group)
    keep_BTG = jnp.any(groups_BTg[..., None] == jnp.arange(G), axis=-2)
    return jnp.where(keep_BTG[..., None], grouped_BTGe, -jnp.inf).reshape(B, T, E)


def _sequence_balance(cfg, scores_BTE, experts_BTk, valid_f):
    """DeepSeek-V3's sequence-wise balance statistics: Σ over sequences (rows) of E/k · Σ_e f_e P_e,
    f_e the share of the row's real tokens choosing e, P_e the row's mean score of e normalised
    over the experts; and the number of rows with real tokens."""
    B, T, E = scores_BTE.shape
    k = experts_BTk.shape[-1]
    n_B = jnp.sum(valid_f, axis=1)
    rows_Bk = jnp.broadcast_to(jnp.arange(B)[:, None, None], experts_BTk.shape).reshape(-1)
    routed_BE = jnp.zeros((B, E), jnp.float32).at[rows_Bk, experts_BTk.reshape(-1)].add(
        jnp.broadcast_to(valid_f[..., None], experts_BTk.shape).reshape(-1))
    share_BTE = scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)
    p_BE = jnp.sum(share_BTE * valid_f[..., None], axis=1)
    n = jnp.maximum(n_B, 1.0)[:, None]
    per_row_B = E / k * jnp.sum(jax.lax.stop_gradient(routed_BE / n) * p_BE / n, axis=-1)
    return {"seq_balance": jnp.sum(per_row_B), "rows": jnp.sum((n_B > 0).astype(jnp.float32))}


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
    out = {"moe_lb_loss": cfg.num_experts * jnp.sum(f_E * p_E),
           "moe_z_loss": jnp.sum(stats_L["z"]) / total,
           "moe_expert_load": stats_L["routed"] / (k * tokens_L[:, None]),
           "moe_dropped": stats_L["dropped"] / (k * tokens_L)}
    if "seq_balance" in stats_L:  # each MoE layer's own loss, summed over the layers (as DeepSeek-V3's)
        out["moe_seq_lb_loss"] = jnp.sum(stats_L["seq_balance"] / jnp.maximum(stats_L["rows"], 1.0))
    return out


def step_metrics(cfg, losses: dict) -> dict:
    """The scalars a step reports (metrics.jsonl, TensorBoard, the run report): moe_lb_loss,
    moe_z_loss, moe_dropped (the share of choices dropped, all layers) and per MoE layer i (its
    index among all layers) moe_load_max/i and moe_load_min/i, the share of that layer's choices
    taken by its busiest and idlest expert (1/num_experts each when balanced), moe_dropped/i."""
    out = {"moe_lb_loss": losses["moe_lb_loss"], "moe_z_loss": losses["moe_z_loss"],
           "moe_dropped": jnp.mean(losses["moe_dropped"])}
    if "moe_seq_lb_loss" in losses:
        out["moe_seq_lb_loss"] = losses["moe_seq_lb_loss"]
    if cfg.routed_bias_update_rate:  # what the bias update balances: mean over MoE layers of max - min load
        load_LE = losses["moe_expert_load"]
        out["moe_load_gap"] = jnp.mean(jnp.max(load_LE, axis=-1) - jnp.min(load_LE, axis=-1))
    moe_layers = [i for i, kind in enumerate(layer_mlps(cfg)) if kind in ROUTED]
    for j, i in enumerate(moe_layers):
        out[f"moe_load_max/{i}"] = jnp.max(losses["moe_expert_load"][j])
        out[f"moe_load_min/{i}"] = jnp.min(losses["moe_expert_load"][j])
        out[f"moe_dropped/{i}"] = losses["moe_dropped"][j]
    return out


def objective_terms(cfg, losses: dict):
    """What the auxiliary losses add to the objective (per token, like the mean cross-entropy)."""
    terms = cfg.load_balance_loss_weight * losses["moe_lb_loss"] + cfg.router_z_loss_weight * losses["moe_z_loss"]
    if "moe_seq_lb_loss" in losses:
        terms = terms + cfg.routed_seq_aux_loss_weight * losses["moe_seq_lb_loss"]
    return terms


def balances_routing(cfg) -> bool:
    """Whether a training step moves the routing biases (update_routed_bias): with a rate, and only when
    the base model trains: not under LoRA (the adapters alone train, and an exported adapter must
    reproduce the tuned model on its base, routing included), nor in DeepSeek sparse attention's dense
    warm-up, which trains the indexers alone (index_stage)."""
    return cfg.routed_bias_update_rate > 0 and not cfg.lora_rank and cfg.index_stage != "dense_warmup"


def update_routed_bias(cfg, params, load_LE):
    """Auxiliary-loss-free balancing (DeepSeek-V3): each MoE layer's routed_bias in `params` (a
    model's nnx.State, changed in place) moves by routed_bias_update_rate × sign(mean load - load)
    of its experts, `load_LE` the step's share of choices per expert [L_moe, E]: an overloaded
    expert's bias falls, an idle one's rises. Returns the mean over layers of the biases' spread
    (max - min) after the update, the metric moe_bias_spread."""
    delta_LE = cfg.routed_bias_update_rate * jnp.sign(jnp.mean(load_LE, axis=-1, keepdims=True) - load_LE)
    spreads = []
    for j, i in enumerate(i for i, kind in enumerate(layer_mlps(cfg)) if kind in ROUTED):  # load_LE's order
        path, index = layer_place(cfg, i)
        node = params
        for key in path:
            node = node[key]
        if "router_bias" not in node["mlp"]:  # a hash-routed layer: its table chooses, no bias
            continue
        bias = node["mlp"]["router_bias"]
        value = bias[...] + delta_LE[j] if index is None else bias[...].at[index].add(delta_LE[j])
        bias[...] = value
        row = value if index is None else value[index]
        spreads.append(jnp.max(row) - jnp.min(row))
    for k in range(cfg.mtp_num_layers):  # the multi-token-prediction depths' MoE layers, after the model's
        bias = params["mtp"][k]["block"]["mlp"]["router_bias"]
        bias[...] = bias[...] + delta_LE[len(spreads)]
        spreads.append(jnp.max(bias[...]) - jnp.min(bias[...]))
    return jnp.mean(jnp.stack(spreads))


class MoE(nnx.Module):
    """The routed experts of one layer (+ the shared experts' MLP)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, hashed: bool = False):
        D, E, F = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        self.router = param(rngs, (D, E), ("embed", None), wd, scale=s)
        if hashed:  # DeepSeek-V4's hash routing: token id → its k experts, imported, never trained; held
            # as float32 whole numbers (exact below 2^24) as every other imported tensor is a float
            self.tid2eid = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.num_experts_per_tok), jnp.float32),
                                     out_sharding=("vocab", None), frozen=True)
        elif cfg.routed_bias:  # float32 whatever the weights: updates of 0.001 vanish in bfloat16
            self.router_bias = param(rngs, (E,), (None,), jnp.float32, init="zeros")
        if cfg.router_logit_bias:
            self.router_logit_bias = param(rngs, (E,), (None,), wd, init="zeros")
        self.gate = param(rngs, (E, D, F), ("exp", "embed_no_exp", "mlp"), wd, scale=s)
        self.up = param(rngs, (E, D, F), ("exp", "embed_no_exp", "mlp"), wd, scale=s)
        self.down = param(rngs, (E, F, D), ("exp", "mlp", "embed_no_exp"), wd, scale=s)
        if cfg.mlp_bias:  # gpt-oss's experts: a bias after each projection
            self.gate_bias = param(rngs, (E, F), ("exp", "mlp"), wd, init="zeros")
            self.up_bias = param(rngs, (E, F), ("exp", "mlp"), wd, init="zeros")
            self.down_bias = param(rngs, (E, D), ("exp", "embed_no_exp"), wd, init="zeros")
        if cfg.shared_experts:
            self.shared = GatedMLP(cfg, rngs=rngs, mlp_dim=cfg.shared_experts * F)
        if cfg.shared_experts and cfg.shared_expert_gate:  # Qwen3-Next's: sigmoid(x · w) per token
            self.shared_gate = param(rngs, (D,), ("embed",), wd, scale=s)
        self.cfg, self.dtype = cfg, jnp.dtype(cfg.dtype)
        self.glu = glu(cfg)

    def __call__(self, x_BTD, dropout_key=None, token_ids_BT=None):
        """Decoding's MLP: every token to its top k, nothing dropped."""
        return self.routed(x_BTD, None, dropout_key, dropless=True, token_ids_BT=token_ids_BT)[0]

    def _shared(self, x_BTD, dropout_key):
        """The shared experts' MLP, scaled by its gate where the model has one."""
        h_BTD = self.shared(x_BTD, dropout_key)
        if not hasattr(self, "shared_gate"):
            return h_BTD
        gate_BT1 = jax.nn.sigmoid(project("btd,d->bt", x_BTD, self.shared_gate[...]))[..., None]
        return (h_BTD * gate_BT1).astype(h_BTD.dtype)

    def routed(self, x_BTD, segment_ids_BT=None, dropout_key=None, dropless: bool = False, token_ids_BT=None):
        """(the layer's output, its routing statistics); `segment_ids_BT` marks padding (0);
        `token_ids_BT`: the tokens, which choose a hash-routed layer's experts."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        impl = resolve_moe(cfg.moe_implementation, target_platform(), cfg.capacity_factor)
        assert impl in MOE_IMPLEMENTATIONS, impl
        slots = capacity(cfg, T) if not dropless else (T if impl == "capacity" else 0)
        valid_BT = jnp.ones((B, T), bool) if segment_ids_BT is None else segment_ids_BT != 0
        bias = self.router_bias[...] if hasattr(self, "router_bias") else None
        chosen = None
        if hasattr(self, "tid2eid"):
            assert token_ids_BT is not None, "a hash-routed layer needs the token ids (the token_ids side)"
            chosen = jnp.take(self.tid2eid[...], token_ids_BT, axis=0)
        routing = route(cfg, x_BTD, self.router[...], bias, valid_BT, slots,
                        self.router_logit_bias[...] if cfg.router_logit_bias else None, chosen)
        x_in_BTD = x_BTD
        if cfg.routed_weight_on_input:  # Llama 4: the expert takes w·x and its output is not weighted (k = 1)
            x_in_BTD = (x_BTD.astype(jnp.float32) * routing.weights_BTk).astype(x_BTD.dtype)
            routing = routing._replace(weights_BTk=routing.kept_BTk.astype(jnp.float32))
        in_bias = (self.gate_bias[...], self.up_bias[...]) if cfg.mlp_bias else ()
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        if cfg.grad_dtype != "float32" and gate.dtype == jnp.float32 and self.dtype != jnp.float32:
            # cast while sharded as stored: the gather then moves the compute dtype, and the backward pass
            # reduce-scatters the experts' gradient in it before widening the shard (grad_dtype), where
            # the cast's own backward widened the whole gathered gradient first (DeepSeek-V3 on tpu7x: two
            # float32 [256, 2048, 7168] of 14 GiB each on every device)
            gate, up = (constrain(w.astype(self.dtype), ("exp", "embed_no_exp", "mlp")) for w in (gate, up))
            down = constrain(down.astype(self.dtype), ("exp", "mlp", "embed_no_exp"))
        y_BTD, dropped = moe_parallel.experts(impl, x_in_BTD, routing, slots, gate, up, down, self.glu,
                                              -1.0 if dropless else cfg.ragged_buffer_factor, in_bias)
        if cfg.mlp_bias:  # Σ_j w_j (y_j + b_j): the down bias of each chosen expert, weighted (0 if dropped)
            bias_BTkD = jnp.take(self.down_bias[...].astype(jnp.float32), routing.experts_BTk, axis=0)
            y_BTD = y_BTD + jnp.einsum("btk,btkd->btd", routing.weights_BTk, bias_BTkD)
        y_BTD = checkpoint_name(y_BTD.astype(self.dtype), "mlpwo")
        if cfg.shared_experts:
            y_BTD = y_BTD + self._shared(x_BTD, dropout_key)
        # what capped receive buffers dropped counts with the capacity drops (ragged_buffer_factor)
        return constrain(y_BTD, BTD), {**routing.stats, "dropped": routing.stats["dropped"] + dropped}


def hash_moe(cfg, *, rngs: nnx.Rngs) -> MoE:
    """The `hash_moe` feed-forward kind: a MoE layer whose experts the token ids choose (DeepSeek-V4's
    first `num_hash_layers` layers)."""
    return MoE(cfg, rngs=rngs, hashed=True)


def token_id_inputs(model, inputs_BT, x_BTD, seen) -> jax.Array:
    """The token_ids side: every layer's copy of the tokens [L, B, T] (hash-routed layers read theirs)."""
    return jnp.broadcast_to(inputs_BT, (model.cfg.base_num_decoder_layers, *inputs_BT.shape))
