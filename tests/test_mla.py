"""Multi-head latent attention (maxlite/models/mla.py): every attention implementation gives the
plain written-out MLA (values of their own width, one shared RoPE key, packed documents apart) in
values and gradients; the latent a decode step attends to is what the training heads expand from."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C
from maxlite.models import attention, mla
from maxlite.models.layers import apply_rope, rope_frequencies

T = 256
KEYS = ["base.yml", "base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "attention_type=mla", "q_lora_rank=24",
        "kv_lora_rank=16", "qk_nope_head_dim=12", "qk_rope_head_dim=8", "v_head_dim=8", "dtype=float32",
        f"max_target_length={T}", "attention_block_size=64", *[f"sa_{k}=128" for k in attention._SPLASH_KEYS]]


@pytest.fixture(scope="module")
def layer():
    cfg = C.load(KEYS)
    with nnx.use_eager_sharding(False):
        module = mla.MLA(cfg, rngs=nnx.Rngs(params=0))
    x = jax.random.normal(jax.random.key(1), (1, T, 32), jnp.float32)
    seg = np.ones((1, T), np.int32)
    seg[0, 70:190], seg[0, 190:] = 2, 3  # three packed documents, boundaries off the block edges
    return cfg, module, x, jnp.asarray(seg)


def _plain(m, x, seg, window=0):
    """MLA written out: every head's key [k_nope, k_rope] and value from the latent, an explicit
    [T, S] mask, scores scaled by 1/sqrt(P + R)."""
    cfg = m.cfg
    P, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    inv = jnp.asarray(rope_frequencies(cfg, dims=R), jnp.float32)
    pos = jnp.arange(x.shape[1])[None]
    q = jnp.einsum("btq,qnk->btnk", m.q_norm(x @ m.q_a[...]), m.q_b[...])
    kv = x @ m.kv_a[...]
    c, k_rope = m.kv_norm(kv[..., :cfg.kv_lora_rank]), apply_rope(kv[..., None, cfg.kv_lora_rank:], pos, inv)
    up = jnp.einsum("bsc,cnk->bsnk", c, m.kv_b[...])
    scores = (jnp.einsum("btnp,bsnp->bnts", q[..., :P], up[..., :P])
              + jnp.einsum("btnr,bsr->bnts", apply_rope(q[..., P:], pos, inv), k_rope[:, :, 0])) * (P + R) ** -0.5
    i, j = np.arange(x.shape[1])[:, None], np.arange(x.shape[1])[None]
    mask = ((j <= i) & ((i - j < window) if window else True))[None] & (seg[:, :, None] == seg[:, None, :])
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnv,nvd->btd", probs, up[..., P:], m.o[...])


def _value_and_grads(fn, module, x):
    graphdef, params = nnx.split(module)

    def loss(params, x):
        out = fn(nnx.merge(graphdef, params), x)
        return jnp.sum(out * jnp.cos(out)), out  # a loss whose gradient differs per element
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return out, jax.tree.leaves(grads)


@pytest.mark.parametrize("impl, window", [("dot_product", 0), ("blockwise", 0), ("blockwise", 40), ("flash", 0)])
def test_every_attention_implementation_computes_plain_mla(layer, impl, window):
    """Values (P + R = 20 wide against V = 8) padded to the queries' width reach every implementation;
    the padding never shows in the output or the gradients. flash: the splash kernel interpreted."""
    cfg, module, x, seg = layer
    cfg = dataclasses.replace(cfg, attention=impl, sliding_window=window)
    module = nnx.merge(*nnx.split(module))
    module.cfg = cfg
    pos = jnp.arange(T)[None]
    ref_out, ref_grads = _value_and_grads(lambda m, x: _plain(m, x, seg, window), module, x)
    out, grads = _value_and_grads(lambda m, x: m(x, pos, seg, local=bool(window)), module, x)
    np.testing.assert_allclose(out, ref_out, rtol=2e-4, atol=2e-5)
    for g, r in zip(grads, ref_grads):  # every parameter and the input
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5)


def test_cudnn_runs_mla_on_a_gpu(layer):
    """cuDNN's head-width rules: MLA's padded heads (P + R = 20 here; DeepSeek 192) run as they are."""
    if jax.devices()[0].platform != "gpu":
        pytest.skip("cuDNN attention needs an NVIDIA GPU (run with MAXLITE_TEST_PLATFORMS=cuda)")
    cfg, module, x, seg = layer
    module.cfg = dataclasses.replace(cfg, attention="cudnn_flash")
    out = module(x.astype(jnp.bfloat16), jnp.arange(T)[None], seg)
    ref = _plain(module, x, seg)
    assert float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)) < 1e-2
