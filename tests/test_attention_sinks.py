"""Attention sinks (gpt-oss): every implementation, and over context shards, equals attention written
out plainly with the sink as one more column of each softmax that takes no value (values, dq, dk,
dv and d sinks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C, mesh as mesh_lib
from maxlite.models import attention, context, names
from tests.helpers import plain_attention

TOL = dict(rtol=2e-4, atol=2e-5)


def _inputs(B=2, T=64, N=4, K=2, H=16, seed=0):
    kq, kk, kv, kd, ks = jax.random.split(jax.random.key(seed), 5)
    q, dout = (jax.random.normal(key, (B, T, N, H)) for key in (kq, kd))
    k, v = (jax.random.normal(key, (B, T, K, H)) for key in (kk, kv))
    sinks = 2.0 * jax.random.normal(ks, (N,))  # large enough to take a real share of each row
    seg = np.ones((B, T), np.int32)
    seg[0, 13:40], seg[0, 40:] = 2, 3  # packed documents
    return q, k, v, sinks, jnp.asarray(seg), dout


def _reference(q, k, v, sinks, seg, window=0):
    """Hugging Face's eager gpt-oss attention: the sink a last column of the masked scores."""
    return plain_attention(q, k, v, seg, window, sinks=sinks)


def _value_and_grads(fn, q, k, v, sinks, dout):
    out, vjp = jax.vjp(fn, q, k, v, sinks)
    return out, vjp(dout)


def _check(fn, inputs, window):
    q, k, v, sinks, seg, dout = inputs
    ref_out, ref_grads = _value_and_grads(lambda *a: _reference(*a, seg, window), q, k, v, sinks, dout)
    out, grads = _value_and_grads(fn, q, k, v, sinks, dout)
    np.testing.assert_allclose(out, ref_out, **TOL)
    for g, ref in zip(grads, ref_grads):  # dq, dk, dv, dsinks
        np.testing.assert_allclose(g, ref, **TOL)


@pytest.mark.parametrize("window", [0, 12])
def test_dot_product_with_sinks_equals_the_plain_reference(window):
    _check(lambda q, k, v, s: attention.dot_product(q, k, v, _inputs()[4], window=window, sinks_N=s), _inputs(),
           window)


@pytest.mark.parametrize("window,block", [(0, 16), (12, 8)])
def test_blockwise_with_sinks_equals_the_plain_reference(window, block):
    seg = _inputs()[4]
    _check(lambda q, k, v, s: attention.blockwise(q, k, v, seg, block, window=window, sinks_N=s), _inputs(), window)


def test_flash_splash_kernel_with_sinks_equals_the_plain_reference_in_interpret_mode():
    inputs = _inputs(B=1, T=256, N=2, K=1, H=32)
    cfg = C.load(["base.yml", "attention=flash", "max_target_length=256", *[f"sa_{k}=128" for k in attention._SPLASH_KEYS]])
    seg = inputs[4]
    _check(lambda q, k, v, s: attention.attend(cfg, q, k, v, seg, window=100, sinks_N=s), inputs, 100)


def test_cudnn_flash_with_sinks_resolves_to_blockwise_once():
    """JAX's cuDNN call takes no sinks: what runs (and what status.json names) is blockwise."""
    assert names.resolve_attention("cudnn_flash", "gpu", 4096, 512, 512, 1, sinks=True) == "blockwise"
    assert names.resolve_attention("autoselected", "gpu", 4096, 512, 512, 1, sinks=True) == "blockwise"
    assert names.resolve_attention("autoselected", "gpu", 4096, 512, 512, 1) == "cudnn_flash"
    cfg = C.resolve(C.load(["base.yml", "attention=cudnn_flash", "attention_sink=true", "max_target_length=1024",
                            "attention_block_size=256"]), 1, platform="gpu")
    assert cfg.attention == "blockwise"


@pytest.mark.parametrize("impl,balance,window,T,n", [
    ("dot_product", True, 12, 64, 4), ("blockwise", False, 0, 64, 4), ("blockwise", True, 12, 64, 4),
    # splash's blocks are at least 128 tokens: 512 over 2 shards, two chunks of 128 each (one row)
    ("flash", True, 200, 512, 2)])
def test_sinks_over_context_shards_equal_the_plain_reference(impl, balance, window, T, n):
    B = 1 if impl == "flash" else 2  # the Pallas interpreter is slow: one row of two heads
    q, k, v, sinks, seg, dout = _inputs(B=B, T=T, N=4 // B, K=2 // B)
    cfg = C.load(["base.yml", f"attention={impl}", "attention_block_size=8", f"max_target_length={T}",
                  f"context_parallel_load_balance={balance}", *[f"sa_{k}=128" for k in attention._SPLASH_KEYS]])
    mesh_cfg = C.resolve(C.load(["base.yml", f"ici_context_parallelism={n}", f"max_target_length={T}",
                                 f"per_device_batch_size={B / n}"]), n)
    mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:n])
    to, back = ((lambda x: context.to_balanced(x, n), lambda x: context.from_balanced(x, n)) if balance
                else (lambda x: x, lambda x: x))

    def split(q, k, v, s):
        return back(attention.attend(cfg, to(q), to(k), to(v), to(seg), window=window, sinks_N=s))

    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        assert context.shards() == n
        out, grads = jax.jit(lambda *a: _value_and_grads(split, *a))(q, k, v, sinks, dout)
    ref_out, ref_grads = _value_and_grads(lambda *a: _reference(*a, seg, window), q, k, v, sinks, dout)
    np.testing.assert_allclose(out, ref_out, **TOL)
    for g, ref in zip(grads, ref_grads):
        np.testing.assert_allclose(g, ref, **TOL)
