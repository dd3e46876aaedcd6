"""Context parallelism (maxlite/models/context.py): attention over a sequence split across 4
simulated devices (context=4), and across 8 (context=4 × fsdp=2: the batch split too), equals one
device's (values and dq/dk/dv) with packed documents, GQA and a sliding window, with and without
load balance; the balanced layout; the batch rule of a fraction of a sequence per device. Training
across the axis: tests/test_context_train.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C, mesh as mesh_lib
from maxlite.models import attention, context, cudnn_attention

# f32 inputs: one device and four differ only in summation order (≤ 2e-6 seen)
TOL = dict(rtol=1e-5, atol=1e-5)


def test_balanced_layout_gives_shard_i_chunks_i_and_2n_minus_1_minus_i():
    # n = 2 shards, T = 8: chunks of 2 tokens; shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2
    expected = [0, 1, 6, 7, 2, 3, 4, 5]
    assert context.balanced_order(8, 2).tolist() == expected
    x = jnp.arange(16).reshape(2, 8) * 10
    assert context.to_balanced(x, 2).tolist() == [[10 * p for p in expected], [80 + 10 * p for p in expected]]
    assert context.from_balanced(context.to_balanced(x, 2), 2).tolist() == x.tolist()


def _inputs(B=2, T=64, N=4, K=2, H=16):
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(key, (B, T, N, H)) for key in (kq, kd))
    k, v = (jax.random.normal(key, (B, T, K, H)) for key in (kk, kv))
    seg = np.ones((B, T), np.int32)
    seg[0, 13:40], seg[0, 40:] = 2, 3  # three packed documents, boundaries inside shards
    return q, k, v, jnp.asarray(seg), dout


def _value_and_grads(fn, q, k, v, dout):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(dout)


def _split_equals_one_device(attend, n: int, T: int, balance: bool, window: int, H: int = 16, fsdp: int = 1):
    """attend(q, k, v, seg) on a mesh of n context shards × fsdp batch shards (inputs in the layout
    the step gives attention: balanced or not) against dot_product on one device: values and dq,
    dk, dv."""
    q, k, v, seg, dout = _inputs(T=T, H=H)
    ref_out, ref_grads = _value_and_grads(lambda q, k, v: attention.dot_product(q, k, v, seg, window=window),
                                          q, k, v, dout)
    devices = n * fsdp
    mesh_cfg = C.resolve(C.load(["base.yml", f"ici_context_parallelism={n}", f"ici_fsdp_parallelism={fsdp}",
                                 f"max_target_length={T}", f"per_device_batch_size={2 / devices}"]), devices)
    mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:devices])
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        assert context.shards() == n and mesh.shape["fsdp"] == fsdp
        # compare in sequence order
        to, back = ((lambda x: context.to_balanced(x, n), lambda x: context.from_balanced(x, n)) if balance
                    else (lambda x: x, lambda x: x))

        def split(q, k, v):
            return back(attend(to(q), to(k), to(v), to(seg)))

        out, grads = jax.jit(lambda q, k, v, d: _value_and_grads(split, q, k, v, d))(q, k, v, dout)
    np.testing.assert_allclose(out, ref_out, **TOL)
    for g, ref in zip(grads, ref_grads):  # dq, dk, dv
        np.testing.assert_allclose(g, ref, **TOL)


@pytest.mark.parametrize("impl,balance,window,fsdp", [
    ("dot_product", True, 12, 1), ("dot_product", False, 0, 1), ("blockwise", True, 0, 1), ("blockwise", False, 12, 1),
    # 8 devices: each of the two rows on its own 4 context shards
    ("blockwise", True, 12, 2), ("blockwise", False, 0, 2)])
def test_attention_over_four_shards_equals_one_device(impl, balance, window, fsdp):
    """GQA (4 query heads, 2 kv heads), three documents in one row, T = 64 over 4 shards (16
    tokens each; with load balance two chunks of 8), blockwise blocks of 8 tokens; on 4 devices,
    or on 8 with the two rows split over fsdp=2."""
    T = 64
    cfg = C.load(["base.yml", f"attention={impl}", "attention_block_size=8", f"max_target_length={T}",
                  f"context_parallel_load_balance={balance}"])
    _split_equals_one_device(lambda *a: attention.attend(cfg, *a, window=window), 4, T, balance, window, fsdp=fsdp)


def test_flash_over_two_shards_equals_one_device_in_interpret_mode():
    """The splash kernel (Pallas interpreter on CPU) with its mask info split over the shards and
    query rows in the balanced layout, a sliding window; its blocks are at least 128 tokens, so 512
    tokens over 2 shards (two chunks of 128 each)."""
    T = 512
    cfg = C.load(["base.yml", "attention=flash", f"max_target_length={T}", "context_parallel_load_balance=true",
                  *[f"sa_{k}=128" for k in attention._SPLASH_KEYS]])
    _split_equals_one_device(lambda *a: attention.attend(cfg, *a, window=200), 2, T, True, 200)


def test_cudnn_flash_shard_path_equals_one_device(monkeypatch):
    """cudnn_flash's per-shard path — query rows at their sequence positions against the gathered
    keys, a dense mask per CUDNN_SHARD_ROWS rows — through jax.nn.dot_product_attention's XLA
    implementation (the cuDNN kernel itself needs a GPU)."""
    monkeypatch.setattr(cudnn_attention, "CUDNN_SHARD_ROWS", 4)  # several row blocks per chunk

    def attend(q, k, v, seg):
        def local(q, k, v, qseg, kseg, chunks):
            return cudnn_attention.shard(q, k, v, qseg, kseg, context.query_positions(chunks), 12,
                                          q.shape[-1] ** -0.5, implementation="xla")
        return context.across_shards(local, q, k, v, seg, True)

    _split_equals_one_device(attend, 4, 64, True, 12)


@pytest.mark.parametrize("pdbs,context_size,ok", [(0.25, 4, True), (0.5, 2, True), (0.5, 1, False),
                                                  (0.25, 2, False)])
def test_a_fraction_of_a_sequence_per_device_needs_the_context_axis_to_make_it_whole(pdbs, context_size, ok):
    argv = ["base.yml", "model_name=tiny", f"per_device_batch_size={pdbs}",
            f"ici_context_parallelism={context_size}"]
    if ok:
        c = C.resolve(C.load(argv), 8)
        assert c.global_batch_size == round(pdbs * 8) and c.axis_size("context") == context_size
        assert c.axis_size("fsdp") == 8 // context_size
    else:
        with pytest.raises(C.ConfigError, match="not a whole number"):
            C.resolve(C.load(argv), 8)


def test_context_keys_are_checked_against_the_sequence():
    with pytest.raises(C.ConfigError, match="max_target_length=100 must be divisible by 8"):
        C.resolve(C.load(["base.yml", "model_name=tiny", "max_target_length=100", "per_device_batch_size=0.25",
                          "ici_context_parallelism=4"]), 8)
    # without load balance 4 chunks are enough
    c = C.resolve(C.load(["base.yml", "model_name=tiny", "max_target_length=100", "per_device_batch_size=0.25",
                          "ici_context_parallelism=4", "context_parallel_load_balance=false"]), 8)
    assert c.axis_size("context") == 4
    # a sequence's devices lie within one process or span whole processes (tests/test_context_procs.py
    # trains one over 2 processes): 4 over processes of 2 devices, not 2 over processes of 3
    c = C.resolve(C.load(["base.yml", "model_name=tiny", "per_device_batch_size=0.5", "ici_context_parallelism=4"]),
                  8, num_processes=4)
    assert c.axis_size("context") == 4
    with pytest.raises(C.ConfigError, match="context × tensor = 2 devices share a sequence but a process has 3: "
                                            "they must lie within one process or span whole processes"):
        C.resolve(C.load(["base.yml", "model_name=tiny", "per_device_batch_size=0.5", "ici_context_parallelism=2"]),
                  6, num_processes=2)
