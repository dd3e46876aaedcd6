"""Every attention implementation equals dot_product (values and gradients) with packing and GQA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlite import config as C
from maxlite.models import attention, cudnn_attention, names
from tests.helpers import plain_attention

# f32 inputs: the implementations differ only in summation order and the online softmax
TOL = dict(rtol=2e-4, atol=2e-5)


def _inputs(B=2, T=256, N=4, K=2, H=32, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32)
    k = jax.random.normal(kk, (B, T, K, H), jnp.float32)
    v = jax.random.normal(kv, (B, T, K, H), jnp.float32)
    dout = jax.random.normal(kd, (B, T, N, H), jnp.float32)
    # packed rows: three documents in row 0 (boundaries not on block edges), one in row 1
    seg = np.ones((B, T), np.int32)
    seg[0, 70:190], seg[0, 190:] = 2, 3
    return q, k, v, jnp.asarray(seg), dout


def _value_and_grads(fn, q, k, v, seg, dout):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return out, vjp(dout)


def _check_equal(fn, inputs):
    q, k, v, seg, dout = inputs
    ref_out, ref_grads = _value_and_grads(attention.dot_product, q, k, v, seg, dout)
    out, grads = _value_and_grads(fn, q, k, v, seg, dout)
    np.testing.assert_allclose(out, ref_out, **TOL)
    for g, ref in zip(grads, ref_grads):  # dq, dk, dv (dk, dv summed over the query group)
        np.testing.assert_allclose(g, ref, **TOL)


def _masked_reference(q, k, v, seg, window=0, scale=None):
    """Attention written out plainly (kv heads repeated, an explicit [B, T, S] mask): the rule is
    key j visible to query i iff j <= i, same document, and i - j < window when window > 0."""
    return plain_attention(q, k, v, seg, window, scale)


def _check_against_reference(fn, inputs, window, scale=None):
    q, k, v, seg, dout = inputs
    ref = functools.partial(_masked_reference, window=window, scale=scale)
    ref_out, ref_grads = _value_and_grads(ref, q, k, v, seg, dout)
    out, grads = _value_and_grads(fn, q, k, v, seg, dout)
    np.testing.assert_allclose(out, ref_out, **TOL)
    for g, r in zip(grads, ref_grads):  # dq, dk, dv
        np.testing.assert_allclose(g, r, **TOL)


# windows below one block (40 < 64), above it (150), of one token, and past the sequence (global)
WINDOWS = [40, 150, 1, 300]


@pytest.mark.parametrize("window", [0, *WINDOWS])
def test_dot_product_equals_the_masked_reference_with_and_without_a_window(window):
    _check_against_reference(lambda q, k, v, s: attention.dot_product(q, k, v, s, window=window),
                             _inputs(), window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block", [64, 128])
def test_blockwise_sliding_window_equals_the_masked_reference(window, block):
    """Packed documents (boundaries off the block edges) and GQA, values and dq/dk/dv."""
    _check_against_reference(lambda q, k, v, s: attention.blockwise(q, k, v, s, block, window=window),
                             _inputs(), window)


def test_blockwise_visits_only_the_key_blocks_a_window_reaches():
    """O(T·W) work: the scan runs ⌈(W−1)/C⌉+1 key-block offsets forward and backward, not T/C."""
    q, k, v, seg, dout = _inputs(T=512)

    def scan_lengths(window):
        loss = lambda q, k, v: jnp.sum(attention.blockwise(q, k, v, seg, 64, window=window) * dout)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
        return sorted(e.params["length"] for e in _equations(jaxpr) if e.primitive.name == "scan")

    assert scan_lengths(0) == [512 // 64] * 2
    assert scan_lengths(100) == [3, 3]  # keys i-99 … i span at most 3 blocks of 64
    assert scan_lengths(65) == [2, 2] and scan_lengths(66) == [3, 3]  # i-64 is one block back, i-65 two


def _equations(jaxpr):
    import jax.extend
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def test_a_query_scale_other_than_the_head_dim_reaches_every_implementation():
    """Gemma 3's query_pre_attn_scalar: the scores scaled by 1/√(that), not 1/√H."""
    inputs, scale = _inputs(), 0.3
    _check_against_reference(lambda q, k, v, s: attention.dot_product(q, k, v, s, window=40, scale=scale),
                             inputs, 40, scale)
    _check_against_reference(lambda q, k, v, s: attention.blockwise(q, k, v, s, 64, window=40, scale=scale),
                             inputs, 40, scale)


def test_dot_product_keeps_packed_documents_apart():
    q, k, v, seg, _ = _inputs()
    out = attention.dot_product(q, k, v, seg)
    # the third document alone gives the same output for its tokens: nothing leaks in from before
    alone = attention.dot_product(q[:1, 190:], k[:1, 190:], v[:1, 190:], seg[:1, 190:])
    np.testing.assert_allclose(out[:1, 190:], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [64, 128])
def test_blockwise_equals_dot_product(block):
    _check_equal(lambda q, k, v, s: attention.blockwise(q, k, v, s, block), _inputs())


