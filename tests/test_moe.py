"""maxlite/models/moe.py (+ grouped.py, moe_parallel.py on one device): every implementation equals
a per-token loop over the chosen experts, values and gradients (router included), with ties in the
router and experts that get no token; capacity routing drops exactly the assignments a queue per
expert would; the auxiliary loss is Hugging Face's; the model adds it to the objective."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C, step as step_lib
from maxlite.models import Transformer
from maxlite.models.layout import layer_mlps, layer_stacks
from maxlite.models.moe import MoE
from maxlite.state import abstract_params
from tests.helpers import value_and_grads

E, K, D, F, B, T = 8, 2, 16, 8, 2, 6


def moe_cfg(**overrides):
    argv = ["base.yml", "model_name=tiny-moe", "dtype=float32", f"base_emb_dim={D}", f"base_moe_mlp_dim={F}",
            f"num_experts={E}", f"num_experts_per_tok={K}", "base_num_query_heads=2", "base_num_kv_heads=1",
            "head_dim=8", "base_mlp_dim=16", "vocab_size=64", "base_num_decoder_layers=2",
            "max_target_length=8"]
    return C.load(argv + [f"{k}={v}" for k, v in overrides.items()])


def make_layer(cfg):
    """A MoE layer whose router ties experts 1, 2 and 3 (equal columns: a token that picks one of
    them picks 1 first, then 2; 3 never, with k = 2) and never picks expert 7."""
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, rngs=nnx.Rngs(0))
    router = np.asarray(layer.router[...]) * 20.0  # sharp enough that choices differ per token
    router[:, 2] = router[:, 3] = router[:, 1]
    router[:, 7] = 0.0
    router[0, 7] = -50.0 * np.abs(router).max()
    layer.router[...] = jnp.asarray(router)
    return layer


def inputs():
    x = np.random.default_rng(0).normal(0, 1, (B, T, D)).astype(np.float32)
    x[:, :, 0] = np.abs(x[:, :, 0]) + 0.1  # expert 7's logit is then far below every other
    return jnp.asarray(x)


def loop_reference(cfg, params, x_BTD, kept=None):
    """Token by token (one token's function, mapped over the tokens): softmax of the float32 router
    logits, the k best (ties to the lower index, by a stable sort), weights renormalised, each
    chosen expert's SwiGLU; `kept` [B, T, k] zeroes dropped assignments."""
    def one_token(x, keep):
        probs = jax.nn.softmax(x @ params["router"])
        order = jnp.argsort(-jax.lax.stop_gradient(probs), stable=True)[:cfg.num_experts_per_tok]
        w = probs[order]
        w = w / jnp.sum(w) if cfg.norm_topk_prob else w
        y = jnp.zeros_like(x)
        for j in range(cfg.num_experts_per_tok):
            e = order[j]
            h = jax.nn.silu(x @ params["gate"][e]) * (x @ params["up"][e])
            y = y + keep[j] * w[j] * (h @ params["down"][e])
        return y

    kept = jnp.ones(x_BTD.shape[:2] + (cfg.num_experts_per_tok,)) if kept is None else kept
    return jax.vmap(jax.vmap(one_token))(x_BTD, kept)


def layer_fn(layer, impl):
    graphdef, state = nnx.split(layer)
    layer_cfg = dataclasses.replace(layer.cfg, moe_implementation=impl)

    def fn(params, x_BTD):
        pure = nnx.to_pure_dict(state)
        pure.update(params)
        state_ = jax.tree.map(lambda a: a, state)
        nnx.replace_by_pure_dict(state_, pure)
        module = nnx.merge(graphdef, state_)
        module.cfg = layer_cfg
        return module.routed(x_BTD)[0]
    return fn


def params_of(layer):
    return {name: getattr(layer, name)[...] for name in ("router", "gate", "up", "down")}


@pytest.mark.parametrize("impl", ["dense", "ragged", "blocked", "megablox"])
def test_dropless_implementations_equal_a_per_token_loop(impl):
    cfg = moe_cfg()
    layer, x = make_layer(cfg), inputs()
    params = params_of(layer)
    (value, (g_params, g_x)) = value_and_grads(jax.jit(layer_fn(layer, impl)), params, x)
    (ref_value, (ref_params, ref_x)) = value_and_grads(jax.jit(lambda p, x: loop_reference(cfg, p, x)), params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, ref_x, rtol=1e-4, atol=1e-5)
    for name in params:  # the router's gradient included
        np.testing.assert_allclose(g_params[name], ref_params[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # the cases this test is about did occur: ties among experts 1-3, and experts with no token
    _, stats = layer.routed(x)
    routed = np.asarray(stats["routed"])
    assert routed[1] > routed[2] > 0 and routed[3] == 0 and routed[7] == 0  # ties at and inside the top k


def capacity_queue(experts_BTk, C_):
    """Which assignments a queue per expert and sequence keeps: every token's first choice in
    token order, then every token's second ...; the first C_ of each expert's queue."""
    Bn, Tn, k = experts_BTk.shape
    kept = np.zeros(experts_BTk.shape, bool)
    for b in range(Bn):
        taken = {}
        for j in range(k):
            for t in range(Tn):
                e = int(experts_BTk[b, t, j])
                if taken.get(e, 0) < C_:
                    kept[b, t, j] = True
                    taken[e] = taken.get(e, 0) + 1
    return kept


@pytest.mark.parametrize("impl", ["capacity", "ragged", "dense"])
def test_capacity_drops_exactly_what_a_queue_per_expert_drops(impl):
    cfg = moe_cfg(capacity_factor=0.5)  # C = ceil(0.5 · 6 · 2 / 8) = 1 slot per expert and sequence
    layer, x = make_layer(cfg), inputs()
    from maxlite.models import moe

    C_ = moe.capacity(cfg, T)
    assert C_ == 1
    valid = jnp.ones((B, T), bool)
    routing = moe.route(cfg, x, layer.router[...], None, valid, C_)
    kept = capacity_queue(np.asarray(routing.experts_BTk), C_)
    assert 0 < kept.sum() < kept.size  # some dropped, some kept
    np.testing.assert_array_equal(np.asarray(routing.kept_BTk), kept)
    assert float(routing.stats["dropped"]) == kept.size - kept.sum()
    params = params_of(layer)
    value, (g_params, g_x) = value_and_grads(jax.jit(layer_fn(layer, impl)), params, x)
    ref_value, (ref_params, ref_x) = value_and_grads(
        jax.jit(lambda p, x: loop_reference(cfg, p, x, jnp.asarray(kept, jnp.float32))), params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, ref_x, rtol=1e-4, atol=1e-5)
    for name in params:
        np.testing.assert_allclose(g_params[name], ref_params[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_load_balancing_loss_is_hugging_faces():
    """moe.aux_losses on the routing statistics of two layers = transformers' Mixtral
    load_balancing_loss_func on the same router logits."""
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from maxlite.models import moe

    cfg = moe_cfg()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(0, 1, (B, T, D)).astype(np.float32))
    routers = [rng.normal(0, 1, (D, E)).astype(np.float32) for _ in range(2)]
    valid = jnp.ones((B, T), bool)
    stats = [moe.route(cfg, x, jnp.asarray(r), None, valid, 0).stats for r in routers]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *stats)
    ours = moe.aux_losses(cfg, stacked)["moe_lb_loss"]
    logits = tuple(torch.from_numpy(np.asarray(x).reshape(B * T, D) @ r) for r in routers)
    theirs = load_balancing_loss_func(logits, E, K)
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)


def test_the_objective_adds_the_weighted_auxiliary_loss_and_reports_it():
    """loss_sums with load_balance_loss_weight w: loss = xent + w · lb (per token); the metrics
    carry the balancing loss and each MoE layer's load; w = 0 leaves the cross-entropy alone."""
    def sums(weight):
        cfg = moe_cfg(load_balance_loss_weight=weight)
        graphdef, shapes = abstract_params(cfg)
        rng = np.random.default_rng(0)
        params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.2, a.shape), a.dtype), shapes)
        tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                 "positions": jnp.broadcast_to(jnp.arange(8), (2, 8)),
                 "segment_ids": jnp.ones((2, 8), jnp.int32), "weights": jnp.ones((2, 8))}
        return jax.jit(lambda p: step_lib.loss_sums(p, graphdef, batch))(params)

    loss0, (metrics0, n) = sums(0.0)
    loss1, (metrics1, _) = sums(0.5)
    np.testing.assert_allclose(loss0, metrics0["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics1["loss"], metrics0["loss"], rtol=1e-6)
    lb = metrics1["moe_lb_loss"] / n
    assert 1.0 <= float(lb) <= E  # E · Σ f·P: 1 when balanced
    np.testing.assert_allclose(loss1, metrics1["loss"] + n * 0.5 * lb, rtol=1e-6)
    for i in (0, 1):  # both layers MoE: each reports its busiest and idlest expert's share
        assert 1 / E <= float(metrics1[f"moe_load_max/{i}"] / n) <= 1.0
        assert 0.0 <= float(metrics1[f"moe_load_min/{i}"] / n) <= 1 / E


def test_dense_layers_first_and_interleaved_scan_equals_unrolled():
    """first_num_dense_layers=1 and interleave_moe_layer_step=2 over 5 layers: dense, then
    (dense, MoE) twice; the scanned stacks and the unrolled layers compute the same logits."""
    over = dict(base_num_decoder_layers=5, first_num_dense_layers=1, interleave_moe_layer_step=2)
    cfg_scan, cfg_loop = moe_cfg(**over), moe_cfg(scan_layers=False, **over)
    assert layer_mlps(cfg_scan) == ("dense", "dense", "moe", "dense", "moe")
    assert [(s.name, s.count, s.unit) for s in layer_stacks(cfg_scan)] == [
        ("dense_layers", 1, (("attention", "dense"),)),
        ("layers", 2, (("attention", "dense"), ("attention", "moe")))]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)))
    pos, seg = jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32)
    outs = []
    for cfg in (cfg_scan, cfg_loop):
        with nnx.use_eager_sharding(False):
            model = Transformer(cfg, rngs=nnx.Rngs(0))
        x, stats = nnx.jit(lambda m: m.forward(ids, pos, seg))(model)
        assert stats["routed"].shape == (2, E)  # the two MoE layers
        outs.append((np.asarray(model.logits(x)), np.asarray(stats["routed"])))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
