"""DeepSeekMoE routing (maxlite/models/moe.py): sigmoid scores with the per-expert bias for the
choice only, group-limited routing and routed_scaling_factor choose the experts and weights
transformers' DeepSeek-V3 / GLM-4.5 and DeepSeek-V2 routers choose; the auxiliary-loss-free bias
update (routed_bias_update_rate) moves each step by exactly ± the rate (no gradient, no optimizer),
brings a skewed load toward balance, and resumes bit for bit from a checkpoint; the sequence-wise
balance loss is DeepSeek-V3's formula, and its weight enters the objective."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlite import config as C, step as step_lib
from maxlite.models import moe
from tests.helpers import MOE, start_built

E, K, D, B, T = 16, 4, 32, 2, 24


def routing_cfg(**overrides):
    argv = ["base.yml", "model_name=tiny-moe", "dtype=float32", f"base_emb_dim={D}", "base_moe_mlp_dim=8",
            f"num_experts={E}", f"num_experts_per_tok={K}", "base_num_decoder_layers=2", "vocab_size=64"]
    return C.load(argv + [f"{k}={v}" for k, v in overrides.items()])


# (transformers config class, its router, its keys) → the maxlite keys of the same routing
CASES = {
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
                    dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
                    dict(routed_score_func="sigmoid", routed_bias=True, n_routing_groups=4, topk_routing_group=2,
                         routed_scaling_factor=2.5, norm_topk_prob=True)),
    "glm4_moe_one_group": ("Glm4MoeConfig", "glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter",
                           dict(n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False),
                           dict(routed_score_func="sigmoid", routed_bias=True, routed_scaling_factor=1.5,
                                norm_topk_prob=False)),
    "deepseek_v2_group_limited": ("DeepseekV2Config", "deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
                                  dict(n_group=8, topk_group=3, routed_scaling_factor=16.0,
                                       topk_method="group_limited_greedy"),
                                  dict(routed_score_func="softmax", n_routing_groups=8, topk_routing_group=3,
                                       routed_scaling_factor=16.0, norm_topk_prob=False)),
}


@pytest.mark.parametrize("case", CASES)
def test_routing_equals_transformers_router(case):
    torch = pytest.importorskip("torch")
    import importlib

    import transformers

    config_name, router_path, hf_keys, ours = CASES[case]
    module, cls = router_path.rsplit(".", 1)
    hf_cfg = getattr(transformers, config_name)(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, **hf_keys)
    router = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(hf_cfg)
    rng = np.random.default_rng(0)
    w_ED = rng.normal(0, 0.5, (E, D)).astype(np.float32)
    bias_E = rng.normal(0, 0.3, (E,)).astype(np.float32)  # large enough to change choices
    x_BTD = rng.normal(0, 1, (B, T, D)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w_ED))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.from_numpy(bias_E))
        _, hf_weights, hf_experts = router(torch.from_numpy(x_BTD))
    cfg = routing_cfg(**ours)
    routing = moe.route(cfg, jnp.asarray(x_BTD), jnp.asarray(w_ED.T), jnp.asarray(bias_E) if cfg.routed_bias else None,
                        jnp.ones((B, T), bool), 0)
    experts = np.asarray(routing.experts_BTk).reshape(B * T, K)
    weights = np.asarray(routing.weights_BTk).reshape(B * T, K)
    # transformers' top-k is unsorted: compare each token's (expert → weight) as a sorted table
    hf_experts, hf_weights = hf_experts.numpy(), hf_weights.numpy()
    for t in range(B * T):
        mine, theirs = np.argsort(experts[t]), np.argsort(hf_experts[t])
        np.testing.assert_array_equal(experts[t][mine], hf_experts[t][theirs])
        np.testing.assert_allclose(weights[t][mine], hf_weights[t][theirs], rtol=1e-5, atol=1e-7)
    # the cases the test is about occurred: the bias and the groups changed choices
    plain = moe.route(routing_cfg(routed_score_func=ours["routed_score_func"]), jnp.asarray(x_BTD),
                      jnp.asarray(w_ED.T), None, jnp.ones((B, T), bool), 0)
    assert (np.sort(np.asarray(plain.experts_BTk), -1) != np.sort(np.asarray(routing.experts_BTk), -1)).any()


def test_sequence_balance_loss_is_deepseek_v3s():
    """E/k · Σ_e f_e P_e per sequence (f_e: the share of the row's tokens that chose e, times E/k in
    the paper's N_r/(K_r·T); P_e: the row's mean of the scores normalised over experts), averaged over
    rows with real tokens (a padding row counts in neither), per layer; computed here from the
    routing's choices by counting, token by token."""
    cfg = routing_cfg(routed_score_func="sigmoid", routed_seq_aux_loss_weight=0.5)
    rng = np.random.default_rng(1)
    w_DE = rng.normal(0, 0.5, (D, E)).astype(np.float32)
    x_BTD = rng.normal(0, 1, (3, T, D)).astype(np.float32)
    valid = np.ones((3, T), bool)
    valid[1, T // 2:] = False
    valid[2] = False  # a row of padding only
    routing = moe.route(cfg, jnp.asarray(x_BTD), jnp.asarray(w_DE), None, jnp.asarray(valid), 0)
    scores = 1 / (1 + np.exp(-(x_BTD.astype(np.float64) @ w_DE)))
    chosen = np.asarray(routing.experts_BTk)
    per_row = []
    for b in range(2):
        n = valid[b].sum()
        f = np.zeros(E)
        p = np.zeros(E)
        for t in np.flatnonzero(valid[b]):
            f[chosen[b, t]] += 1.0 / n
            p += scores[b, t] / scores[b, t].sum() / n
        per_row.append(E / K * np.sum(f * p))
    stats = jax.tree.map(lambda a: a[None], routing.stats)  # one layer
    losses = moe.aux_losses(cfg, stats)
    np.testing.assert_allclose(float(losses["moe_seq_lb_loss"]), np.mean(per_row), rtol=1e-5)
    no_weight = dict(losses, moe_seq_lb_loss=0.0)
    np.testing.assert_allclose(float(moe.objective_terms(cfg, losses) - moe.objective_terms(cfg, no_weight)),
                               0.5 * float(losses["moe_seq_lb_loss"]), rtol=1e-6)


RATE = 0.01
BALANCING = [*MOE[1:], "routed_bias=true", "routed_score_func=sigmoid", f"routed_bias_update_rate={RATE}",
             "load_balance_loss_weight=0", "per_device_batch_size=4", "run_name=balance"]
# tiny-deepseek's arrangement: a dense first layer stored apart, the MoE layers stacked after it and
# a multi-token-prediction depth whose MoE layer's load rows follow the decoder's
WITH_MTP = ["first_num_dense_layers=1", "mtp_num_layers=1"]


def _biases(state) -> list:
    """Every MoE layer's routing-bias variable: the decoder's stack [L_moe, E], then each depth's [E]."""
    depths = state.params["mtp"].values() if "mtp" in state.params else []
    return [state.params["layers"]["mlp"]["router_bias"]] + [d["block"]["mlp"]["router_bias"] for d in depths]


def _bias(state):
    """The routing biases [L_moe (+ depths), E], the decoder's rows first (as the load's)."""
    return np.concatenate([np.asarray(jax.device_get(b[...])).reshape(-1, b.shape[-1]) for b in _biases(state)])


def _skew(state, value: float):
    """Experts 0 and 1 of every decoder MoE layer start with a bias of `value`, experts 2 and 3 of
    the depths' (another pair: a depth's update landing on the decoder's layer shows)."""
    for i, bias in enumerate(_biases(state)):
        first = 0 if i == 0 else 2
        skew = np.zeros(bias.shape, np.float32)
        skew[..., first:first + 2] = value
        bias[...] = jax.device_put(jnp.asarray(skew), bias[...].sharding)


@pytest.mark.parametrize("extra", [[], WITH_MTP], ids=["decoder", "decoder-and-mtp"])
def test_bias_update_balances_the_load_and_resumes_exactly(tmp_path, extra):
    """Two experts of every MoE layer start with a bias of +0.15 (every token picks them: the load
    gap is 1/k - 0): the first step moves each layer's bias by exactly the rate toward balance,
    as the load of that step's forward pass (measured apart) says — the decoder's layers beside a
    multi-token-prediction depth too —; each step every bias moves by exactly 0 or ± the rate (the
    gradient and the optimizer leave it alone; learning_rate > 0 here), and over the last 8 of 24
    steps the gap between the busiest and the idlest expert is on average well below its start, in
    every decoder layer. Saved at step 24, restored, the bias is bitwise the saved one, and the next
    step moves it exactly as the uninterrupted run does."""
    built, started, data, saver = start_built(tmp_path, BALANCING + extra, 1)
    state = started.state
    _skew(state, 0.15)
    put = lambda batch: {k: jax.device_put(v, built.batch_sharding) for k, v in batch.items()}  # noqa: E731
    batch = put(next(data))
    _, (sums, tokens) = jax.jit(step_lib.loss_sums, static_argnums=1)(state.params, built.graphdef, batch)
    load = np.asarray(sums["moe_expert_load"] / tokens)  # [L_moe (+ depths), E], the decoder's rows first
    toward_balance = RATE * np.sign(load.mean(axis=-1, keepdims=True) - load)
    assert np.all(toward_balance != 0)  # the skew leaves no expert at the mean: every bias must move
    before = _bias(state)
    state, metrics = built.train_step(state, batch)
    np.testing.assert_allclose(_bias(state) - before, toward_balance, atol=1e-6)
    moe_layers = sorted(int(k.split("/")[1]) for k in metrics if k.startswith("moe_load_max/"))
    layer_gaps = [[float(metrics[f"moe_load_max/{i}"] - metrics[f"moe_load_min/{i}"]) for i in moe_layers]]
    gaps, before = [float(metrics["moe_load_gap"])], _bias(state)
    for _ in range(23):
        state, metrics = built.train_step(state, put(next(data)))
        after = _bias(state)
        steps = np.abs(after - before)
        assert np.all(np.isclose(steps, RATE, atol=1e-6) | (steps == 0)), steps
        gaps.append(float(metrics["moe_load_gap"]))
        layer_gaps.append([float(metrics[f"moe_load_max/{i}"] - metrics[f"moe_load_min/{i}"]) for i in moe_layers])
        before = after
    assert gaps[0] == pytest.approx(0.5)  # the two skewed experts take every token's two choices
    # 64 tokens a step: once balanced a layer's gap wanders between about 0.1 and 0.33, so the mean
    # of the last 8 steps is compared (a layer whose bias keeps no update stays at 0.5)
    assert np.mean(gaps[-8:]) < 0.5 * gaps[0], gaps
    assert np.all(np.mean(layer_gaps[-8:], axis=0) < 0.5 * np.asarray(layer_gaps[0])), layer_gaps
    assert float(metrics["moe_bias_spread"]) == pytest.approx(np.mean(np.ptp(after, axis=-1)), abs=1e-7)
    assert saver.save(24, state, data)
    saver.close()
    went_on, _ = built.train_step(state, put(next(data)))

    built2, resumed, data2, saver2 = start_built(tmp_path, BALANCING + extra, 1)
    saver2.close()
    assert (resumed.step, resumed.source) == (24, "checkpoint")
    np.testing.assert_array_equal(_bias(resumed.state), after)
    again, _ = built2.train_step(resumed.state, put(next(data2)))
    np.testing.assert_array_equal(_bias(again), _bias(went_on))