def _image_blocks(T=256):
    """Each token's image block (−1: none): row 0 an image of 150 tokens from 20 (it reaches three key
    blocks of 64 ahead of its first: 20 … 169) and one of 9 across the block edge at 190 (where the
    third document starts: 186 … 194); row 1 one of 30 ending at the sequence's end."""
    blocks = np.full((2, T), -1, np.int32)
    blocks[0, 20:170], blocks[0, 186:195], blocks[1, T - 30:] = 0, 1, 0
    return jnp.asarray(blocks)


@pytest.mark.parametrize("window", [0, 40])
def test_blockwise_draws_image_blocks_as_dot_product(window):
    """Gemma 3's images: a query sees every key of its own image, later ones too (key blocks ahead of its
    own), within its document and window; values and dq/dk/dv equal dot_product's."""
    blocks = _image_blocks()
    ref = lambda q, k, v, s: attention.dot_product(q, k, v, s, window=window, blocks_BT=blocks)  # noqa: E731
    inputs = _inputs()
    q, k, v, seg, dout = inputs
    ref_out, _ = _value_and_grads(ref, q, k, v, seg, dout)
    causal, _ = _value_and_grads(lambda q, k, v, s: attention.dot_product(q, k, v, s, window=window), q, k, v, seg,
                                 dout)
    assert not np.allclose(ref_out, causal, **TOL)  # the image blocks change what the queries see
    assert int(attention.blocks_ahead(blocks, 64)) == 3
    for block in (64, 128):
        q, k, v, seg, dout = inputs
        out, grads = _value_and_grads(
            lambda q, k, v, s: attention.blockwise(q, k, v, s, block, window=window, blocks_BT=blocks), q, k, v, seg,
            dout)
        ref_out, ref_grads = _value_and_grads(ref, q, k, v, seg, dout)
        np.testing.assert_allclose(out, ref_out, **TOL)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r, **TOL)


def test_blocks_ahead_counts_the_longest_image():
    none = jnp.full((1, 64), -1, jnp.int32)
    assert int(attention.blocks_ahead(none, 16)) == 0
    one = none.at[0, 10:27].set(0)  # 17 tokens: the last is 16 on, one block of 16
    assert int(attention.blocks_ahead(one, 16)) == 1 and int(attention.blocks_ahead(one.at[0, 27].set(0), 16)) == 2
    # two images back to back are two blocks (ids 0 and 1), not one run of their sum
    assert int(attention.blocks_ahead(none.at[0, 0:16].set(0).at[0, 16:32].set(1), 16)) == 1
    assert int(attention.blocks_ahead(jnp.zeros((1, 64), jnp.int32), 16)) == 3  # capped at the sequence


def test_blockwise_in_bfloat16_stays_close():
    q, k, v, seg, dout = _inputs()
    ref = attention.dot_product(q, k, v, seg)
    cast = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = attention.blockwise(*cast, seg, 64).astype(jnp.float32)
    np.testing.assert_allclose(out, ref, rtol=0.05, atol=0.05)


def test_blockwise_never_builds_the_full_score_matrix():
    q, k, v, seg, dout = _inputs(T=512)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention.blockwise(q, k, v, seg, 64) * dout),
                            argnums=(0, 1, 2)))
    hlo = grad.lower(q, k, v).as_text()
    assert "512x512" not in hlo.replace(",", "x")  # no [.., T, S] buffer, forward or backward
    ref_hlo = jax.jit(lambda q, k, v: attention.dot_product(q, k, v, seg)).lower(q, k, v).as_text()
    assert "512x512" in ref_hlo.replace(",", "x")  # the check would see one


def test_flash_splash_kernel_equals_dot_product_in_interpret_mode():
    cfg = C.load(["base.yml"] + [f"sa_{k}=128" for k in attention._SPLASH_KEYS])
    sizes = attention.splash_block_sizes(cfg, 256)
    _check_equal(lambda q, k, v, s: attention.flash(q, k, v, s, sizes), _inputs(B=1, N=2, K=1))


@pytest.mark.parametrize("window", [40, 150])  # below and above the 128 block
def test_flash_local_mask_equals_the_masked_reference_in_interpret_mode(window):
    cfg = C.load(["base.yml"] + [f"sa_{k}=128" for k in attention._SPLASH_KEYS])
    sizes = attention.splash_block_sizes(cfg, 256)
    _check_against_reference(lambda q, k, v, s: attention.flash(q, k, v, s, sizes, window=window, scale=0.2),
                             _inputs(B=1, N=2, K=1), window, 0.2)


