"""The chunked output head + cross-entropy equals the unchunked one (loss and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlite import config as C, step as step_lib
from maxlite.models import loss as loss_lib
from maxlite.state import abstract_params


def _reference(x_BTD, head_DV, targets_BT, weights_BT, z, cap=0.0):
    logits_BTV = (x_BTD @ head_DV).astype(jnp.float32)
    if cap:  # Gemma 4's soft cap, differentiated by JAX here
        logits_BTV = cap * jnp.tanh(logits_BTV / cap)
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    xent = jnp.sum((log_z_BT - target_BT) * weights_BT)
    return xent + z * jnp.sum(jnp.square(log_z_BT) * weights_BT), xent


def _inputs(B=2, T=64, D=32, V=50):
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k1, (B, T, D), jnp.float32)
    head = 0.3 * jax.random.normal(k2, (D, V), jnp.float32)
    targets = jax.random.randint(k3, (B, T), 0, V)
    weights = jnp.ones((B, T)).at[0, 50:].set(0.0).at[1, :5].set(0.0)  # masked tokens
    return x, head, targets, weights


@pytest.mark.parametrize("n,z,spec,cap", [(4, 0.0, "dv", 0.0), (8, 1e-2, "dv", 0.0), (4, 1e-2, "vd", 0.0),
                                         (4, 1e-2, "vd", 2.0)])
def test_chunked_loss_and_gradients_equal_unchunked(n, z, spec, cap):
    """spec "vd": a tied head, the embedding table [V, D] as stored (its gradient in that layout);
    `cap`: logits soft-capped (c·tanh(z/c)), small enough to bend them."""
    x, head, targets, weights = _inputs()
    if spec == "vd":
        head = head.T

    def combined(fn):  # both outputs feed the gradient, with different cotangents
        def f(x, head):
            loss, xent = fn(x, head)
            return loss + 0.5 * xent
        return jax.value_and_grad(f, argnums=(0, 1))(x, head)

    ref_value, ref_grads = combined(lambda x, h: _reference(x, h if spec == "dv" else h.T, targets, weights, z, cap))
    value, grads = combined(lambda x, h: loss_lib.chunked_loss_sums(x, h, targets, weights, z, n, spec, cap))
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, ref in zip(grads, ref_grads):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(grads[0][0, 50:]).max()) == 0.0  # masked tokens get no gradient


def test_num_chunks_auto_and_explicit():
    small = C.load(["base.yml", "model_name=tiny", "max_target_length=256"])
    assert loss_lib.num_chunks(small, 256) == 1  # 256 × 4096 logits: not worth chunking
    big = C.load(["base.yml", "model_name=tiny", "max_target_length=8192", "vocab_size=128256"])
    assert loss_lib.num_chunks(big, 8192) == 8192 // loss_lib.AUTO_CHUNK
    assert loss_lib.num_chunks(C.load(["base.yml", "num_vocab_tiling=4"]), 256) == 4
    with pytest.raises(C.ConfigError, match="num_vocab_tiling=3 must be"):
        C.load(["base.yml", "num_vocab_tiling=3", "max_target_length=256"])


def test_train_loss_uses_the_chunked_head_and_matches_unchunked():
    """step.loss_sums with num_vocab_tiling=4 vs 1 on a real model: same loss, same gradients."""
    argv = ["base.yml", "model_name=tiny", "max_target_length=64", "dtype=float32",
            "base_num_decoder_layers=2", "z_loss_weight=1e-3", "base_emb_dim=64", "base_mlp_dim=128",
            "vocab_size=512"]
    cfg1, cfg4 = C.load(argv + ["num_vocab_tiling=1"]), C.load(argv + ["num_vocab_tiling=4"])
    (graph1, shapes), (graph4, _) = abstract_params(cfg1), abstract_params(cfg4)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.05, a.shape), a.dtype), shapes)
    tokens = jax.random.randint(jax.random.key(2), (2, 65), 0, cfg1.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "positions": jnp.broadcast_to(jnp.arange(64), (2, 64)),
             "segment_ids": jnp.ones((2, 64), jnp.int32), "weights": jnp.ones((2, 64))}
    grad = jax.value_and_grad(step_lib.loss_sums, has_aux=True)
    (l1, (s1, _)), g1 = jax.jit(lambda p: grad(p, graph1, batch, cfg1.z_loss_weight))(params)
    (l4, (s4, _)), g4 = jax.jit(lambda p: grad(p, graph4, batch, cfg4.z_loss_weight))(params)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    np.testing.assert_allclose(s4["loss"], s1["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):  # f32 summation order only
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b)
    hlo = jax.jit(lambda p: step_lib.loss_sums(p, graph4, batch)[0]).lower(params).as_text()
    assert f"2x64x{cfg1.vocab_size}" not in hlo.replace(",", "x")  # no [B, T, V] logits


def test_vocab_tiles_are_the_largest_divisor_of_the_vocabulary_not_above_the_chunks():
    assert loss_lib.num_vocab_tiles(128256, 16) == 16  # Llama 3's vocabulary, 8192 tokens (auto)
    assert loss_lib.num_vocab_tiles(100278, 16) == 9
    assert loss_lib.num_vocab_tiles(50, 8) == 5 and loss_lib.num_vocab_tiles(50, 4) == 2
    assert loss_lib.num_vocab_tiles(7, 4) == 1  # nothing to tile by: the backward runs untiled


# Llama 3.1-405B as the pipelined plan lays it out (python -m maxlite.plan ... model_name=llama3.1-405b
# dcn_pipeline_parallelism=2: stage 2 × fsdp 256), shrunk to 8 CPU devices: stage 2 × fsdp 4.
PIPELINED_405B = ["base.yml", "model_name=llama3.1-405b", "base_emb_dim=64", "base_mlp_dim=64",
                  "base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=16", "base_num_decoder_layers=2",
                  "vocab_size=2048", "max_target_length=64", "per_device_batch_size=1",
                  "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "cpu_matmul=bf16",
                  "enable_tensorboard=false", "write_report=false"]


def _pipelined(argv: list):
    """(the recipe wired onto 8 CPU devices, its global batch as abstract arrays, the gradient of
    its loss sum w.r.t. the parameters: (params, batch) → (loss sum, gradients))."""
    from maxlite.build import build

    built = build(C.load(argv), jax.devices()[:8], num_processes=1)
    B, T = built.cfg.global_batch_size, built.cfg.max_target_length
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.float32 if k == "weights" else jnp.int32,
                                     sharding=built.batch_sharding)
             for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
    return built, batch, jax.value_and_grad(lambda p, b: step_lib.loss_sums(p, built.graphdef, b)[0])


def test_pipelined_405b_head_gradient_is_never_whole_on_a_device():
    """The backward pass cuts the vocabulary into tiles and reduces each tile's share of the head's
    gradient into the head's own sharding at once. Before, every device summed its tokens' share of
    the whole [D, V] float32 gradient (7.8 GiB per chip at 405B) before reducing it: here that is an
    f32 value of D·V elements in the compiled program. The only ones left are the forward pass's
    all-gather of the head's weights (XLA's CPU dot gathers the bf16-rounded head in float32; a TPU
    gathers bf16), never a product, a sum or the tiles stacked. Compile only."""
    import math
    import re

    from flax import nnx

    from maxlite import mesh as mesh_lib

    built, batch, grad = _pipelined([*PIPELINED_405B, "num_vocab_tiling=4"])
    D, V = built.cfg.base_emb_dim, built.cfg.vocab_size
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), built.abstract.params,
                          built.shardings.params)

    @jax.jit
    def head_gradient(params, batch):  # no output sharding asked for: what the loss's backward gives
        loss, grads = grad(params, batch)
        return loss, grads["unembedding"][...]

    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        compiled = head_gradient.lower(params, batch).compile()
    values = re.findall(r"%(\S+) = f32\[([\d,]+)\]\S* ([\w-]+)\(", compiled.as_text())  # name, dims, op
    whole = {(name, dims) for name, dims, op in values
             if math.prod(map(int, dims.split(","))) >= D * V and op != "all-gather"}
    assert not whole, whole
    head_sharding = built.shardings.params["unembedding"].get_value()  # and it leaves split like the head
    assert compiled.output_shardings[1].is_equivalent_to(head_sharding, 2), compiled.output_shardings[1]


def test_pipelined_405b_vocab_tiled_loss_and_gradients_equal_untiled():
    """The same pipelined layout on 8 devices in float32: num_vocab_tiling=4 (sequence chunks forward,
    vocabulary tiles backward) against 1 (plain autodiff), same weights and tokens: the same loss
    and every parameter's gradient (the head's, and through the input gradient the layers')."""
    from flax import nnx

    from maxlite import mesh as mesh_lib

    argv = [*PIPELINED_405B, "dtype=float32", "vocab_size=500"]  # 500 = 4 tiles of 125 words
    results = []
    for n in (4, 1):
        built, batch, grad = _pipelined([*argv, f"num_vocab_tiling={n}"])
        rng = np.random.default_rng(0)
        params = jax.tree.map(lambda a, s: jax.device_put(rng.normal(0, 0.05, a.shape).astype(a.dtype), s),
                              built.abstract.params, built.shardings.params)
        tokens = rng.integers(0, built.cfg.vocab_size, (batch["inputs"].shape[0], batch["inputs"].shape[1] + 1))
        B, T = batch["inputs"].shape
        data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.broadcast_to(np.arange(T), (B, T)),
                "segment_ids": np.ones((B, T), np.int32), "weights": (rng.random((B, T)) > 0.1).astype(np.float32)}
        data = {k: jax.device_put(v.astype(batch[k].dtype), built.batch_sharding) for k, v in data.items()}
        with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
            results.append(jax.device_get(jax.jit(grad)(params, data)))
    (loss4, grads4), (loss1, grads1) = results
    np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads4), jax.tree.leaves(grads1)):  # f32 summation order only
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b)