def test_segment_offsets_give_each_document_its_start_and_length():
    _, _, _, seg, _ = _inputs()  # row 0: documents at 0, 70 and 190 of 256; row 1: one
    offsets, lengths, fits = cudnn_attention.segment_offsets(seg, 4)
    np.testing.assert_array_equal(offsets, [[0, 70, 190, -1, -1], [0, -1, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[70, 120, 66, -1], [256, -1, -1, -1]])
    assert bool(fits)
    assert bool(cudnn_attention.segment_offsets(seg, 3)[2]) and not bool(cudnn_attention.segment_offsets(seg, 2)[2])
    padded = np.array([[1, 1, 2, 2, 2, 0, 0, 0]], np.int32)  # padding is one more run
    offsets, lengths, _ = cudnn_attention.segment_offsets(jnp.asarray(padded), 3)
    np.testing.assert_array_equal(offsets, [[0, 2, 5, -1]])
    np.testing.assert_array_equal(lengths, [[2, 3, 3]])


def _relative_errors(got, ref):
    return [float(jnp.linalg.norm(g.astype(jnp.float32) - r) / jnp.linalg.norm(r))
            for g, r in zip(got, ref)]


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="cuDNN attention needs an NVIDIA GPU "
                    "(run with MAXLITE_TEST_PLATFORMS=cuda)")
@pytest.mark.parametrize("window", [0, 40, 150])
@pytest.mark.parametrize("max_segments", [0, 2, 32])  # the dense mask; too few: the fallback; packed
def test_cudnn_flash_equals_dot_product(max_segments, window):
    q, k, v, seg, dout = _inputs(H=64)
    with jax.default_matmul_precision("highest"):  # an f32 reference (GPUs default to TF32)
        ref = functools.partial(_masked_reference, window=window)
        ref_out, ref_grads = _value_and_grads(ref, q, k, v, seg, dout)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v, dout)]
    cudnn = functools.partial(cudnn_attention.cudnn_flash, max_segments=max_segments, window=window)
    out, grads = _value_and_grads(cudnn, *bf16[:3], seg, bf16[3])
    errors = _relative_errors((out, *grads), (ref_out, *ref_grads))
    # bf16 operands: ‖out − ref‖/‖ref‖ lands between 1e-3 and 1e-2; a leak across documents or
    # through the causal mask is an error of about 0.6 on these inputs
    assert max(errors) < 1e-2, errors


@pytest.mark.parametrize("platform,T,expected", [
    ("tpu", 256, "flash"), ("gpu", 256, "cudnn_flash"), ("cpu", 256, "dot_product"),
    ("cpu", names.BLOCKWISE_MIN_LENGTH, "blockwise"), ("cpu", 2560, "blockwise"),
    ("cpu", 2304, "dot_product"), ("tpu", 768, "dot_product")])  # 512-blocks that do not tile T
def test_autoselected_is_resolved_once_with_the_config(platform, T, expected):
    """What runs is what the config says after `resolve` (build, the planner): the fallback too."""
    def resolved(*keys):
        return C.resolve(C.load(["base.yml", f"max_target_length={T}", *keys]), 1, platform=platform).attention
    assert resolved() == expected
    assert resolved("attention=dot_product") == "dot_product"
    assert C.resolve(C.load(["base.yml"]), 1).attention == "autoselected"  # no platform: nothing resolved


def test_a_float32_model_on_a_gpu_is_not_given_cudnn():
    """cuDNN's fused attention takes 16-bit inputs only (JAX raises NotImplementedError on float32,
    seen on an H200): a float32 model's autoselected attention on a GPU is chosen as on a CPU, and
    cudnn_flash named with float32 is one line before any work."""
    def resolved(*keys):
        return C.resolve(C.load(["base.yml", "dtype=float32", *keys]), 1, platform="gpu").attention
    assert resolved("max_target_length=256") == "dot_product"
    assert resolved(f"max_target_length={names.BLOCKWISE_MIN_LENGTH}") == "blockwise"
    assert C.resolve(C.load(["base.yml", "dtype=bfloat16"]), 1, platform="gpu").attention == "cudnn_flash"
    with pytest.raises(C.ConfigError, match="cudnn_flash takes bfloat16 .*not dtype=float32"):
        resolved("attention=cudnn_flash")


def test_bad_attention_keys_are_one_line_errors():
    with pytest.raises(C.ConfigError, match="attention='fast'"):
        C.load(["base.yml", "attention=fast"])
    with pytest.raises(C.ConfigError, match="attention_block_size=100 must divide"):
        C.load(["base.yml", "attention=blockwise", "attention_block_size=100"])
    with pytest.raises(C.ConfigError, match="max_segments_per_seq=-1 must be >= 0"):
        C.load(["base.yml", "max_segments_per_seq=-1"])


@pytest.mark.slow  # ~40 s (blockwise) and ~2 min (flash) on 2 cores; the per-function tests above
@pytest.mark.parametrize("impl", ["blockwise", "flash"])  # cover values and gradients in the default run
def test_recipe_switching_attention_trains_to_the_same_losses(impl):
    """Two steps of a recipe on a 2-device fsdp mesh follow dot_product's losses (flash: the splash
    kernel in interpret mode inside shard_map)."""
    from tests.helpers import train_losses

    argv = ["base.yml", "model_name=tiny", "max_target_length=128", "base_num_decoder_layers=2",
            "per_device_batch_size=1", "dtype=float32", "enable_checkpointing=false",
            "attention_block_size=32"]
    ref, _ = train_losses(argv + ["attention=dot_product"], 2, 2)
    losses, _ = train_losses(argv + [f"attention={impl}"], 2, 2)
    np.testing.assert_allclose(losses, ref, rtol=1e-4)
